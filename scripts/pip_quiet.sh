#!/usr/bin/env bash
# Sourced by scripts/bootstrap.sh, scripts/test_megatron_newest.sh and scripts/check_package.sh (and, through
# bootstrap.sh, scripts/test.sh).
# pip install, quietly: a failing install prints its whole log and stops the script; a passing one prints what pip
# says but this machine's notes on index folders it cannot find, and pip's resolver notes on verl's unmet GPU
# requirements (scripts/test.sh installs verl without them on purpose), so a clean run starts clean. PIP_PYTHON: the
# interpreter whose pip runs (default: python, the active venv's).
pip_quiet() {
  local log
  log=$(mktemp)
  if ! "${PIP_PYTHON:-python}" -m pip install -q "$@" > "$log" 2>&1; then cat "$log"; rm -f "$log"; return 1; fi
  grep -v -E "^(WARNING: Location|ERROR: pip's dependency resolver|verl [0-9.]+ requires )" "$log" || true
  rm -f "$log"
}
