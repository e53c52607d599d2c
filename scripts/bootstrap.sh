#!/usr/bin/env bash
# Fresh-machine set-up, sourced by scripts/demo.sh and scripts/test.sh: a venv in .venv, torch 2.14.1, and
# this package built in place (CPU kernels; CUDA kernels too when a GPU is visible or FORCE_CUDA=1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q "torch==2.14.1" ninja numpy
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-2}
python -m pip install -q --no-build-isolation -e ".[test,demo]"
python -c "import rollout_corr_ext as r; print('rollout_corr_ext backend:', r.backend())"
