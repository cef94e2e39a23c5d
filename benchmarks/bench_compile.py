"""Compile cost of the compiled entry, cold and warm (issue 11).

Each run is a fresh Python process (`--child`) on the embedded SmolLM2-135M that compiles the
model with `kvcompile.compile(model, spec, mode="compiled")` and generates `--new-tokens`
tokens greedily from an N-token prompt (default ~1k random tokens, seed 0, batch 1, no mask),
then, in the same process, from a left-padded batch of 2 and one of 3 with new prompt
lengths (`--batches`), to show that they reuse the first prefill + decode graphs. The runs
share one Inductor cache directory (TORCHINDUCTOR_CACHE_DIR): the first starts from an empty
one (cold, what a new user sees), the next find what it wrote (warm, a second process).

Columns: process s (wall time of the whole child, model load included); first token s (the
first generate() call to its first token: dynamo tracing, the passes, Inductor for the
prefill graph, the prefill itself); compile s (the backend's time over all graphs: passes +
Inductor, cache lookups included); graphs (compiled by the backend, over every batch);
after batches (graphs added by the `--batches` generations: 0 expected); FX hit / miss /
bypass (Inductor's FX graph cache) and AOT hit / miss (AOTAutograd's cache), from
torch._dynamo.utils.counters.

    python3 benchmarks/bench_compile.py [--length 1024] [--per-head 128] [--new-tokens 8]
        [--spec snapkv] [--runs cold warm] [--cache-dir DIR] [--threads 2] [--batches 2 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args) -> dict:
    """One process: load, compile, generate; returns the measurements (printed as JSON)."""
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, ROOT)
    import kvcompile
    from kvcompile.tools.models import load_model
    from kvcompile.passes.backend import COMPILES

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    policy = kvcompile.load_spec(args.spec, per_head=args.per_head)
    kvcompile.compile(model, policy, mode="compiled")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab, (1, args.length), generator=g)
    stamps: list[float] = []

    def clock(input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                       logits_processor=[clock], pad_token_id=tokenizer.eos_token_id)
    first_token = stamps[0] - start
    graphs_first = len(COMPILES)
    for b in args.batches:  # left-padded batches with new lengths: no new graph expected
        lengths = [args.length // 2 + 37 * i for i in range(b)]
        n = max(lengths)
        batch = torch.full((b, n), tokenizer.eos_token_id, dtype=torch.long)
        mask = torch.zeros(b, n, dtype=torch.long)
        for i, m in enumerate(lengths):
            batch[i, n - m:] = torch.randint(100, vocab, (m,), generator=g)
            mask[i, n - m:] = 1
        with torch.inference_mode():
            model.generate(batch, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=tokenizer.eos_token_id)
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"first_token_s": first_token, "compile_s": sum(c["seconds"] for c in COMPILES),
            "graphs": len(COMPILES), "after_batches": len(COMPILES) - graphs_first,
            "per_graph": [[c["kind"], round(c["seconds"], 1), c.get("cache")] for c in COMPILES],
            "fx_hit": inductor["fxgraph_cache_hit"], "fx_miss": inductor["fxgraph_cache_miss"],
            "fx_bypass": inductor["fxgraph_cache_bypass"], "aot_hit": aot["autograd_cache_hit"],
            "aot_miss": aot["autograd_cache_miss"], "aot_bypass": aot["autograd_cache_bypass"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--spec", default="snapkv")
    parser.add_argument("--runs", nargs="+", default=["cold", "warm"], help="labels; the first gets an empty cache")
    parser.add_argument("--cache-dir", help="Inductor cache directory (default: a fresh temporary one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="*", default=[2, 3])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvcompile-inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, os.path.abspath(__file__), "--child", "--length", str(args.length), "--per-head",
               str(args.per_head), "--new-tokens", str(args.new_tokens), "--spec", args.spec, "--threads",
               str(args.threads), "--batches", *map(str, args.batches)]
    print(f"Inductor cache: {cache_dir}; SmolLM2-135M fp32, {args.length}-token prompt, {args.spec} "
          f"{args.per_head} per head, {args.new_tokens} new tokens, {args.threads} threads; then batches "
          f"{args.batches}", flush=True)
    rows = []
    for label in args.runs:
        start = time.perf_counter()
        proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        sys.stderr.write("".join(line + "\n" for line in proc.stderr.splitlines() if line.startswith("kvcompile")))
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"{label} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        rows.append((label, wall, json.loads(lines[-1][len("RESULT "):])))
    if not args.cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print()
    print("| run | process s | first token s | compile s | graphs | after batches | FX hit / miss / bypass "
          "| AOT hit / miss | per graph (kind, s, cache) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, wall, r in rows:
        per = ", ".join(f"{k} {s} {c}" for k, s, c in r["per_graph"])
        print(f"| {label} | {wall:.1f} | {r['first_token_s']:.1f} | {r['compile_s']:.1f} | {r['graphs']} | "
              f"{r['after_batches']} | {r['fx_hit']} / {r['fx_miss']} / {r['fx_bypass']} | "
              f"{r['aot_hit']} / {r['aot_miss']} | {per} |")


if __name__ == "__main__":
    main()
