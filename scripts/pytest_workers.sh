#!/usr/bin/env bash
# The pytest-xdist worker count every test run of the scripts uses (scripts/test.sh, the ASan run, the newest-stack
# job): one per core, at most 4 (each worker holds torch, megatron-core and the emulator in memory).
n=$(nproc)
[ "$n" -gt 4 ] && n=4
echo "$n"
