"""Window scoring of one layer: the scorer part's `score(state)` against the fused scorer.

On SmolLM2-135M's per-layer shapes (batch 1, H=3 KV heads, G=3 query heads each, d=64,
fp32, the last 32 prompt queries), at each N, for SnapKV's scorer (window 32, avg pooling
kernel 7, GQA mean) and the LAVa variant of it (the same window and pooling, GQA max,
times max_k ‖V[k]‖₁), times
  (a) `score(state)` of the part (kvcompile/policies/scoring.py, what the runtime calls),
  (b) `window_scores(..., impl="torch")` (kvcompile/kernels/window_scores.py, eager),
  (c) `window_scores(..., impl="compiled")` (the same lowering through Inductor, timed
      after its compile: warm-up calls at each N first),
checks (b) and (c) equal to (a) (assert_close), and prints the median ms per call and
its ratio to (a) (below 1: faster than the part's score), and the same for the fastest
call. The implementations take turns call by call (interleaved, in a rotating order) so
that load from other processes falls on all of them alike; the spread column is the
interquartile range over the median.

    python3 benchmarks/bench_window_scores.py [--tokens 1024 4096 8192] [--repeat 31] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.testing import assert_close

from kvcompile.kernels.window_scores import window_scores
from kvcompile.policies.scoring import Lava, Pooling, WindowAttention
from kvcompile.reference import LayerState


def implementations(scorer, state: LayerState) -> dict:
    """(a), (b), (c) for one scorer and layer, as calls without arguments."""
    def fused(impl):
        return lambda: window_scores(state.queries, state.keys, state.values, state.mask, state.scale,
                                     window=scorer.window, gqa=scorer.gqa, pooling=scorer.pooling.kind,
                                     kernel=scorer.pooling.kernel, value_weight=isinstance(scorer, Lava),
                                     impl=impl)

    return {"(a) score(state)": lambda: scorer.score(state), "(b) torch": fused("torch"),
            "(c) compiled": fused("compiled")}


def interleaved(calls: dict, repeat: int) -> dict[str, list[float]]:
    """Seconds of `repeat` calls of each, taking turns (round r starts at call r mod k)."""
    names = list(calls)
    times = {name: [] for name in names}
    for r in range(repeat):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--heads", type=int, default=3, help="KV heads")
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--kernel", type=int, default=7, help="avg pooling kernel")
    parser.add_argument("--repeat", type=int, default=31, help="timed calls of each implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each first (compiles (c))")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pooling = Pooling(kind="avg", kernel=args.kernel)
    scorers = {"snapkv": WindowAttention(window=args.window, pooling=pooling, gqa="mean"),
               "lava": Lava(window=args.window, pooling=pooling, gqa="max")}
    h, g, d = args.heads, args.group, args.dim
    print(f"threads {torch.get_num_threads()}, B=1, H={h} KV heads, G={g}, d={d}, fp32, window {args.window}, "
          f"avg pooling {args.kernel}; median of {args.repeat} interleaved calls each")
    print(f"{'scorer':<7} {'N':>6} {'implementation':<18} {'ms/call':>9} {'spread':>7} {'ratio to (a)':>12} "
          f"{'min ms':>8} {'min ratio':>9}")
    for n in args.tokens:
        gen = torch.Generator().manual_seed(n)
        state = LayerState(queries=torch.randn(1, h * g, args.window, d, generator=gen),
                           keys=torch.randn(1, h, n, d, generator=gen),
                           values=torch.randn(1, h, n, d, generator=gen), mask=None, scale=None)
        for label, scorer in scorers.items():
            calls = implementations(scorer, state)
            expected = calls["(a) score(state)"]()
            for name, call in calls.items():
                for _ in range(args.warmup):
                    call()
                assert_close(call(), expected)
            times = interleaved(calls, args.repeat)
            base = times["(a) score(state)"]
            for name, seconds in times.items():
                median = statistics.median(seconds)
                q1, _, q3 = statistics.quantiles(seconds, n=4)
                print(f"{label:<7} {n:>6} {name:<18} {median * 1e3:>9.3f} {(q3 - q1) / median:>6.0%} "
                      f"{median / statistics.median(base):>12.2f} {min(seconds) * 1e3:>8.3f} "
                      f"{min(seconds) / min(base):>9.2f}")


if __name__ == "__main__":
    main()
