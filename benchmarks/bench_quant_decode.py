"""Decode attention over quantized pages on the CPU: the C++ kernels on fp32, int8 and int4 pages.

For each model shape (H KV heads, G query heads per KV head, head dim d) and each retained size
(tokens per head, every head the same), one decode step's attention (B = 1) over pages laid out
in head order (the runtime's layout for a compressed prompt): the fp32 C++ kernel
(kvcompile/kernels/paged_attention_cpp.py) and the quantized C++ kernel
(kvcompile/kernels/paged_attention_quant.py) on int8 and int4 pages, keys per channel (KIVI) and
per token (one group of d channels), values per token in groups of --value-group channels. Each
quantized result is checked against the eager reference (dequantize, then paged_attention_torch)
before it is timed. Prints ms per call warm (the call repeated: the pages partly stay in the CPU
caches) and cold (--flush-mb written before each call: the pages come from memory, as in a decode
step), the bytes the call reads (codes, scales, zeros; fp32: K and V), those bytes ÷ the cold
time, and the fp32 kernel's cold time ÷ each kernel's. The copy bandwidth and the machine's load
average are measured in the same run (a shared machine moves both).

    python3 benchmarks/bench_quant_decode.py [--tokens 4096 32768] [--shapes 3,3,64 8,4,128]
                                             [--repeat 15] [--threads N]
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch

from kvcompile.kernels import paged_attention_cpp as fp32_cpp
from kvcompile.kernels import paged_attention_quant as pq
from kvcompile.kernels.quantize import quantize

from bench_decode import cache_flusher, copy_bandwidth, timed  # benchmarks/ is the script's folder, so on sys.path


def paged_cache(per_head: int, heads: int, group: int, dim: int, page: int, gen: torch.Generator):
    """q (1, H·G, d) and fp32 pages holding `per_head` entries of every head, each head's pages one
    after the other in the pool (as the page store lays out a compressed prompt)."""
    pages = -(-per_head // page)
    k_pages = torch.randn(heads * pages, page, dim, generator=gen)
    v_pages = torch.randn(heads * pages, page, dim, generator=gen)
    table = torch.arange(heads * pages).view(1, heads, pages)  # int64, as the cache keeps it
    lengths = torch.full((1, heads), per_head, dtype=torch.long)
    q = torch.randn(1, heads * group, dim, generator=gen)
    return q, k_pages, v_pages, table, lengths


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768], help="retained tokens per head")
    parser.add_argument("--shapes", nargs="+", default=["3,3,64", "8,4,128"],
                        help="H,G,d: KV heads, query heads per KV head, head dim (SmolLM2-135M: 3,3,64)")
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--value-group", type=int, default=32, help="channels per value group (KIVI: 32)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--copy-mb", type=int, default=256)
    parser.add_argument("--flush-mb", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    flush = cache_flusher(args.flush_mb)
    load_before = os.getloadavg()
    bandwidths = []
    rows = []
    for shape in args.shapes:
        heads, group, dim = (int(x) for x in shape.split(","))
        for per_head in args.tokens:
            bandwidths.append(copy_bandwidth(args.copy_mb, args.repeat))
            q, k_pages, v_pages, table, lengths = paged_cache(per_head, heads, group, dim, args.page, gen)
            methods = {"fp32": (lambda: fp32_cpp.paged_attention_cpp(q, k_pages, v_pages, table, lengths),
                                nbytes(k_pages, v_pages))}
            for bits in (8, 4):
                vq = quantize(v_pages, bits, args.value_group)
                for keys in ("channel", "token"):
                    kq = quantize(k_pages, bits, None, keys)
                    call = (lambda kq=kq, vq=vq: pq.paged_attention_quant_cpp(q, *kq, *vq, table, lengths))
                    reference = pq.paged_attention_quant_torch(q, *kq, *vq, table, lengths)
                    torch.testing.assert_close(call(), reference)
                    methods[f"int{bits}, keys per {keys}"] = (call, nbytes(*kq, *vq))
            timings = {name: (timed(fn, args.repeat), timed(fn, args.repeat, flush), size)
                       for name, (fn, size) in methods.items()}
            fp32_cold = timings["fp32"][1]
            rows += [(shape, per_head, name, warm, cold, size, fp32_cold / cold)
                     for name, (warm, cold, size) in timings.items()]
    bandwidths.append(copy_bandwidth(args.copy_mb, args.repeat))
    load_after = os.getloadavg()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {torch.get_num_threads()} threads; "
          f"page {args.page}; values per token in groups of {args.value_group}; keys per token: one group of d")
    print(f"copy bandwidth (read + write, {args.copy_mb} MB): {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)} GB/s; "
          f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"warm: the same call repeated; cold: {args.flush_mb} MB written before each call (pages from memory)")
    print("| H,G,d | tokens/head | kernel | MB read | warm ms | cold ms | cold GB/s | fp32 cold ÷ this |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, per_head, name, warm, cold, size, speedup in rows:
        print(f"| {shape} | {per_head} | {name} | {size / 1e6:.1f} | {warm * 1e3:.3f} | {cold * 1e3:.3f} | "
              f"{size / cold / 1e9:.1f} | {speedup:.2f}× |")


if __name__ == "__main__":
    main()
