"""One layer's decode step on the CPU at a model's shapes: full precision against quantized and mixed stores,
fused (one C++ call: kvcompile.kernels.online_step, append_step, tiered_step) and unfused (the engine's path:
the append in torch ops, then the decode attention backend).

Each case is a one-layer KVCompileCache (SmolLM2-135M's shapes by default: 3 KV heads, 3 query heads each,
head dim 64) whose prompt of --prompt tokens is compressed to --per-head entries a head (snapkv; lava_mixed's
storage for "mixed"), then `--steps` decode steps through the op, as generate() calls it (eager entry). The
cases run interleaved, --rounds times, each from a fresh copy of its prefilled cache; prints the median
µs per step and the load average before and after (a shared machine moves the numbers).

    PYTHONPATH=. python3 benchmarks/bench_quant_step.py [--per-head 128] [--steps 48] [--rounds 15] [--threads 2]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time
from types import SimpleNamespace

import torch

import kvcompile
from kvcompile.engine.online import TorchStep
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile.cache import KVCompileCache
from kvcompile.plan import build_plan

CASES = {  # name: (storage, fused)
    "fp32, fused (CppOnlineStep)": ("model_dtype", True),
    "fp32, unfused": ("model_dtype", False),
    "int8, fused (CppQuantStep)": ("int8", True),
    "int8, unfused": ("int8", False),
    "int4, fused (CppQuantStep)": ("int4", True),
    "int4, unfused": ("int4", False),
    "mixed 1/3 int4, fused (CppTieredStep)": ({"mixed": {"full": 1 / 3, "bits": 4}}, True),
    "mixed 1/3 int4, unfused": ({"mixed": {"full": 1 / 3, "bits": 4}}, False),
    # KIVI's keys per channel, residual 32: of 128 entries a head 96 as codes; a group flushed every 32 steps
    "kivi int4 r32, fused (CppTieredStep)": ({"kivi": {"bits": 4, "residual": 32, "tokens": 32}}, True),
    "kivi int4 r32, unfused": ({"kivi": {"bits": 4, "residual": 32, "tokens": 32}}, False),
}


def prefilled(storage, fused: bool, args) -> KVCompileCache:
    h, g, d = args.heads, args.group, args.dim
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    policy = kvcompile.load_spec("snapkv", per_head=args.per_head, storage=storage)
    plan = build_plan(policy, config, device="cpu", dtype=torch.float32, headroom=args.steps)
    if not fused:
        plan = dataclasses.replace(plan, decode_step=TorchStep())
    for backend in plan.backends:
        backend.build(g, d)
    cache = KVCompileCache.from_plan(plan)
    gen = torch.Generator().manual_seed(0)
    n = args.prompt
    q, k, v = torch.randn(1, h * g, n, d, generator=gen), *(torch.randn(1, h, n, d, generator=gen) for _ in "kv")
    torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, d ** -0.5)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=600)
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--steps", type=int, default=48, help="decode steps per measurement (within the spares)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load before: {os.getloadavg()}", flush=True)
    caches = {name: prefilled(storage, fused, args) for name, (storage, fused) in CASES.items()}
    h, g, d = args.heads, args.group, args.dim
    gen = torch.Generator().manual_seed(1)
    steps = [(torch.randn(1, h * g, 1, d, generator=gen), torch.randn(1, h, 1, d, generator=gen),
              torch.randn(1, h, 1, d, generator=gen)) for _ in range(args.steps)]
    times = {name: [] for name in CASES}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, base in caches.items():
                cache = copy.deepcopy(base)
                start = time.perf_counter()
                for q, k, v in steps:
                    torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, d ** -0.5)
                times[name].append((time.perf_counter() - start) / args.steps * 1e6)
    print(f"load after: {os.getloadavg()}")
    print(f"\n{args.per_head} entries per KV head, H = {h}, G = {g}, d = {d}, {args.threads} threads; "
          f"median of {args.rounds} rounds of {args.steps} steps\n")
    print("| case | µs per layer step | ÷ fp32 fused |\n|---|---|---|")
    base = statistics.median(times["fp32, fused (CppOnlineStep)"])
    for name, t in times.items():
        m = statistics.median(t)
        print(f"| {name} | {m:.1f} | {m / base:.2f} |")


if __name__ == "__main__":
    main()
