#!/usr/bin/env bash
# Fresh-machine set-up, sourced by scripts/demo.sh and scripts/test.sh: a venv in .venv, torch 2.14.1, and
# this package built in place (CPU kernels; CUDA kernels too when a GPU is visible or FORCE_CUDA=1).
# A second run with no source change skips the install and the build (a stamp of the sources, the build
# settings and the venv's torch); any change rebuilds, incrementally through ninja.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

# shellcheck disable=SC1091
. scripts/pip_quiet.sh
export MAX_JOBS=${MAX_JOBS:-2}

build_stamp() {
  {
    python rollout_corr_ext/_build.py  # the sources' hash, as the build record takes it (stdlib only)
    sha256sum setup.py pyproject.toml rollout_corr_ext/_build.py
    echo "FORCE_CUDA=${FORCE_CUDA:-} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}"
    python -c "import torch; print(torch.__version__)" 2>/dev/null || echo "no torch"
  } | sha256sum | cut -d' ' -f1
}
stamp_file=.venv/.rollout_corr_build_stamp
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$(build_stamp)" ] \
   && python -c "import rollout_corr_ext._C" 2>/dev/null; then
  echo "rollout_corr_ext: sources unchanged since the last build, skipping install and build"
else
  pip_quiet --upgrade pip "setuptools>=77" wheel
  pip_quiet "torch==2.14.1" ninja numpy
  # The package (editable) and its dependencies first, then the compile in place: its objects stay in build/temp.*,
  # where a later wheel build (scripts/check_package.sh) or a source change reuses them through ninja (an editable
  # install's own build would compile in a temporary folder and drop them).
  ROLLOUT_CORR_SKIP_BUILD=1 pip_quiet --no-build-isolation -e ".[test,demo]"
  mkdir -p build
  python setup.py build_ext --inplace > build/bootstrap-build.log 2>&1 \
    || { tail -n 60 build/bootstrap-build.log; echo "rollout_corr_ext: the build failed"; exit 1; }
  build_stamp > "$stamp_file"
fi
python -c "import rollout_corr_ext as r; print('rollout_corr_ext backend:', r.backend())"
