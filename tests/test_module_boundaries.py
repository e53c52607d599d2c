"""No module of the package imports another module's private names (issue: one front door): a helper two modules
share is public in one of them, or lives in an internal ``_*`` module (``_checks``, ``_layout``, ...)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "rollout_corr_ext")


def _modules():
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(d, f)


def _aliases(tree) -> set:
    """Local names bound to the package's own public modules (``from . import losses as _losses``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and ((node.level >= 1 and not node.module) or
                                                 node.module == "rollout_corr_ext"):
            out |= {a.asname or a.name for a in node.names if not a.name.startswith("_")}
    return out


def test_no_module_uses_another_modules_private_names():
    bad = []
    for path in _modules():
        tree = ast.parse(open(path, encoding="utf-8").read())
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            own = node.level >= 1 or (node.module or "").startswith("rollout_corr_ext.") if isinstance(
                node, ast.ImportFrom) else False
            if own and node.module and not node.module.split(".")[-1].startswith("_"):
                bad += [f"{os.path.relpath(path, ROOT)}: from .{node.module} import {a.name}"
                        for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)
