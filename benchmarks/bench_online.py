"""One decode step of SmolLM2-135M (30 layers) after a 4k-token prompt, 128 tokens per KV head:
zsmerge (running scores + online eviction) by each decode-step implementation against snapkv
(append + the paged decode kernel), interleaved rounds in one process. Prints a table: the
median whole step (model forward of one token), the median time inside the attend op (the
AttentionInterface call: op dispatch + engine.decode.decode, summed over the 30 layers) and inside
engine.decode.decode alone, each also as a ratio to snapkv's.

    PYTHONPATH=. python3 benchmarks/bench_online.py --threads 1
    PYTHONPATH=. python3 benchmarks/bench_online.py --threads 2 --specs snapkv zsmerge h2o

Rows: "SPEC" runs the plan's choice (zsmerge, h2o on a CPU in fp32: the fused C++ step of
kvcompile.kernels.online_step); "SPEC/torch" the torch step (kvcompile.engine.online.TorchStep:
_attend_with_probs, _update_scores, evict_online, merge_victims). Every cache of a spec continues one
prefilled cache (deep copies).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from transformers import AttentionInterface

import kvcompile
import kvcompile.engine.op as op
from kvcompile.cache import KVCompileCache
from kvcompile.engine.online import TorchStep
from kvcompile.tools.models import load_model
from kvcompile.plan import build_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens (random ids)")
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the first is a warm-up)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per cache and round")
    parser.add_argument("--specs", nargs="+", default=["snapkv", "zsmerge"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, _ = load_model()
    model.eval()
    ids = torch.randint(100, 40000, (1, args.length))
    kvcompile.compile(model, "snapkv", per_head=args.per_head)  # the eager entry; each cache brings its plan
    headroom = args.rounds * args.steps + 1

    caches: dict[str, KVCompileCache] = {}
    with torch.no_grad():
        for spec in args.specs:
            policy = kvcompile.load_spec(spec, per_head=args.per_head)
            plan = build_plan(policy, model.config, device=model.device, dtype=model.dtype).with_headroom(headroom)
            cache = KVCompileCache.from_plan(plan)
            start = time.perf_counter()
            model(ids, past_key_values=cache, use_cache=True)
            print(f"prefill {spec}: {time.perf_counter() - start:.1f} s, online_impl {plan.online_impl}", flush=True)
            caches[spec] = cache
            if plan.online_impl != "torch":
                caches[f"{spec}/torch"] = cache.copy_with(dataclasses.replace(cache.plan, decode_step=TorchStep()))

    inside = {"attend": 0.0, "decode": 0.0}
    attention = op.kvcompile_attention
    decode = op.decode

    def timed_attention(*a, **k):
        t = time.perf_counter()
        try:
            return attention(*a, **k)
        finally:
            inside["attend"] += time.perf_counter() - t

    def timed_decode(*a, **k):
        t = time.perf_counter()
        try:
            return decode(*a, **k)
        finally:
            inside["decode"] += time.perf_counter() - t

    AttentionInterface.register("kvcompile", timed_attention)
    op.decode = timed_decode
    token = torch.tensor([[1000]])
    steps = {name: [] for name in caches}
    attend = {name: [] for name in caches}
    decoding = {name: [] for name in caches}
    with torch.no_grad():
        for rnd in range(args.rounds):
            for name, cache in caches.items():
                for _ in range(args.steps):
                    inside["attend"] = inside["decode"] = 0.0
                    start = time.perf_counter()
                    model(token, past_key_values=cache, use_cache=True)
                    if rnd:  # round 0: warm-up (the C++ kernels build or load here)
                        steps[name].append(time.perf_counter() - start)
                        attend[name].append(inside["attend"])
                        decoding[name].append(inside["decode"])
    op.decode = decode
    AttentionInterface.register("kvcompile", attention)

    med = lambda xs: statistics.median(xs)  # noqa: E731
    base = "snapkv" if "snapkv" in caches else next(iter(caches))
    print(f"\nSmolLM2-135M fp32, {args.length}-token prompt, {args.per_head} per KV head, {args.threads} thread(s); "
          f"medians of {(args.rounds - 1) * args.steps} steps ({args.rounds - 1} interleaved rounds of {args.steps})")
    print(f"{'cache':18s} {'step ms':>8s} {'x ' + base:>9s} {'attend ms':>10s} {'x ' + base:>9s} "
          f"{'decode ms':>10s} {'per layer us':>13s}")
    for name in caches:
        s, a, d = med(steps[name]), med(attend[name]), med(decoding[name])
        print(f"{name:18s} {s * 1e3:8.2f} {s / med(steps[base]):9.3f} {a * 1e3:10.2f} {a / med(attend[base]):9.2f} "
              f"{d * 1e3:10.2f} {d / model.config.num_hidden_layers * 1e6:13.1f}")


if __name__ == "__main__":
    main()
