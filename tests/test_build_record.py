"""The build's record of its sources: setup.py writes the hash of what it compiled beside the module it builds, and
the package refuses a module built from other sources than csrc/ holds (a checkout updated without a rebuild: op
schemas or slot layouts that differ from the ones the Python side reads from csrc/)."""

import importlib
import os

import pytest

import rollout_corr_ext
from rollout_corr_ext import _build
from rollout_corr_testing.skips import skip_unless_ci


def _tree(tmp_path, files):
    csrc = tmp_path / "csrc"
    for name, text in files.items():
        (csrc / name).parent.mkdir(parents=True, exist_ok=True)
        (csrc / name).write_text(text)
    module = tmp_path / "_C.fake.so"
    module.write_bytes(b"")
    return csrc, module


def test_a_module_built_from_other_sources_is_refused_by_name(tmp_path):
    csrc, module = _tree(tmp_path, {"ops.cpp": "int a;", "include/layout.def": "RC_SUM(tokens, ROW)"})
    record = tmp_path / ("_C.fake.so" + _build.SOURCES_SUFFIX)
    rollout_corr_ext.check_built_sources(str(module), csrc)  # no record (built another way): nothing to compare
    record.write_text(_build.source_hash(csrc) + "\n")
    rollout_corr_ext.check_built_sources(str(module), csrc)  # the sources it was built from
    (csrc / "include" / "layout.def").write_text("RC_SUM(nonfinite, ROW)\nRC_SUM(tokens, ROW)")  # a slot moved
    with pytest.raises(RuntimeError, match=r"built from other sources.*rebuild or reinstall"):
        rollout_corr_ext.check_built_sources(str(module), csrc)


def test_the_hash_covers_what_a_build_compiles_and_nothing_else(tmp_path):
    csrc, _ = _tree(tmp_path, {"ops.cpp": "int a;", "cuda/k.cuh": "x", "include/l.def": "y", "README.md": "z"})
    first = _build.source_hash(csrc)
    (csrc / "README.md").write_text("other notes")
    assert _build.source_hash(csrc) == first
    for name in ("ops.cpp", "cuda/k.cuh", "include/l.def"):
        (csrc / name).write_text((csrc / name).read_text() + " ")
        assert _build.source_hash(csrc) != first, name
        first = _build.source_hash(csrc)
    (csrc / "ops.cpp").rename(csrc / "ops2.cpp")  # a renamed file is another build
    assert _build.source_hash(csrc) != first
    assert _build.source_hash(tmp_path / "nowhere") is None


def test_the_loaded_module_carries_the_record_of_this_checkouts_sources():
    """setup.py (bootstrap's editable install, an in-place build) wrote the record, and it matches csrc/."""
    if rollout_corr_ext.backend() == "fallback":
        skip_unless_ci("the compiled extension is not loaded")
    module = importlib.import_module("rollout_corr_ext._C").__file__
    record = module + _build.SOURCES_SUFFIX
    if not os.path.isfile(record):
        skip_unless_ci(f"{module} has no record of its sources (built before setup.py wrote one): rebuild it")
    assert open(record).read().strip() == _build.source_hash()


def test_skip_build_installs_the_package_without_compiling(tmp_path, monkeypatch):
    """ROLLOUT_CORR_SKIP_BUILD=1 (scripts/bootstrap.sh's editable install): setup.py compiles nothing, so the
    in-place build that follows is the only compile (ignored, the install would compile everything a second time)."""
    import subprocess
    import sys

    monkeypatch.setenv("ROLLOUT_CORR_SKIP_BUILD", "1")
    assert _build.skip_build()
    monkeypatch.setenv("ROLLOUT_CORR_SKIP_BUILD", "0")
    assert not _build.skip_build()
    root = _build.ROOT  # the checkout (an installed wheel: the package, no setup.py)
    if not (root / "setup.py").is_file():
        pytest.skip(reason="no setup.py beside the package (an installed wheel): nothing to build from")
    env = dict(os.environ, ROLLOUT_CORR_SKIP_BUILD="1")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "temp")], cwd=str(root), env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    assert "ROLLOUT_CORR_SKIP_BUILD=1, the extension is not compiled" in proc.stdout
    built = [p for p in tmp_path.rglob("*") if p.suffix in (".so", ".o")]
    assert not built, built
