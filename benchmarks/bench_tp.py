"""Tensor parallelism on this CPU (docs/DISTRIBUTED.md): SmolLM2-135M (3 KV heads, 9 query heads) sharded
over 3 gloo ranks with transformers' tp_plan="auto", each spec compiled and generating greedily;
then rank 0 runs the same specs on the whole model in one process and says whether the tokens
and the kept entries (per layer and KV head, gathered from the ranks) are the same. The first
row, "full", is the sharded model's own generate() with transformers' DynamicCache (no kvcompile):
the cost of the model's own collectives (an all-reduce after o_proj and after down_proj in every
layer) on this machine.

Per rank and spec: prefill s (call start to the first step: the prompt's attention, its
compression and the collectives), ms/token (median decode step), KV held by this rank (its
own KV heads' pages). Every rank runs on `--threads` threads (default 1: 3 ranks on a shared
2-core machine).

    PYTHONPATH=. torchrun --nproc-per-node 3 benchmarks/bench_tp.py [--length 1024] [--per-head 64]
        [--new-tokens 16] [--specs snapkv adakv lava zsmerge dbudgetkv] [--no-reference]

(PYTHONPATH=.: torchrun puts benchmarks/ first on sys.path, not the repository.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import kvcompile
from kvcompile.tools.cli import policy_for
from kvcompile.tools.models import default_model_dir

from bench_e2e import Clock  # benchmarks/ is the script's folder, so on sys.path


def generate(model, ids, new_tokens: int):
    """(prefill s, median s per decode step, generated ids, cache)."""
    clock, start = Clock(), time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, logits_processor=[clock],
                             return_dict_in_generate=True)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    return clock.stamps[0] - start, statistics.median(steps), out.sequences[0, -new_tokens:].tolist(), \
        out.past_key_values


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--per-head", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--specs", nargs="+", default=["snapkv", "adakv", "lava", "zsmerge", "dbudgetkv"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-reference", action="store_true", help="skip the one-process run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM

    path = str(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (1, args.length), generator=g)
    results = {}
    generate(model, ids[:, :64], 2)
    prefill, step, full_tokens, _ = generate(model, ids, args.new_tokens)
    rows = [None] * world
    dist.all_gather_object(rows, (rank, prefill, step * 1e3))
    if rank == 0:
        for r, pre, ms in rows:
            print(f"{'full':<10} rank {r}: prefill {pre:6.2f} s  decode {ms:6.1f} ms/token (DynamicCache, no kvcompile)",
                  flush=True)
    for spec in args.specs:
        policy = policy_for(spec, args.per_head, own_budget_wins=True)
        with kvcompile.compiled(model, policy):
            generate(model, ids[:, :64], 2)  # warm-up: kernels built, first-call costs paid
            prefill, step, tokens, cache = generate(model, ids, args.new_tokens)
        report, gathered = cache.memory_report(), cache.gathered_memory_report()
        results[spec] = (tokens, gathered["kept"])
        rows = [None] * world
        dist.all_gather_object(rows, (rank, prefill, step * 1e3, report["bytes_held"] / 2 ** 20, report["kv_heads"]))
        if rank == 0:
            for r, pre, ms, mib, heads in rows:
                print(f"{spec:<10} rank {r} heads {heads}: prefill {pre:6.2f} s  decode {ms:6.1f} ms/token  "
                      f"KV held {mib:6.2f} MiB", flush=True)
            print(f"{spec:<10} gathered: KV held {gathered['bytes_held'] / 2 ** 20:.2f} MiB of "
                  f"{gathered['bytes_full'] / 2 ** 20:.2f} MiB full; tokens {tokens}", flush=True)
    del model
    dist.barrier()
    if rank == 0 and not args.no_reference:  # the whole model in this one process, same weights
        one = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        generate(one, ids[:, :64], 2)
        prefill, step, tokens, _ = generate(one, ids, args.new_tokens)
        print(f"{'full':<10} one process: prefill {prefill:6.2f} s  decode {step * 1e3:6.1f} ms/token; tokens "
              f"{'equal' if tokens == full_tokens else 'DIFFER'}", flush=True)
        for spec in args.specs:
            with kvcompile.compiled(one, policy_for(spec, args.per_head, own_budget_wins=True)):
                generate(one, ids[:, :64], 2)
                prefill, step, tokens, cache = generate(one, ids, args.new_tokens)
            same_tokens = tokens == results[spec][0]
            same_kept = torch.equal(cache.kept(), results[spec][1])
            print(f"{spec:<10} one process: prefill {prefill:6.2f} s  decode {step * 1e3:6.1f} ms/token; "
                  f"tokens {'equal' if same_tokens else 'DIFFER'}, kept entries per (layer, head) "
                  f"{'equal' if same_kept else 'DIFFER'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
