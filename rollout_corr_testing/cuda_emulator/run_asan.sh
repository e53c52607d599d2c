#!/usr/bin/env bash
# Runs the emulated kernels under AddressSanitizer: the emulator extension is built with -fsanitize=address and
# the Python process runs with libasan preloaded, so any out-of-bounds global or shared-memory access by a
# kernel aborts the test with ASan's report. Usage (after scripts/bootstrap.sh): bash rollout_corr_testing/cuda_emulator/run_asan.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck disable=SC1091
. .venv/bin/activate
libasan=$(gcc -print-file-name=libasan.so)
if [ ! -e "$libasan" ]; then echo "libasan not found: skipping the ASan run"; exit 0; fi
# libstdc++ is preloaded with the runtime: ASan intercepts __cxa_throw, and in a non-instrumented interpreter the
# interceptor only finds the real one when libstdc++ is loaded before any extension. Without it, the first C++
# exception a kernel's argument check throws (a TORCH_CHECK the tests expect) aborts the process.
preload="$libasan $(gcc -print-file-name=libstdc++.so)"
export ROLLOUT_CORR_EMU_ASAN=1
export ROLLOUT_CORR_EMU_BUILD_DIR=${ROLLOUT_CORR_EMU_BUILD_DIR:-$PWD/build/emu}/asan
# Python and torch allocate and never free on purpose; leak checking would only report those.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=0
# Left out: the planted-bug and divergence tests (they build their own mutated kernels) and the barrier-removal test
# (it needs racecheck, which the ASan build leaves out); the regular test run covers all three.
# pytest-xdist workers (scripts/pytest_workers.sh; ASan reaches them through LD_PRELOAD); the emulated kernels run
# single-threaded.
workers=$(bash scripts/pytest_workers.sh)
LD_PRELOAD="$preload" python -m pytest -q -p no:cacheprovider -n "$workers" tests/test_cuda_emulator*.py \
  -k "not planted and not divergence and not every_syncthreads"
# The fused policy-loss kernels (strided, dtype-tagged input views: the accesses most worth bounds-checking).
LD_PRELOAD="$preload" python -m pytest -q -p no:cacheprovider -n "$workers" tests/test_policy_loss_kernel.py \
  -k "emulated"
