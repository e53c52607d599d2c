"""Every switch in one place: the table in rollout_corr_ext/_env.py, the page docs/configuration.md and the sources
agree. A ROLLOUT_CORR_* name that a source mentions is in the table and on the page; in the package, only _env.py
reads the environment (os.environ / os.getenv), and in csrc only csrc/cpu/switches.h calls getenv."""

import os
import re

from rollout_corr_ext import _env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"\bROLLOUT_CORR_[A-Z][A-Z_]*[A-Z]\b")


def _files(top, exts):
    for base, _, names in os.walk(os.path.join(ROOT, top)):
        for n in names:
            if n.endswith(exts):
                yield os.path.join(base, n)


def test_every_switch_a_source_names_is_in_the_table_and_on_the_page():
    table = {s.name for s in _env.SWITCHES}
    page = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    rows = set(re.findall(r"^\| `([A-Z_]+)` \|", page, re.M))
    assert rows == table, (sorted(rows - table), sorted(table - rows))
    seen = set()
    for top in ("rollout_corr_ext", "csrc", "rollout_corr_testing", "scripts", "tests", "benchmarks", "examples"):
        for path in _files(top, (".py", ".h", ".cpp", ".cu", ".cuh", ".sh")):
            seen |= set(NAME.findall(open(path, errors="replace").read()))
    assert seen <= table, f"switches read but not in rollout_corr_ext/_env.py: {sorted(seen - table)}"


def test_only_the_switch_modules_read_the_environment():
    for path in _files("rollout_corr_ext", (".py",)):
        if os.path.basename(path) == "_env.py":
            continue
        text = open(path).read()
        assert not re.search(r"os\.environ\b|os\.getenv\(", text), f"{path} reads the environment itself"
    for path in _files("csrc", (".h", ".cpp", ".cu", ".cuh")):
        if os.path.basename(path) == "switches.h":
            continue
        assert "getenv(" not in open(path).read(), f"{path} calls getenv itself"


def test_the_former_name_of_a_renamed_switch_still_works_and_warns(monkeypatch):
    import pytest

    monkeypatch.delenv("ROLLOUT_CORR_FORCE_FALLBACK", raising=False)
    monkeypatch.setenv("ROLLOUT_CORR_FORCE_REFERENCE", "1")
    with pytest.warns(DeprecationWarning, match="ROLLOUT_CORR_FORCE_FALLBACK"):
        assert _env.flag("ROLLOUT_CORR_FORCE_FALLBACK")
    monkeypatch.setenv("ROLLOUT_CORR_FORCE_FALLBACK", "0")  # the new name wins
    assert not _env.flag("ROLLOUT_CORR_FORCE_FALLBACK")
