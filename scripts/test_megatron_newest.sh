#!/usr/bin/env bash
# The megatron-facing tests (pytest -m megatron: tests/conftest.py marks them) and the demo's smoke test on the
# newest stack: Python 3.12, torch 2.14.1 and the newest megatron-core release on PyPI (0.19.2 when written;
# it needs Python >= 3.12). scripts/test.sh runs the whole suite on Python 3.11 with megatron-core 0.16.1, the
# newest release for 3.11, so CI covers the oldest and the newest supported releases.
# Its own venv (.venv-py312). The package runs from the tree and its extension is JIT-compiled at import
# (ROLLOUT_CORR_JIT=1: rollout_corr_ext.load_extension(), the path a pure-Python install takes; CI's packaging check
# leaves that compile to this job) into build/jit-py312, where the spawned workers and the demo find it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY312=${PY312:-}
if [ -z "$PY312" ]; then
  # pyenv's shim answers only when 3.12 is the selected version: try the interpreters themselves first
  for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 python3.12; do
    if "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" >/dev/null 2>&1; then PY312=$c; break; fi
  done
fi
if [ -z "$PY312" ]; then
  echo "test_megatron_newest: no Python 3.12 found (set PY312=/path/to/python3.12)"; exit 1
fi
if [ ! -x .venv-py312/bin/python ]; then
  "$PY312" -m venv .venv-py312
fi
# shellcheck disable=SC1091
. .venv-py312/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-2}
# shellcheck disable=SC1091
. scripts/pip_quiet.sh
pip_quiet --upgrade pip "setuptools>=77" wheel
pip_quiet "torch==2.14.1" ninja numpy "megatron-core>=0.19.2" pytest pytest-xdist hypothesis expecttest matplotlib tqdm
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ROLLOUT_CORR_JIT=1 ROLLOUT_CORR_BUILD_DIR="$PWD/build/jit-py312"
python - <<'PY'
import sys, torch, megatron.core as m, rollout_corr_ext as r
assert r.backend() == "cpu", f"the JIT build did not load: backend {r.backend()}"
print(f"newest stack: Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {m.__version__}, "
      f"rollout_corr_ext backend {r.backend()}")
PY
# The emulated CUDA kernels do not depend on megatron-core's release (step 1 runs them): not again here.
python -m pytest -q -p no:cacheprovider -n "$(bash scripts/pytest_workers.sh)" -m megatron -k "not emulated" \
  --durations=5 tests "$@"
