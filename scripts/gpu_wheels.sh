#!/usr/bin/env bash
# Download, on this machine, the wheels the GPU image lacks for kvcompile's suite and benchmarks into
# .whl/ (ignored by git), for the GPU machine's Python 3.12 on manylinux x86_64. A GPU session names
# ".whl" in the device tool's carry, and scripts/gpu_session.sh installs them into /tmp/site there.
#
#   bash scripts/gpu_wheels.sh
#
# What the image has (the device tool's KINDS.md, read 2026-11): torch 2.11.0+cu130, triton 3.6.0,
# accelerate 1.15.0, tokenizers 0.23.2, huggingface_hub 1.33.0, safetensors 0.8.0, numpy, pyyaml, tqdm,
# pytest, requests, httpx, anyio, click, h11; transformers 5.17.0, below pyproject's floor; no pydantic,
# fastapi, uvicorn or openai. So this fetches, at the versions installed here (`pip show`, the versions
# the suite passes with):
# - transformers (pyproject: transformers>=5.21.0,<5.24) and regex (transformers checks its floor at import);
# - hypothesis (the property tests; the image's version is unknown) and typing-extensions, anyio;
# - `kvcompile serve`'s stack for tests/test_serve_http.py: fastapi, starlette, pydantic, pydantic-core,
#   annotated-types, typing-inspection, annotated-doc, opentelemetry-api, uvicorn, h11, openai, jiter, sniffio,
#   httpx2, httpcore2, truststore, idna (those whose floors are above what an older image may hold).
# Never torch or triton (the image's CUDA builds), nor packages the image has at a version pyproject allows.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(transformers regex hypothesis typing-extensions anyio
          fastapi starlette pydantic pydantic-core annotated-types typing-inspection annotated-doc opentelemetry-api
          uvicorn h11 openai jiter sniffio httpx2 httpcore2 truststore idna)

if ! git check-ignore -q .whl/x.whl 2>/dev/null; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  echo "/.whl/" >>"$exclude"
  echo "added /.whl/ to $exclude"
fi
rm -rf .whl
mkdir -p .whl
specs=()
for name in "${PACKAGES[@]}"; do
  version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  if [ -z "$version" ]; then
    echo "gpu_wheels: $name is not installed here; install the test set-up first (bash scripts/setup.sh test)" >&2
    exit 1
  fi
  specs+=("$name==$version")
done
echo "downloading: ${specs[*]}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${specs[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
ls -l .whl | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total: $(ls .whl/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB ($total bytes)"
if [ "$total" -gt $((40 * 1024 * 1024)) ]; then
  echo "gpu_wheels: over 40 MiB; the device tool carries at most 64 MiB with the working tree" >&2
  exit 1
fi
