#!/usr/bin/env bash
# Packaging check (CI step): build the sdist and the wheel (`python -m build --no-isolation`; the wheel from the tree,
# where the build finds scripts/bootstrap.sh's objects up to date and only links; the sdist is checked to carry the
# same sources and build files, and a few tests run from it), install the wheel into a fresh venv that has only
# torch, import it (the compiled backend), and check that the csrc/ copy the wheel carries for load_extension() is
# the tree's, every source of its list present. load_extension()'s JIT compile itself runs in CI step 5
# (scripts/test_megatron_newest.sh builds that way): not a second time here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
# shellcheck disable=SC1091
. scripts/pip_quiet.sh
export MAX_JOBS=${MAX_JOBS:-2}
pip_quiet build
out=build/package-check
rm -rf "$out"
mkdir -p "$out"
python -m build --no-isolation --sdist --outdir "$out/dist" . > "$out/build.log" 2>&1 \
  || { tail -n 40 "$out/build.log"; exit 1; }
python -m build --no-isolation --wheel --outdir "$out/dist" . >> "$out/build.log" 2>&1 \
  || { tail -n 40 "$out/build.log"; exit 1; }
# The wheel's build found scripts/bootstrap.sh's objects up to date and only linked. In CI a compile here is an
# error (it would double this step's time, silently); elsewhere the tree may have changed since the last build.
if ! grep -q "ninja: no work to do" "$out/build.log"; then
  msg="the wheel build compiled sources (bootstrap's objects in build/temp.* were stale or missing)"
  if [ "${CI:-}" = "true" ]; then echo "$msg"; exit 1; else echo "note: $msg"; fi
fi
sdist=$(ls "$out"/dist/*.tar.gz)
wheel=$(ls "$out"/dist/*.whl)
echo "built $sdist and $wheel"
tar -tzf "$sdist" > "$out/sdist.txt"
for f in csrc/ops.cpp csrc/logprob_host.h csrc/cuda/logprob_kernels.cuh LICENSE CHANGELOG.md rollout_corr_ext/py.typed \
         tests/conftest.py rollout_corr_testing/dense_oracles.py rollout_corr_testing/cuda_emulator/cuda_emu.h \
         docs/configuration.md examples/demo_trainer.py scripts/test.sh; do
  grep -q "/$f\$" "$out/sdist.txt" || { echo "sdist lacks $f"; exit 1; }
done
# The tests run from the sdist: a few of them, on the pure-PyTorch backend (no build needed), from the unpacked tree.
mkdir -p "$out/sdist-src"
tar -xzf "$sdist" -C "$out/sdist-src"
# A wheel built from the sdist would compile what the wheel above did: the same build files, the same csrc/ (by the
# build record's hash).
for f in setup.py pyproject.toml MANIFEST.in rollout_corr_ext/_build.py rollout_corr_ext/_env.py; do
  cmp -s "$f" "$out"/sdist-src/rollout_corr_ext-*/"$f" || { echo "the sdist's $f differs from the tree's"; exit 1; }
done
sdist_hash=$(cd "$out"/sdist-src/rollout_corr_ext-* && python rollout_corr_ext/_build.py)
[ "$(python rollout_corr_ext/_build.py)" = "$sdist_hash" ] || { echo "the sdist's csrc/ is not the tree's"; exit 1; }
(cd "$out"/sdist-src/rollout_corr_ext-* && ROLLOUT_CORR_FORCE_FALLBACK=1 python -m pytest -q -p no:cacheprovider \
   tests/test_switches.py tests/test_config.py | tail -n 1)
python - "$wheel" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
for need in ("rollout_corr_ext/csrc/ops.cpp", "rollout_corr_ext/csrc/include/logprob_math.h",
             "rollout_corr_ext/csrc/include/rollout_correction_layout.def", "rollout_corr_ext/py.typed"):
    assert need in names, f"wheel lacks {need}"
assert any(n.startswith("rollout_corr_ext/_C") and n.endswith(".so") for n in names), "wheel lacks the compiled module"
# setup.py's record of the sources the module was built from (the package compares it with its csrc/ copy at import)
assert any(n.startswith("rollout_corr_ext/_C") and n.endswith(".so.sources") for n in names), "wheel lacks the record"
PY
"${PYTHON:-python3}" -m venv "$out/venv"
PIP_PYTHON="$out/venv/bin/python" pip_quiet "torch==2.14.1" numpy ninja
PIP_PYTHON="$out/venv/bin/python" pip_quiet --no-deps "$wheel"
tree_hash=$(python rollout_corr_ext/_build.py)  # the hash of the tree's csrc/
cd "$out"  # away from the source tree, so that the installed package is the one imported
venv/bin/python - <<'PY'
import torch, rollout_corr_ext as rc
assert rc.backend() in ("cpu", "cuda"), rc.backend()
x, t = torch.randn(3, 11), torch.randint(0, 11, (3,))
torch.testing.assert_close(rc.vocab_parallel_log_probs(x, t), torch.log_softmax(x, -1).gather(-1, t[:, None])[:, 0])
print("wheel install: import ok, backend", rc.backend(), "version", rc.__version__)
PY
TREE_HASH="$tree_hash" venv/bin/python - <<'PY'
# What load_extension() would compile from the wheel install: its csrc/ copy, by the same source list as setup.py.
import os
from pathlib import Path
import rollout_corr_ext as rc
from rollout_corr_ext import _build
pkg = Path(rc.__file__).resolve().parent
assert _build.ROOT == pkg, f"load_extension() would compile from {_build.ROOT}, not the installed package {pkg}"
assert _build.source_hash() == os.environ["TREE_HASH"], "the wheel's csrc/ copy differs from the tree's csrc/"
for cuda in (False, True):
    for f in _build.abs_paths(_build.extension_kwargs(cuda)["sources"] + _build.INCLUDE_DIRS):
        assert Path(f).exists() and pkg in Path(f).parents, f"load_extension() source {f} is not in the install"
print("load_extension() sources in the wheel install: the tree's csrc/, every listed file present")
PY
echo "package check passed"
