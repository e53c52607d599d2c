#!/usr/bin/env bash
# Installs everything (scripts/bootstrap.sh) and runs the main job: the demo GRPO trainer on megatron-core,
# TP=2 on CPU with gloo, several rollout-correction settings side by side. Extra arguments go to the trainer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/bootstrap.sh
torchrun --nproc_per_node=2 examples/demo_trainer.py "$@"
