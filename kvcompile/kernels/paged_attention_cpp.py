"""Paged decode attention on the CPU: a hand-written flash-decoding kernel in C++.

Same contract as `kvcompile.kernels.paged_attention` (layout in its docstring): one
query per head against that head's pages, per-entry bias, per-head lengths, the result
equal to `kvcompile.reference.decode_attention` on the gathered cache.

Why C++ and not only the torch lowering: Inductor compiles the torch lowering into
correct loops, but it recomputes the page index (an indirect load, a bounds check) for
every vector it loads and walks V once per 16 lanes of d per query head, so it stays at
2-5x the bandwidth bound (benchmarks/HISTORY.md). This kernel does what the Triton one
does on a GPU: each work item is one (sequence, KV head, run of pages); it looks a page
up once, computes the G query heads' logits of that page's S entries, takes one
vectorised exp per query head and page (online softmax, Milakov & Gimelshein 2018), and
accumulates P·V with G·D/lanes accumulators held in registers. With AVX-512 and 16-entry
pages (the default), a page's 16 dot-product vectors are summed into one vector of logits
by a transpose-and-add tree; other widths take one horizontal sum and a scalar exp per
entry. Every retained K/V byte
is read once. Work items run on OpenMP threads (flash-decoding's split over pages,
Dao et al. 2023), and a second loop combines the partials of each head.

It is compiled by Inductor's own C++ toolchain (`CppPythonBindingsCodeCache`: the
compiler, flags, vector ISA and OpenMP runtime of the kernels Inductor generates, and its
on-disk cache), once per (G, D): compile-time constants, so every loop over d unrolls. The C++
is paged_attention.cpp beside this module (package data), read with importlib.resources; `source`
prepends the #defines of G, D, the pages' kind and the prefetch distance. It is one kernel body for
fp32 pages and for pages of int8 / int4 codes (kvcompile.kernels.paged_attention_quant): one entry
(`launch` here is the one call of both), split into work items, online softmax, logit tree and
combination of partials (with the log-sum-exp where asked, for fp32 pages too); a work item's per-page
loops take the register blocking of their load (fp32: the queries and accumulators in registers, each
logit broadcast; codes: blocked loops around the dequantizing load). fp32 queries only; other dtypes use the torch lowering.
"""
from __future__ import annotations

import functools
from importlib import resources

import torch
from torch import Tensor

# the kernel's C signature (paged_attention.cpp's `kernel`): q, keys, key scales, key zeros, values, value
# scales, value zeros (fp32 pages: keys and values as the "codes", the scales unused), block table, lengths,
# bias, workspace, out, lse, then the sizes and switches
_ARGTYPES = ("const float*", "const uint8_t*", "const float*", "const float*", "const uint8_t*",
             "const float*", "const float*", "const int64_t*", "const int64_t*", "const float*", "float*",
             "float*", "float*", "const int64_t", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const float", "const int64_t", "const int64_t", "const int64_t", "int64_t",
             "const int64_t")

# Below this many multiply-adds a call stays on one thread (see paged_attention.PARALLEL_WORK:
# an OpenMP fork/join costs more than the work, and much more on a shared machine).
PARALLEL_WORK = 1 << 20
# Work items per thread when parallel: ragged heads make equal splits unequal, so several
# smaller items per thread, handed out as threads free up (OpenMP dynamic schedule).
ITEMS_PER_THREAD = 8
PREFETCH_AHEAD = 2  # pages: how far ahead the kernel starts loading a run's next page


def _constants(g: int, d: int, group_k: int | None, group_v: int | None) -> dict[str, int]:
    """The build's constants: fp32 pages where group_k is None, else codes with keys in groups of group_k
    channels (0: per channel, over a page) and values in groups of group_v."""
    if group_k is None:
        return dict(G=g, D=d, FLOAT=1, GK=d, GV=d, AHEAD=PREFETCH_AHEAD)
    return dict(G=g, D=d, FLOAT=0, GK=group_k, GV=group_v, AHEAD=PREFETCH_AHEAD)


def source(g: int, d: int, group_k: int | None = None, group_v: int | None = None) -> str:
    """The kernel's C++ for G query heads per KV head and head dim d, over fp32 pages (group_k None) or codes
    (`_constants`): paged_attention.cpp (package data) after the #defines that make these constants."""
    return cpp_source("paged_attention.cpp", **_constants(g, d, group_k, group_v))


def cpp_source(name: str, **constants: int) -> str:
    """A C++ source shipped beside this module (package data), after `#define KVCOMPILE_<K> v`
    for each constant."""
    defines = "".join(f"#define KVCOMPILE_{key} {value}\n" for key, value in constants.items())
    return defines + resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


@functools.cache
def load_cpp(argtypes: tuple[str, ...], name: str, **constants: int):
    """The C++ function of `name` built once per constants with Inductor's C++ toolchain (its
    disk cache keeps the build across processes); argtypes: its C signature."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(list(argtypes), cpp_source(name, **constants))


@functools.cache
def _kernel(g: int, d: int, group_k: int | None = None, group_v: int | None = None):
    """The kernel built once per (G, d, pages' kind and groups): int8 and int4 codes in one build."""
    return load_cpp(_ARGTYPES, "paged_attention.cpp", **_constants(g, d, group_k, group_v))


@functools.cache
def _toolchain() -> bool:
    """Inductor's C++ code cache is importable (an internal API: torch is pinned to 2.13.0,
    and another version without it falls back to the torch lowering) and a C++ compiler
    is on the PATH."""
    import shutil

    try:
        from torch._inductor import config
        from torch._inductor.codecache import CppPythonBindingsCodeCache  # noqa: F401
    except ImportError:
        return False
    cxx = config.cpp.cxx[-1] if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
    return shutil.which(cxx or "g++") is not None


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """The kernel runs here: fp32 on the CPU, head dim a multiple of 16 (the widest vector),
    and a toolchain."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return kind == "cpu" and dtype == torch.float32 and head_dim % 16 == 0 and _toolchain()


def supported(q: Tensor, k_pages: Tensor) -> bool:
    """`supports` for these queries and pages (both of one dtype)."""
    return q.dtype == k_pages.dtype and supports(q.device, q.dtype, q.shape[-1])


def _dense(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """x as a contiguous tensor of `dtype` (no copy when it already is one)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def paged_attention_cpp(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                        lengths: Tensor, bias_pages: Tensor | None = None,
                        scale: float | None = None, *, threads: int | None = None,
                        chunk: int | None = None, parallel_work: int | None = None,
                        return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Decode attention of q (B, Hq, d) over each head's pages -> (B, Hq, d), fp32 on CPU (with return_lse,
    also the log-sum-exp of each query head's logits (B, Hq), −inf for an empty head).

    threads: OpenMP threads (default: torch's when the call has at least `parallel_work`
    multiply-adds, default PARALLEL_WORK, else 1; the C++ side decides); chunk: entries per work item (default:
    whole pages, about ITEMS_PER_THREAD runs per thread over all heads, one run per head
    on one thread)."""
    if not supported(q, k_pages):
        raise ValueError("paged_attention_cpp: fp32 CPU tensors with head dim a multiple of 16")
    k, v = _dense(k_pages), _dense(v_pages)
    b, hq, d = q.shape
    return launch(_kernel(hq // block_table.shape[1], d), q, (k, k, k, v, v, v), 32, block_table, lengths, bias_pages,
                  scale, threads=threads, chunk=chunk, parallel_work=parallel_work, return_lse=return_lse)


def launch(kernel, q: Tensor, pages: tuple[Tensor, ...], bits: int, block_table: Tensor, lengths: Tensor,
           bias_pages: Tensor | None, scale: float | None, *, return_lse: bool = False, threads: int | None = None, chunk: int | None = None,
           parallel_work: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """The one call of the kernel (`kernel`: its build for these pages, `_kernel`), over fp32 pages (bits 32;
    pages (k, ·, ·, v, ·, ·), the scales unread) or codes (bits 8 or 4; pages (k_codes, k_scale, k_zero, v_codes,
    v_scale, v_zero)), every tensor contiguous in its dtype (`_dense` of the block table and lengths here).
    -> out (B, Hq, d) (and the log-sum-exp (B, Hq) with return_lse); threads, chunk, parallel_work: `paged_attention_cpp`'s."""
    b, hq, d = q.shape
    h, m = block_table.shape[1:]
    s = pages[0].shape[1]
    g = hq // h
    scale = d ** -0.5 if scale is None else scale
    max_threads = torch.get_num_threads() if threads is None else threads
    work = (PARALLEL_WORK if parallel_work is None else parallel_work) if threads is None else 0  # given: that many
    runs = max(1, -(-ITEMS_PER_THREAD * max_threads // (b * h))) if chunk is None else \
        max(1, -(-m * s // chunk))  # bounds the runs per head the C++ side can choose
    workspace = torch.empty(b * h * runs * g * (d + 2))
    out = torch.empty(b, hq, d)
    lse = torch.empty(b, hq) if return_lse else out
    kernel(_dense(q), *pages, _dense(block_table, torch.long), _dense(lengths, torch.long),
           _dense(bias_pages) if bias_pages is not None else out, workspace, out, lse, b * h, m, s,
           int(bias_pages is not None), int(return_lse), float(scale), max_threads, ITEMS_PER_THREAD, work, chunk or 0,
           bits)
    return (out, lse) if return_lse else out
