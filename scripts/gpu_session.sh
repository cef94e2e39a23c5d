#!/usr/bin/env bash
# One command per stage of a GPU session (issue 15), run through the device tool from the repo root:
#
#   bash scripts/gpu_session.sh tests     # pytest -m gpu, the kernel tests, then the rest (real Triton) ~9 min
#   bash scripts/gpu_session.sh kernels   # e2e --small as a preflight, then bench_gpu.py kernels   ~4-7 min
#   bash scripts/gpu_session.sh e2e       # benchmarks/bench_gpu.py e2e (8B-shaped random model)    ~8-9 min
#   bash scripts/gpu_session.sh brief     # one call for a 15-minute lease: the gpu tests, the kernel  ~9 min
#                                         # tests, bench kernels and e2e at one size, each cut short
#
# Arguments after the stage go to the benchmark (e.g. `e2e --lengths 8192 --batches 8`) or to both
# pytest runs (e.g. `tests -k paged`). Each stage prints the GPU and the package versions first,
# installs the wheels carried in .whl/ (scripts/gpu_wheels.sh makes them; name ".whl" in the run's
# carry), puts the repo on PYTHONPATH, and tees everything to "$OUT/<stage>.log" (the device tool
# sets OUT and brings the folder back; elsewhere /tmp/gpu-session). Every step has a time limit, so
# the stage ends inside the tool's 10-minute command limit with its log. docs/INTERNALS.md
# "Running on a GPU" lists the calls in order.
set -uo pipefail

stage=${1:-}
case "$stage" in
  tests|kernels|e2e|bandwidth|brief) shift ;;
  *) echo "usage: bash scripts/gpu_session.sh tests|kernels|e2e|bandwidth|brief [extra arguments]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$stage.log") 2>&1
tee_pid=$!
export PYTHONUNBUFFERED=1
started=$SECONDS

echo "== stage $stage, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(uname -m), repo $(pwd)"
nvidia-smi || echo "nvidia-smi: not available"
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "== installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "== no .whl/ here: the image's packages only (scripts/gpu_wheels.sh makes the wheels; carry .whl)"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # real Triton (tests/conftest.py sets it only where CUDA is absent)

python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers", "accelerate", "tokenizers", "huggingface_hub", "safetensors",
             "hypothesis", "pytest", "yaml", "numpy", "flash_attn", "fastapi", "openai", "kvcompile"):
    try:
        module = importlib.import_module(name)
        print(f"{name:16} {getattr(module, '__version__', '?'):14} {getattr(module, '__file__', '')}")
    except Exception as exc:  # a missing optional package is information, not an error
        print(f"{name:16} {'-':14} ({type(exc).__name__}: {str(exc)[:80]})")
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

status=0
case "$stage" in
  tests)
    # three runs, each with its own limit, the GPU's own first: the gpu-marked tests; the kernel tests, whose
    # Triton cases now run on the GPU for real; then the rest of the suite for what the stage has left
    kernel_tests=(tests/test_kernels_*.py)
    echo "== 1/3 pytest -m gpu (limit 180 s)"
    timeout -k 10 180 python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs -o faulthandler_timeout=150 \
      tests/test_gpu.py "$@" || status=$?
    echo "== 2/3 the kernel tests with real Triton (limit 150 s): ${kernel_tests[*]}"
    timeout -k 10 150 python3 -m pytest -m "not gpu" -v -p no:cacheprovider -rfEs -o faulthandler_timeout=120 \
      "${kernel_tests[@]}" "$@" || status=$?
    limit=$(( ${STAGE_SECONDS:-560} - (SECONDS - started) ))
    if [ "$limit" -lt 30 ]; then  # `timeout 0` would mean no limit at all
      echo "== 3/3 skipped: $limit s left of the stage's ${STAGE_SECONDS:-560} s"
      limit=0
    fi
    [ "$limit" -gt 0 ] && echo "== 3/3 the rest of the suite (limit $limit s, what the stage's ${STAGE_SECONDS:-560} s leave; no -x;" \
         "PYTEST_ARGS='${PYTEST_ARGS:-}')"
    ignore=()
    for f in "${kernel_tests[@]}"; do ignore+=("--ignore=$f"); done
    # -v: each test's result is in the log as it finishes, so a suite cut by the limit still shows what ran
    # shellcheck disable=SC2086
    if [ "$limit" -gt 0 ]; then
      timeout -k 10 "$limit" python3 -m pytest -m "not gpu" -v -p no:cacheprovider -rfEs --durations=20 \
        -o faulthandler_timeout=240 "${ignore[@]}" ${PYTEST_ARGS:-} tests "$@" || status=$?
    fi
    ;;
  kernels)
    # first the e2e stage's code at tiny shapes on this GPU (a minute): a failure there shows before the
    # e2e command spends its ten minutes
    echo "== preflight: bench_gpu.py e2e --small on this device (limit 240 s)"
    timeout -k 10 240 python3 benchmarks/bench_gpu.py e2e --small || status=$?
    limit=$(( ${STAGE_SECONDS:-560} - (SECONDS - started) ))
    echo "== bench_gpu.py kernels (limit $limit s)"
    timeout -k 10 "$limit" python3 benchmarks/bench_gpu.py kernels "$@" || status=$?
    ;;
  e2e)
    timeout -k 10 560 python3 benchmarks/bench_gpu.py e2e "$@" || status=$?
    ;;
  bandwidth)
    timeout -k 10 120 python3 benchmarks/bench_gpu.py bandwidth "$@" || status=$?
    ;;
  brief)
    # everything above, each cut to fit one 10-minute command (a lease of 15 minutes holds one such call and
    # its start); arguments go to pytest
    echo "== 1/4 pytest -m gpu (limit 150 s)"
    timeout -k 10 150 python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs -o faulthandler_timeout=120 \
      tests/test_gpu.py "$@" || status=$?
    # only their Triton cases (71 s on an H200): the C++ and compiled cases are the CPU's, which CI runs, and
    # all of them overran 110 s there (2026-11-28)
    echo "== 2/4 the kernel tests' Triton cases with real Triton (limit 110 s)"
    timeout -k 10 110 python3 -m pytest -m "not gpu" -v -p no:cacheprovider -rfEs -o faulthandler_timeout=100 \
      tests/test_kernels_*.py -k triton "$@" || status=$?
    echo "== 3/4 bench_gpu.py kernels at 8k and 32k tokens per head (limit 100 s)"
    timeout -k 10 100 python3 benchmarks/bench_gpu.py kernels --max-seconds 60 --tokens 8192 32768 || status=$?
    limit=$(( ${STAGE_SECONDS:-560} - (SECONDS - started) ))
    echo "== 4/4 bench_gpu.py e2e at 32k tokens, batch 8, 128 per head (limit $limit s)"
    if [ "$limit" -gt 30 ]; then
      timeout -k 10 "$limit" python3 benchmarks/bench_gpu.py e2e --max-seconds $((limit - 90)) \
        --lengths 32768 --batches 8 --budgets 128 --specs snapkv lava --modes eager compiled || status=$?
    fi
    ;;
esac
echo "== stage $stage done in $((SECONDS - started)) s, exit status $status (124: a time limit); log $OUT/$stage.log"
exec 1>&- 2>&-
wait "$tee_pid" 2>/dev/null  # the log is complete before the command returns
exit "$status"
