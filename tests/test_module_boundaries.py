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


#: The pieces of a policy step: :func:`rollout_corr_ext.losses.policy_step` puts them together, in one place.
FLOW_PIECES = {"compute_rollout_correction", "off_policy_sequence_mask", "gspo_sequence_log_ratio", "policy_loss_step",
               "proximal_log_prob", "proximal_error_metrics", "token_loss_kind", "compute_policy_loss_bypass",
               "compute_policy_loss_decoupled", "compute_policy_loss_vanilla", "compute_policy_loss_reinforce"}


def _names(path) -> set:
    """Every name a module binds or reads: imported names, plain names, attribute names, string constants (a getattr
    by name counts too)."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
    return out


def test_megatron_loss_func_is_a_translation_of_the_one_policy_step():
    """megatron's loss_func chooses no flow of its own (issue: one front door): it calls losses.policy_step and uses
    none of the step's pieces, and imports only public names from losses."""
    names = _names(os.path.join(PKG, "megatron.py"))
    assert "policy_step" in names
    assert not names & FLOW_PIECES, sorted(names & FLOW_PIECES)
    tree = ast.parse(open(os.path.join(PKG, "megatron.py"), encoding="utf-8").read())
    from_losses = [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "losses"
                   for a in node.names]
    assert from_losses and not [n for n in from_losses if n.startswith("_")], from_losses
