"""Peak memory of a long prefill on the embedded SmolLM2-135M: full cache against compressed.

Each run is a fresh process (torch's CPU allocator keeps no statistics): load the model,
prefill an N-token prompt (default 8000) and generate one token, then read the peak
resident set (VmHWM). glibc serves every allocation above 64 KiB by mmap, so freed
tensors leave the resident set at once and the peak follows the live tensors. Columns:
peak MB; KV MB held after the prefill; evicted MB (full cache's KV minus held); saved MB
(full run's peak minus this run's); saved ÷ evicted (issue 6's target: at least 0.5).

    python3 benchmarks/bench_memory.py [--length 8000] [--per-head 256] [--specs lava snapkv adakv]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import torch
torch.set_num_threads(int(sys.argv[4]))
import kvcompile
from kvcompile.tools.models import load_model
mode, length, per_head = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, _ = load_model()
ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    if mode != "full":
        kvcompile.compile(model, mode, per_head=per_head)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True)
    cache = out.past_key_values
    held = (cache.memory_report()["bytes_held"] if mode != "full" else
            sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers))
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak": peak * 1024, "held": held}))
"""


def measure(mode: str, length: int, per_head: int, threads: int) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, mode, str(length), str(per_head), str(threads)],
                         capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    if run.returncode:
        raise RuntimeError(f"{mode}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8000, help="prompt tokens (random ids)")
    parser.add_argument("--per-head", type=int, default=256)
    parser.add_argument("--specs", nargs="+", default=["lava", "snapkv", "adakv"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"SmolLM2-135M fp32, prompt {args.length} tokens + 1 generated, {args.per_head} per KV head, "
          f"fresh process per run, VmHWM")
    print(f"{'run':<12} {'peak MB':>8} {'KV MB':>7} {'evicted MB':>10} {'saved MB':>9} {'saved/evicted':>13}")
    full = measure("full", args.length, args.per_head, args.threads)
    for mode in ["full"] + args.specs:
        r = full if mode == "full" else measure(mode, args.length, args.per_head, args.threads)
        evicted, saved = full["held"] - r["held"], full["peak"] - r["peak"]
        ratio = f"{saved / evicted:.2f}" if evicted else "-"
        print(f"{mode:<12} {r['peak'] / 1e6:>8.0f} {r['held'] / 1e6:>7.1f} {evicted / 1e6:>10.1f} "
              f"{saved / 1e6:>9.0f} {ratio:>13}", flush=True)


if __name__ == "__main__":
    main()
