#!/usr/bin/env bash
# Installs everything (scripts/bootstrap.sh) and runs the whole test suite on the CPU: kernels vs the fp64
# oracle, distributed gloo tests at TP/DP/CP > 1, the CUDA emulator and its planted-bug self-test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/bootstrap.sh
# verl 0.9.1, the parity oracle of the rollout-correction tests: its wheel without its GPU stack (vllm, sglang,
# flash-attn), plus the light packages its helper modules import at import time.
# pip's resolver then lists verl's GPU requirements as unmet: expected and harmless, so pip_quiet (bootstrap.sh)
# leaves that block out of the log.
pip_quiet --no-deps "verl==0.9.1"
pip_quiet packaging ray "tensordict<=0.10.0" omegaconf transformers codetiming orjson
echo "verl 0.9.1 installed without its GPU stack (its unmet vllm / sglang / flash-attn requirements are expected)"
# --quick: the tier a developer runs while working (about 12 minutes of tests on 2 cores after the set-up, README.md):
# no emulated CUDA kernels, no multi-process (gloo) tests, no benchmark / demo smoke runs, nothing marked slow. CI runs
# the whole suite (without --quick), which includes all of these tests.
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- -m "not slow" -k "not emulated and not gloo and not nccl" \
    --ignore=tests/test_cuda_emulator.py --ignore=tests/test_cuda_emulator_races.py \
    --ignore=tests/test_cuda_emulator_traffic.py --ignore=tests/test_cuda_emulator_rollout_correction.py \
    --ignore=tests/test_demo_smoke.py --ignore=tests/test_benchmarks_smoke.py "$@"
fi
# pytest-xdist workers (scripts/pytest_workers.sh); `-n 0` after the script runs everything in this process. The
# gloo tests' TCP stores take OS-chosen ports, so workers never collide.
python -m pytest -q -rfEs --durations=15 -n "$(bash scripts/pytest_workers.sh)" tests "$@"
