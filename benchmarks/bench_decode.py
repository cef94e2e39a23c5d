"""Decode attention over the paged cache on the CPU, against the memory bandwidth.

For each retained size T (tokens per layer, split raggedly over the KV heads), one decode
step's attention over the pages (scattered at random over the pool, the worst case; the C++
kernel also with each head's pages in order, the layout of a freshly compressed prompt, and
with the heads' pages interleaved, the layout of decode appends): the C++ kernel, the torch
lowering compiled by Inductor, the same run eagerly, and F.scaled_dot_product_attention on a
dense cache of the same size. Prints
time per call warm (the call repeated, so K and V partly stay in the CPU caches) and cold
(--flush-mb written before each call: K and V come from memory, as in a decode step where
the weights and the other layers pass in between), the K+V bytes retained, bytes ÷ cold
time, and the ratio of each time to the bound bytes ÷ copy bandwidth, the copy bandwidth
measured in the same run (docs/INTERNALS.md "Measuring speed").
The C++ kernel (the CPU default) and the compiled lowering run on one thread below their
PARALLEL_WORK multiply-adds per call, on all of torch's threads above; the method name says
which ran.

    python3 benchmarks/bench_decode.py [--tokens 8192 16384 32768 65536] [--repeat 15]
                                       [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvcompile.kernels import paged_attention as kernels
from kvcompile.kernels import paged_attention_cpp as cpp
from kvcompile.kernels.paged_attention import paged_attention


def timed(fn, repeat: int, before=None) -> float:
    """Best seconds per call over `repeat` calls, after two warm-up calls (the minimum
    is the least disturbed by other processes on a shared machine); `before()` runs
    untimed ahead of each call."""
    fn(), fn()
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cache_flusher(megabytes: int):
    """A callable that writes `megabytes` of memory, evicting the CPU caches: in a real
    decode step the weights and the other layers pass through the caches between two
    calls of one layer, so its K and V come from memory (the "cold" columns)."""
    buffer = torch.empty(megabytes * 2**20 // 4)
    return lambda: buffer.fill_(1.0)


def copy_bandwidth(megabytes: int, repeat: int) -> float:
    """Bytes moved (read + write) per second by a torch copy of a large fp32 tensor."""
    src = torch.randn(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), repeat)


def paged_cache(tokens: int, heads: int, group: int, dim: int, page: int, gen: torch.Generator,
                layout: str = "scattered"):
    """A cache of `tokens` entries split raggedly over the heads, its pages laid out as
    `layout` says: "scattered" at random over the pool (the worst case: every page boundary
    a jump), "in order" (each head's pages one after the other, as the page store lays out a
    compressed prompt) or "interleaved" (the heads take turns, one page each, as decode
    appends allocate them)."""
    share = torch.rand(heads, generator=gen) + 0.5
    lengths = (share / share.sum() * tokens).long()
    lengths[0] += tokens - lengths.sum()
    pages = (lengths + page - 1) // page
    pool, width = int(pages.sum()), int(pages.max())
    k_pages = torch.randn(pool, page, dim, generator=gen)
    v_pages = torch.randn(pool, page, dim, generator=gen)
    table = torch.zeros(1, heads, width, dtype=torch.long)  # int64, as the cache keeps it
    if layout == "interleaved":  # page i of head h: the i-th turn among the heads still growing
        turns = [(i, h) for i in range(width) for h in range(heads) if i < pages[h]]
        for number, (i, h) in enumerate(turns):
            table[0, h, i] = number
    else:
        order = torch.randperm(pool, generator=gen) if layout == "scattered" else torch.arange(pool)
        start = 0
        for h in range(heads):
            table[0, h, : pages[h]] = order[start: start + pages[h]]
            start += int(pages[h])
    q = torch.randn(1, heads * group, dim, generator=gen)
    return q, k_pages, v_pages, table, lengths.view(1, heads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--heads", type=int, default=3, help="KV heads")
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--copy-mb", type=int, default=256)
    parser.add_argument("--flush-mb", type=int, default=128,
                        help="memory written between cold calls (several times the last-level cache)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    # The bandwidth is measured before each size and at the end, and the bound uses the
    # highest measurement: on a shared machine it moves during a run (34-92 GB/s seen here),
    # and the highest is the strictest bound.
    measured = []
    flush = cache_flusher(args.flush_mb)
    rows = []
    for tokens in args.tokens:
        measured.append(copy_bandwidth(args.copy_mb, args.repeat))
        q, k_pages, v_pages, table, lengths = paged_cache(tokens, args.heads, args.group,
                                                          args.dim, args.page, gen)
        per_head = tokens // args.heads
        dense_k = torch.randn(1, args.heads, per_head, args.dim, generator=gen)
        dense_v = torch.randn(1, args.heads, per_head, args.dim, generator=gen)
        expected = paged_attention(q, k_pages, v_pages, table, lengths, impl="torch")
        compiled = paged_attention(q, k_pages, v_pages, table, lengths, impl="compiled")
        torch.testing.assert_close(compiled, expected)
        work = table.shape[-1] * args.page * q.numel()  # as compiled_paged_attention_torch counts
        parallel = work >= kernels.PARALLEL_WORK and torch.get_num_threads() > 1
        torch.testing.assert_close(paged_attention(q, k_pages, v_pages, table, lengths, impl="cpp"),
                                   expected)
        cpp_threads = (torch.get_num_threads()
                       if int(lengths.sum()) * args.group * args.dim >= cpp.PARALLEL_WORK else 1)
        ordered = paged_cache(tokens, args.heads, args.group, args.dim, args.page, gen, "in order")
        interleaved = paged_cache(tokens, args.heads, args.group, args.dim, args.page, gen, "interleaved")
        methods = {
            f"paged, C++ ({cpp_threads} thread{'s' * (cpp_threads > 1)})": lambda: paged_attention(
                q, k_pages, v_pages, table, lengths, impl="cpp"),
            "  same, pages in head order": lambda: paged_attention(*ordered, impl="cpp"),
            "  same, pages interleaved": lambda: paged_attention(*interleaved, impl="cpp"),
            f"paged, compiled ({'parallel' if parallel else '1 thread'})": lambda: paged_attention(
                q, k_pages, v_pages, table, lengths, impl="compiled"),
            "paged, eager": lambda: paged_attention(q, k_pages, v_pages, table, lengths,
                                                    impl="torch"),
            "dense SDPA (equal size)": lambda: F.scaled_dot_product_attention(
                q[:, :, None], dense_k, dense_v, enable_gqa=True),
        }
        nbytes = 2 * tokens * args.dim * 4
        rows += [(tokens, name, timed(fn, args.repeat), timed(fn, args.repeat, flush), nbytes)
                 for name, fn in methods.items()]
    measured.append(copy_bandwidth(args.copy_mb, args.repeat))
    bandwidth = max(measured)
    print(f"threads {torch.get_num_threads()}, H={args.heads} KV heads, G={args.group}, "
          f"d={args.dim}, page {args.page}, fp32; copy bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(read + write of {args.copy_mb} MB, the highest of "
          f"{', '.join(f'{b / 1e9:.1f}' for b in measured)})")
    print(f"warm: the same call repeated (K and V partly in the caches); cold: {args.flush_mb} MB "
          f"written before each call (K and V from memory, as in a decode step)")
    print(f"{'tokens':>7} {'method':<28} {'K+V MB':>7} {'warm ms':>8} {'cold ms':>8} {'cold GB/s':>9} "
          f"{'× bound warm':>12} {'× bound cold':>12}")
    for tokens, name, warm, cold, nbytes in rows:
        bound = nbytes / bandwidth
        print(f"{tokens:>7} {name:<28} {nbytes / 1e6:>7.1f} {warm * 1e3:>8.3f} {cold * 1e3:>8.3f} "
              f"{nbytes / cold / 1e9:>9.1f} {warm / bound:>12.2f} {cold / bound:>12.2f}")


if __name__ == "__main__":
    main()
