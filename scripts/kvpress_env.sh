#!/usr/bin/env bash
# NVIDIA's kvpress side by side with kvcompile, on the same model, prompts and budgets.
#   bash scripts/kvpress_env.sh [--lengths 1000,2000] [--depths ...] [--budgets 64,128] ...
# kvpress pins transformers < 5.3, so it gets its own virtual environment (.venv-kvpress);
# kvcompile's environment (python3) makes the prompts and runs our specs.  Needs
# `bash scripts/setup.sh demo` first (the converted SmolLM2 and the haystack text).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
venv="${KVPRESS_VENV:-.venv-kvpress}"
out="${KVPRESS_OUT:-benchmarks/out}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import kvpress" 2>/dev/null; then
  "$py" -m venv "$venv"
  # The same CPU build of torch as kvcompile's, then kvpress with the transformers it pins
  # (kvpress 0.5.5: transformers >=4.56,<5.3).
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q "kvpress==0.5.5"
fi
mkdir -p "$out"
"$py" scripts/kvpress_compare.py prompts --out "$out/kvpress_prompts.json" "$@"
"$venv/bin/python" scripts/kvpress_compare.py kvpress --prompts "$out/kvpress_prompts.json" \
  --out "$out/kvpress_results.json"
"$py" scripts/kvpress_compare.py kvcompile --prompts "$out/kvpress_prompts.json" \
  --kvpress "$out/kvpress_results.json" --out "$out/kvpress_compare.json"
