"""Decode speed on the embedded SmolLM2: median ms per generated token (greedy), full cache vs
a spec in the eager or compiled entry. Prints one line per run.

    python benchmarks/decode_speed.py --length 4096 --runs full snapkv:eager lava:eager snapkv:compiled
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvcompile
from kvcompile.tools.models import load_model


class Clock:
    """A logits processor that stamps the time of every generation step."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def timed(model, ids, new_tokens: int) -> tuple[float, float]:
    clock, start = Clock(), time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, logits_processor=[clock])
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    return clock.stamps[0] - start, statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens (random ids)")
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", nargs="+", default=["full", "snapkv:eager", "adakv:eager", "lava:eager"],
                        help="full, or SPEC:eager / SPEC:compiled")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, _ = load_model()
    ids = torch.randint(100, 40000, (1, args.length))
    print(f"{'run':22s} {'prefill s':>9s} {'ms/token':>9s} {'tok/s':>6s}")
    with torch.no_grad():
        for run in args.runs:
            if run != "full":
                spec, mode = run.split(":")
                kvcompile.compile(model, spec, per_head=args.per_head, mode=mode)
                if mode == "compiled":
                    timed(model, ids, 4)  # compile outside the timing
            prefill, step = timed(model, ids, args.new_tokens)
            kvcompile.uncompile(model)
            print(f"{run:22s} {prefill:9.2f} {step * 1000:9.1f} {1 / step:6.1f}", flush=True)


if __name__ == "__main__":
    main()
