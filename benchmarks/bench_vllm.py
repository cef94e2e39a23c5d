"""kvcompile inside vLLM (docs/VLLM.md): concurrent long requests in a fixed KV memory, vLLM's full cache
against the plugin's budgets, uniform (snapkv) and head-wise / layer-dynamic (adakv, lava).

Each configuration runs in a fresh process of the vLLM environment (the plugin is configured by its
environment variables at process start): the embedded SmolLM2-135M (fp32, eager, vLLM's CPU attention),
`--requests` prompts of `--length` tokens (consecutive stretches of data/haystack.txt, one per request)
added at once, `--new-tokens` greedy tokens each (ignore_eos), a KV pool of exactly `--kv-blocks` blocks
of `--block-size` tokens (num_gpu_blocks_override), prefix caching off (the plugin refuses it) and chunked
prefill off (a whole prompt per step; the full-cache run uses the same settings). The engine core runs in-process and is stepped
by hand. Columns:

- peak run: the most requests in vLLM's running queue at once (read after every step);
- TTFT s: time from the common start to each request's first token, median and max;
- tok/s: generated tokens / total time; total s: first request in to last token out;
- preempt: requests vLLM preempted (full cache only: the plugin refuses to preempt a compressed request);
- RSS MiB: the process's peak resident memory (engine core and worker run in it).

The defaults are the serving benchmark of transformers' engine (benchmarks/serve_load.py): 16 requests of
4,096 tokens, 64 new, a pool of 16,384 tokens. vLLM's own `vllm bench serve` goes through HTTP and cannot
read the scheduler's running queue, so the engine is stepped here.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--requests 16] [--length 4096] [--new-tokens 64]
        [--kv-blocks 128] [--block-size 128] [--threads 2]
        [--configs full snapkv:256 adakv:256 lava:256 snapkv:128 adakv:128 lava:128]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = ["full", "snapkv:256", "adakv:256", "lava:256", "snapkv:128", "adakv:128", "lava:128"]


def run_one(args) -> dict:
    """One configuration, in this process (the environment says which plugin settings)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcompile.tools.data import load_haystack

    max_len = args.length + args.new_tokens + 8
    llm = LLM(model=str(ROOT / "models" / "smollm2-135m"), dtype="float32", enforce_eager=True, seed=0,
              max_model_len=max_len, max_num_batched_tokens=max_len, enable_prefix_caching=False,
              enable_chunked_prefill=False, async_scheduling=False, block_size=args.block_size,
              num_gpu_blocks_override=args.kv_blocks, max_num_seqs=args.requests)
    ids = llm.get_tokenizer()(load_haystack()).input_ids
    prompts = [ids[(i * args.length) % (len(ids) - args.length):][:args.length] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
    first, peak, generated, preempted = {}, 0, 0, set()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        peak = max(peak, len(scheduler.running))
        preempted |= {r.request_id for r in scheduler.waiting if r.num_preemptions}
        now = time.perf_counter()
        for o in outputs:
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now - start
            if o.finished:
                generated += len(o.outputs[0].token_ids)
    total = time.perf_counter() - start
    ttft = sorted(first.values())
    return {"peak": peak, "ttft_median": statistics.median(ttft), "ttft_max": ttft[-1],
            "tok_s": generated / total, "total": total, "preempted": len(preempted), "generated": generated,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration here
    args = parser.parse_args()
    if args.one is not None:
        print("RESULT" + json.dumps(run_one(args)))
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMPILE_VLLM_")}
    env["OMP_NUM_THREADS"] = str(args.threads)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"SmolLM2-135M fp32 on vLLM {_vllm_version()} (CPU), {args.requests} requests x {args.length} prompt tokens "
          f"+ {args.new_tokens} new, KV pool {args.kv_blocks} blocks x {args.block_size} tokens "
          f"= {args.kv_blocks * args.block_size} tokens, {args.threads} threads")
    print(f"{'config':<15}{'peak run':>9}{'TTFT med s':>12}{'TTFT max s':>12}{'tok/s':>8}{'total s':>9}{'preempt':>8}"
          f"{'RSS MiB':>9}  against full")
    full = None
    for config in args.configs:
        run_env = dict(env)
        if config != "full":
            spec, per_head = config.split(":")
            run_env.update(KVCOMPILE_VLLM_SPEC=spec, KVCOMPILE_VLLM_PER_HEAD=per_head)
        cmd = [sys.executable, __file__, "--one", "1", "--requests", str(args.requests), "--length", str(args.length),
               "--new-tokens", str(args.new_tokens), "--kv-blocks", str(args.kv_blocks),
               "--block-size", str(args.block_size)]
        proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0 or "RESULT" not in proc.stdout:
            print(f"{config:<15} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            continue
        r = json.loads(proc.stdout.split("RESULT", 1)[1].splitlines()[0])
        full = r if config == "full" else full
        against = "" if full is None or config == "full" else \
            f"{r['peak'] / full['peak']:.1f}x requests, {r['tok_s'] / full['tok_s']:.2f}x tok/s"
        print(f"{config:<15}{r['peak']:>9}{r['ttft_median']:>12.2f}{r['ttft_max']:>12.2f}{r['tok_s']:>8.2f}"
              f"{r['total']:>9.1f}{r['preempted']:>8}{r['rss_mib']:>9.0f}  {against}", flush=True)


def _vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm-cpu")


if __name__ == "__main__":
    main()
