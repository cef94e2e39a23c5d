"""One layer's decode call through the eager entry (transformers' AttentionInterface function), in µs.

A single-layer cache of SmolLM2's attention shape (3 KV heads × 3 query heads, d 64) holds a
`--prompt`-token prompt compressed to `--per-head` entries per head; each call then decodes one token
through `kvcompile_attention`, what every layer of a compiled model runs per generated token. It measures
the entry's own overhead (dispatch, the engine's bookkeeping) beside the kernels, one torch thread.
Works on an earlier checkout too (PYTHONPATH=<checkout>), to compare two versions:

    PYTHONPATH=. python3 benchmarks/bench_entry_call.py [--specs snapkv,zsmerge,tova] [--calls 300] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

import kvcompile
from kvcompile.cache import KVCompileCache

try:  # the engine's entry; a checkout from before kvcompile/engine/ has it in kvcompile.runtime
    from kvcompile.engine.op import kvcompile_attention
except ImportError:  # pragma: no cover - an earlier version
    from kvcompile.runtime import kvcompile_attention


def measure(spec: str, args) -> tuple[float, float]:
    h, g, d, n = 3, 3, 64, args.prompt
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    base = kvcompile.load_spec(spec)
    policy = base if base.budget.threshold is not None else kvcompile.load_spec(spec, per_head=args.per_head)
    cache = KVCompileCache(policy, config, headroom=args.calls * (args.repeats + 1))
    gen = torch.Generator().manual_seed(0)
    layer = SimpleNamespace(layer_idx=0)
    call = lambda q, k, v: kvcompile_attention(layer, q, k, v, None, scaling=d ** -0.5,  # noqa: E731
                                               kvcompile_cache=cache)
    with torch.no_grad():
        call(*(torch.randn(1, x, n, d, generator=gen) for x in (h * g, h, h)))
        step = [torch.randn(1, x, 1, d, generator=gen) for x in (h * g, h, h)]
        for _ in range(args.calls):  # warm-up
            call(*step)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                call(*step)
            times.append((time.perf_counter() - start) / args.calls * 1e6)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", default="snapkv,zsmerge,tova", help="comma-separated spec names")
    parser.add_argument("--prompt", type=int, default=2000, help="prompt tokens (default 2000)")
    parser.add_argument("--per-head", type=int, default=128, help="entries kept per KV head (default 128)")
    parser.add_argument("--calls", type=int, default=300, help="decode calls per repeat (default 300)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"kvcompile at {kvcompile.__file__}")
    print("| spec | µs per call (median) | min |")
    print("|---|---|---|")
    for spec in args.specs.split(","):
        med, low = measure(spec, args)
        print(f"| {spec} | {med:.0f} | {low:.0f} |", flush=True)


if __name__ == "__main__":
    main()
