"""End to end on the embedded SmolLM2-135M: eager entry, compiled entry, full cache (docs/INTERNALS.md
"Measuring speed").

For each spec at an N-token random prompt (default 4096) and `--per-head` tokens per KV head
(default 128), greedy generation of `--new-tokens` tokens, timed by a logits processor that
stamps every step. Columns:

- prefill s: call start to the first step (prompt attention + compression);
- ms/token, tok/s: median interval between two steps (one decode step);
- KV MB, % full: K+V bytes held in pages after generating, and against a full cache of the
  same tokens;
- GB/s: bytes one decode step must read (the weights once, tied embedding counted once, plus
  the stored K+V entries) per second of the step;
- × bound: step time ÷ (those bytes ÷ the read bandwidth measured at the start of the run);
- speed-up: the full cache's step time ÷ this step time (same run);
- ideal: (weights + full KV bytes) ÷ (weights + this run's K+V bytes read per step), the
  speed-up if a step were bound by the bytes it reads (issue 6); % ideal = speed-up ÷ ideal.

The compiled entry is compiled once, on a short prompt, before the first compiled row; the
line after the table gives that compile time and the graphs it made, then whether the 4k
prompts and every other spec reused them. `--cold` compiles into a fresh, empty Inductor
cache (a first compile, as a new user sees it). `--sweep N1 N2 ...` then generates with the
compiled entry from prompts of those lengths and prints the graph count after each.

    python3 benchmarks/bench_e2e.py [--length 4096] [--per-head 128] [--new-tokens 32]
        [--specs snapkv pyramidkv adakv lava] [--modes eager compiled] [--threads N] [--cold]
        [--sweep 37 517 1500 2900]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch._dynamo.utils import counters

import kvcompile
from kvcompile.tools.models import full_kv_bytes, load_model
from kvcompile.tools.cli import policy_for  # --per-head, unless the spec's threshold sets its own budget


class Clock:
    """A logits processor that stamps the time of every generation step."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def run(model, ids, new_tokens: int):
    """Greedy generation: (prefill s, median s per decode step, generated ids, cache)."""
    clock, start = Clock(), time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, logits_processor=[clock],
                         return_dict_in_generate=True)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    return clock.stamps[0] - start, statistics.median(steps), out.sequences[0, ids.shape[1]:], out.past_key_values


def read_bandwidth(megabytes: int = 256, repeat: int = 5) -> float:
    """Bytes per second read by a sum over a large fp32 tensor (best of `repeat`)."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = min(_seconds(x.sum) for _ in range(repeat))
    return x.numel() * 4 / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens (random ids)")
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--specs", nargs="+", default=["snapkv", "pyramidkv", "adakv", "lava"])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache row")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--cold", action="store_true", help="compile into a fresh, empty Inductor cache")
    parser.add_argument("--sweep", type=int, nargs="*", default=[],
                        help="prompt lengths to generate from with the compiled entry, counting graphs")
    args = parser.parse_args()
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvcompile-inductor-")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, _ = load_model()
    ids = torch.randint(100, 40000, (1, args.length))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    bandwidth = read_bandwidth()
    full_bytes = full_kv_bytes(model, args.length + args.new_tokens - 1)
    print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads, prompt {args.length} random tokens, "
          f"{args.per_head} per KV head, {args.new_tokens} new tokens (greedy); weights "
          f"{weights / 1e6:.0f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    header = (f"{'run':<22} {'prefill s':>9} {'ms/token':>9} {'tok/s':>6} {'KV MB':>7} {'% full':>7} "
              f"{'GB/s':>6} {'× bound':>8} {'speed-up':>8} {'ideal':>6} {'% ideal':>7}  same tokens as eager")
    print(header + "\n" + "-" * len(header), flush=True)

    full_step = None

    def row(name, prefill, step, kv_held, kv_read, same=""):
        read = weights + kv_read
        ratios = "" if full_step is None else (f"{full_step / step:>8.2f} {(weights + full_bytes) / read:>6.2f} "
                                               f"{100 * full_step / step / ((weights + full_bytes) / read):>6.0f}%")
        print(f"{name:<22} {prefill:>9.2f} {step * 1e3:>9.1f} {1 / step:>6.1f} {kv_held / 1e6:>7.1f} "
              f"{100 * kv_held / full_bytes:>6.1f}% {read / step / 1e9:>6.1f} "
              f"{step / (read / bandwidth):>8.1f} {ratios:>23}  {same}", flush=True)

    compile_note = None
    with torch.no_grad():
        if not args.no_full:
            prefill, step, _, _ = run(model, ids, args.new_tokens)
            row("full cache", prefill, step, full_bytes, full_bytes)
            full_step = step
        for spec in args.specs:
            tokens = {}
            for mode in args.modes:
                kvcompile.compile(model, policy_for(spec, args.per_head, own_budget_wins=True), mode=mode)
                if mode == "compiled" and compile_note is None:
                    before = graphs()
                    seconds = _seconds(lambda: run(model, ids[:, :100], 4))
                    warm = graphs()
                    compile_note = [seconds, warm - before, warm]
                prefill, step, tokens[mode], cache = run(model, ids, args.new_tokens)
                kvcompile.uncompile(model)
                report = cache.memory_report()
                same = "" if mode == "eager" or "eager" not in tokens else \
                    ("yes" if torch.equal(tokens[mode], tokens["eager"]) else "NO")
                row(f"{spec}, {mode}", prefill, step, report["bytes_held"], report["bytes_entries"], same)
    if compile_note is not None:
        seconds, made, warm = compile_note
        print(f"\ncompiled entry: first compile {seconds:.1f} s{' (cold Inductor cache)' if args.cold else ''} "
              f"(generate on a 100-token prompt, 4 new tokens: {made} graphs); "
              f"{graphs() - warm} more graphs for the {args.length}-token prompts and {len(args.specs)} specs")
    if args.sweep:
        sweep(model, args.specs, args.per_head, args.sweep)


def sweep(model, specs: list[str], per_head: int, lengths: list[int]) -> None:
    """Graphs held by dynamo after generating 8 tokens from each prompt length, every spec."""
    counts = []
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(100, 40000, (1, n))
            for spec in specs:
                with kvcompile.compiled(model, policy_for(spec, per_head, own_budget_wins=True), mode="compiled"):
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                   do_sample=False)
            counts.append(f"{n}: {graphs()}")
    print(f"graphs after prompts of each length ({', '.join(specs)}; 8 new tokens): " + ", ".join(counts))


if __name__ == "__main__":
    main()
