#!/usr/bin/env bash
# Installs everything (scripts/bootstrap.sh) and runs the whole test suite on the CPU: kernels vs the fp64
# oracle, distributed gloo tests at TP/DP/CP > 1, the CUDA emulator and its planted-bug self-test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/bootstrap.sh
# verl 0.9.1, the parity oracle of the rollout-correction tests: its wheel without its GPU stack (vllm, sglang,
# flash-attn), plus the light packages its helper modules import at import time.
python -m pip install -q --no-deps "verl==0.9.1"
python -m pip install -q packaging ray "tensordict<=0.10.0" omegaconf transformers codetiming orjson
python -m pytest -q -rfEs tests "$@"
