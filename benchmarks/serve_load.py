"""Serving load (issue 14): many concurrent requests through transformers' continuous batching engine in
a fixed KV memory, full cache against kvcompile policies.

Each configuration runs in a fresh process (its peak RSS is its own): the embedded SmolLM2-135M (fp32),
`--requests` requests of `--length`-token prompts (English text from data/haystack.txt, a different
stretch per request) sent at once, `--new-tokens` greedy tokens each, the engine's pool sized for
`--kv-tokens` tokens of full cache. "full" is transformers' own engine (sdpa), the others the same
engine on the compiled model (kvcompile.integrations.batching). Columns:

- peak req: the most requests holding a cache at once (sampled every 20 ms from the scheduler's
  active requests; for kvcompile also its exact count, `memory_report()["peak_requests"]`);
- TTFT s: time to first token, median and max over requests (from each request's creation);
- tok/s: all generated tokens / total time; total s: first request in to last token out;
- RSS MiB: the process's peak resident memory;
- soft resets (kvcompile, when any): requests the engine preempted under memory pressure, replayed exactly
  (`memory_report()["soft_resets"]`).

Targets (issue 14): at 256 per head at least 4x the concurrent requests and 2x the throughput of the
full cache; head-wise specs (adakv, lava) within 10% of snapkv's concurrency at the same budget.

    python3 benchmarks/serve_load.py [--requests 16] [--length 4096] [--new-tokens 64] [--kv-tokens 16384]
        [--configs full snapkv:256 adakv:256 lava:256 snapkv:128 adakv:128 lava:128] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time

DEFAULT_CONFIGS = ["full", "snapkv:256", "adakv:256", "lava:256", "snapkv:128", "adakv:128", "lava:128"]


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, consecutive stretches of the haystack text (wrapping around)."""
    from kvcompile.tools.data import load_haystack

    ids = tokenizer(load_haystack(), add_special_tokens=False)["input_ids"]
    need = count * length
    ids = (ids * (need // len(ids) + 1))[:need]
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def run_one(config: str, args) -> dict:
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kvcompile
    from kvcompile.tools.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    if config != "full":
        spec, per_head = config.split(":")
        kvcompile.compile(model, spec, per_head=int(per_head))
    inputs = prompts(tokenizer, args.requests, args.length)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=tokenizer.pad_token_id or 0)
    cb = ContinuousBatchingConfig(num_blocks=args.kv_tokens // args.page_size, page_size=args.page_size,
                                  max_batch_tokens=args.max_batch_tokens, use_async_batching=False,
                                  allow_block_sharing=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    peak, done = 0, threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            processor = manager.batch_processor
            if processor is not None:
                peak = max(peak, len(processor.scheduler.active_requests))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    ids = manager.add_requests(inputs=inputs, max_new_tokens=args.new_tokens, record_timestamps=True)
    results = {}
    deadline = start + args.timeout
    while len(results) < len(ids) and time.perf_counter() < deadline:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
    total = time.perf_counter() - start
    done.set()
    exact = resets = None
    cache = manager.batch_processor.cache
    if hasattr(cache, "memory_report"):
        report = cache.memory_report()
        exact, resets = report["peak_requests"], report["soft_resets"]
    manager.stop(block=True, timeout=30)
    errors = [r.error for r in results.values() if r.error is not None]
    ttft = [r.timestamps[0] - r.created_time for r in results.values() if r.timestamps]
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return {"config": config, "finished": len(results), "errors": errors[:3], "peak_sampled": peak,
            "peak_exact": exact, "soft_resets": resets, "ttft_median": statistics.median(ttft) if ttft else None,
            "ttft_max": max(ttft) if ttft else None, "tokens": tokens, "total_s": total,
            "tok_s": tokens / total, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kv-tokens", type=int, default=16384, help="the pool, in tokens of full cache")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=4160,
                        help="tokens one forward packs (default: one whole prompt and 64 decode steps, so "
                             "kvcompile compresses a prompt in one pass, not in chunks)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="full or SPEC:PER_HEAD")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one configuration, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)), flush=True)
        return
    rows = []
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k not in ("configs", "one")]
    for config in args.configs:
        out = subprocess.run([sys.executable, __file__, f"--one={config}", *passthrough], capture_output=True,
                             text=True)
        if out.returncode != 0:
            print(f"{config}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        row = rows[-1]
        print(f"{row['config']:<12} peak req {row['peak_sampled']:>3} ({row['peak_exact']})  "
              f"TTFT {row['ttft_median']:.1f}/{row['ttft_max']:.1f} s  {row['tok_s']:.2f} tok/s  "
              f"total {row['total_s']:.1f} s  RSS {row['rss_mib']:.0f} MiB  finished {row['finished']}"
              + (f"  soft resets {row['soft_resets']}" if row["soft_resets"] else "")
              + (f"  errors {row['errors']}" if row["errors"] else ""), flush=True)
    full = next((r for r in rows if r["config"] == "full"), None)
    if full is not None:
        for r in rows:
            if r is not full and full["peak_sampled"] and full["tok_s"]:
                print(f"{r['config']:<12} x{r['peak_sampled'] / full['peak_sampled']:.1f} concurrency, "
                      f"x{r['tok_s'] / full['tok_s']:.1f} throughput against the full cache")


if __name__ == "__main__":
    main()
