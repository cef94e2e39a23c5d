"""Prompt compression alone: one captured prompt (kvcompile.tools.sweep.capture) replayed under
each spec (kvcompile.tools.sweep.replay), the runtime's per-layer scoring, selection, merge and
cascade without the model's forward. Prints a table of seconds per replay (min of repeats).

    python benchmarks/bench_replay.py --length 4000 --specs lava snapkv zsmerge
"""
from __future__ import annotations

import argparse
import time

import torch

import kvcompile
from kvcompile.tools.models import load_model
from kvcompile.tools.sweep import capture, replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4000, help="prompt tokens (random ids)")
    parser.add_argument("--specs", nargs="+", default=["lava", "snapkv"])
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model()
    ids = torch.randint(100, 40000, (1, args.length), generator=torch.Generator().manual_seed(0))
    states, _ = capture(model, ids)
    print(f"{'spec':<12} {'replay s (min)':>15} {'entries kept':>13}")
    for spec in args.specs:
        policy = kvcompile.load_spec(spec, per_head=args.per_head) \
            if kvcompile.load_spec(spec).budget.threshold is None else kvcompile.load_spec(spec)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            cache = replay(policy, model.config, states)
            times.append(time.perf_counter() - start)
        print(f"{spec:<12} {min(times):>15.3f} {int(cache.kept().sum()):>13}")


if __name__ == "__main__":
    main()
