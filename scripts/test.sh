#!/usr/bin/env bash
# Installs everything (scripts/bootstrap.sh) and runs the whole test suite on the CPU: kernels vs the fp64
# oracle, distributed gloo tests at TP/DP/CP > 1, the CUDA emulator and its planted-bug self-test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/bootstrap.sh
python -m pytest -q -rfEs tests "$@"
