"""Decode attention over the paged cache on the CPU, against the memory bandwidth.

For each retained size T (tokens per layer, split raggedly over the KV heads), one decode
step's attention over the pages (scattered at random over the pool; the C++ kernel also with
each head's pages in order, the layout of a freshly compressed prompt): the C++ kernel, the
torch lowering compiled by Inductor,
the same run eagerly, and F.scaled_dot_product_attention on a dense cache of the same size. Prints
time per call, the K+V bytes retained, bytes ÷ time, and the ratio of the time to the
bound bytes ÷ copy bandwidth, the copy bandwidth measured in the same run (DESIGN.md §5).
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


def timed(fn, repeat: int) -> float:
    """Best seconds per call over `repeat` calls, after two warm-up calls (the minimum
    is the least disturbed by other processes on a shared machine)."""
    fn(), fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(megabytes: int, repeat: int) -> float:
    """Bytes moved (read + write) per second by a torch copy of a large fp32 tensor."""
    src = torch.randn(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), repeat)


def paged_cache(tokens: int, heads: int, group: int, dim: int, page: int, gen: torch.Generator,
                shuffle: bool = True):
    """A cache of `tokens` entries split raggedly over the heads, pages in random order (the
    worst case: every page boundary a jump), or each head's pages in order (as build_store
    lays out a compressed prompt) when not `shuffle`."""
    share = torch.rand(heads, generator=gen) + 0.5
    lengths = (share / share.sum() * tokens).long()
    lengths[0] += tokens - lengths.sum()
    pages = (lengths + page - 1) // page
    pool, width = int(pages.sum()), int(pages.max())
    k_pages = torch.randn(pool, page, dim, generator=gen)
    v_pages = torch.randn(pool, page, dim, generator=gen)
    order = torch.randperm(pool, generator=gen) if shuffle else torch.arange(pool)
    table = torch.zeros(1, heads, width, dtype=torch.int32)
    start = 0
    for h in range(heads):
        table[0, h, : pages[h]] = order[start: start + pages[h]].int()
        start += int(pages[h])
    q = torch.randn(1, heads * group, dim, generator=gen)
    return q, k_pages, v_pages, table, lengths.view(1, heads).int()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--heads", type=int, default=3, help="KV heads")
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--copy-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    before = copy_bandwidth(args.copy_mb, args.repeat)
    rows = []
    for tokens in args.tokens:
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
        ordered = paged_cache(tokens, args.heads, args.group, args.dim, args.page, gen, shuffle=False)
        methods = {
            f"paged, C++ ({cpp_threads} thread{'s' * (cpp_threads > 1)})": lambda: paged_attention(
                q, k_pages, v_pages, table, lengths, impl="cpp"),
            "  same, pages in head order": lambda: paged_attention(*ordered, impl="cpp"),
            f"paged, compiled ({'parallel' if parallel else '1 thread'})": lambda: paged_attention(
                q, k_pages, v_pages, table, lengths, impl="compiled"),
            "paged, eager": lambda: paged_attention(q, k_pages, v_pages, table, lengths,
                                                    impl="torch"),
            "dense SDPA (equal size)": lambda: F.scaled_dot_product_attention(
                q[:, :, None], dense_k, dense_v, enable_gqa=True),
        }
        nbytes = 2 * tokens * args.dim * 4
        rows += [(tokens, name, timed(fn, args.repeat), nbytes) for name, fn in methods.items()]
    # The bound uses the higher of two copy measurements, at the start and at the end: the
    # measured bandwidth moves between runs on a shared machine, and the higher one is the
    # stricter bound.
    bandwidth = max(before, copy_bandwidth(args.copy_mb, args.repeat))
    print(f"threads {torch.get_num_threads()}, H={args.heads} KV heads, G={args.group}, "
          f"d={args.dim}, page {args.page}, fp32; copy bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(read + write of {args.copy_mb} MB; {before / 1e9:.1f} at the start)")
    print(f"{'tokens':>7} {'method':<28} {'ms/call':>8} {'K+V MB':>7} {'GB/s':>6} {'× bound':>8}")
    for tokens, name, seconds, nbytes in rows:
        print(f"{tokens:>7} {name:<28} {seconds * 1e3:>8.3f} {nbytes / 1e6:>7.1f} "
              f"{nbytes / seconds / 1e9:>6.1f} {seconds / (nbytes / bandwidth):>8.2f}")


if __name__ == "__main__":
    main()
