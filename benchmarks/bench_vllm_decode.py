"""The vLLM plugin's decode attention alone (kvcompile.integrations.vllm.packed_attention, no vLLM): one layer's call
for every compressed request of a step, at SmolLM2-135M's shapes (30 layers, 3 KV heads, 3 query heads each, head
dim 64, vLLM's 128-slot blocks), each request's prompt compressed to `--per-head` entries per (layer, head) and
packed in float32 or as int8 / int4 codes (one scale an entry), with `--new` decode entries. Prints the median ms of
a layer's call (layers in turn) per storage, in the C++ kernel or (`--backend torch`) the torch backend.

    python benchmarks/bench_vllm_decode.py [--requests 16] [--length 4096] [--per-head 128] [--new 32]
        [--threads 1] [--reps 30] [--storage 32 8 4] [--backend cpp|torch]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcompile.integrations.vllm.codes import Codes, slot_bytes
from kvcompile.integrations.vllm.packed_attention import DecodePlan, PackedCpp, PackedLayer, PackedTorch, Record
from kvcompile.integrations.vllm.packing import locations, region

LAYERS, HEADS, GROUPS, HEAD_DIM, BLOCK = 30, 3, 3, 64, 128


def step(bits: int, requests: int, length: int, per_head: int, new: int, backend: str):
    """A step of `requests` compressed requests, one query row each: its plan, queries and caches."""
    g = torch.Generator().manual_seed(0)
    codes = None if bits == 32 else Codes(bits, HEAD_DIM, HEAD_DIM)
    blocks = -(-(length + new) // BLOCK)
    caches = {j: torch.randn(requests * blocks, HEADS, BLOCK, 2 * HEAD_DIM, generator=g) for j in range(LAYERS)}
    table = torch.arange(requests * blocks, dtype=torch.int32).view(requests, blocks)
    counts = torch.full((LAYERS, HEADS), per_head)
    rows = []
    for i in range(requests):
        where = locations(counts, length, table[i].long(), BLOCK, codes, slot_bytes(caches[0]))
        layers = [PackedLayer(where[j], counts[j], codes) for j in range(LAYERS)]
        for layer in layers:
            entries = int(counts[0].sum())
            layer.write(caches, torch.randn(entries, HEAD_DIM, generator=g), torch.randn(entries, HEAD_DIM, generator=g))
        record = Record(length, region(counts, codes, slot_bytes(caches[0])), layers)
        rows.append((i, record, i, 1, length + new - 1))
    attention = PackedCpp(GROUPS, HEAD_DIM, codes) if backend == "cpp" else PackedTorch()
    plan = DecodePlan.plan(rows, table, HEADS, GROUPS, HEAD_DIM, attention)
    query = torch.randn(requests, HEADS * GROUPS, HEAD_DIM, generator=g)
    return plan, query, caches, torch.tensor([caches[j].data_ptr() for j in range(LAYERS)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--backend", choices=("cpp", "torch"), default="cpp")
    parser.add_argument("--storage", type=int, nargs="+", default=[32, 8, 4], help="32: float32; 8, 4: codes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for bits in args.storage:
        plan, query, caches, addresses = step(bits, args.requests, args.length, args.per_head, args.new,
                                              args.backend)
        out = torch.empty_like(query)
        plan.run(0, query, out, caches, addresses, HEAD_DIM ** -0.5)  # builds the kernel
        times = []
        for rep in range(args.reps):
            start = time.perf_counter()
            plan.run(rep % LAYERS, query, out, caches, addresses, HEAD_DIM ** -0.5)
            times.append(time.perf_counter() - start)
        name = "float32" if bits == 32 else f"int{bits}"
        print(f"{name:<8} {args.backend:<5} {args.requests} requests x {args.per_head} per head + {args.new} new, "
              f"{args.threads} thread(s): {statistics.median(times) * 1e3:.3f} ms a layer", flush=True)


if __name__ == "__main__":
    main()
