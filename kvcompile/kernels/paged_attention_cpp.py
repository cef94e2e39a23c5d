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
on-disk cache), once per (G, D): compile-time constants, so the G·D/lanes accumulators
stay in registers. The C++ is paged_attention.cpp beside this module (package data), read
with importlib.resources; `source` prepends the #defines of G, D and the prefetch distance.
fp32 only; other dtypes use the torch lowering.
"""
from __future__ import annotations

import functools
from importlib import resources

import torch
from torch import Tensor

_ARGTYPES = ["const float*", "const float*", "const float*", "const int64_t*", "const int64_t*",
             "const float*", "float*", "float*", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const float", "const int64_t", "const int64_t", "const int64_t",
             "int64_t"]

# Below this many multiply-adds a call stays on one thread (see paged_attention.PARALLEL_WORK:
# an OpenMP fork/join costs more than the work, and much more on a shared machine).
PARALLEL_WORK = 1 << 20
# Work items per thread when parallel: ragged heads make equal splits unequal, so several
# smaller items per thread, handed out as threads free up (OpenMP dynamic schedule).
ITEMS_PER_THREAD = 8
PREFETCH_AHEAD = 2  # pages: how far ahead the kernel starts loading a run's next page


def source(g: int, d: int) -> str:
    """The kernel's C++ for G query heads per KV head and head dim d: paged_attention.cpp
    (package data) after the #defines that make G, D and the prefetch distance constants."""
    return cpp_source("paged_attention.cpp", G=g, D=d, AHEAD=PREFETCH_AHEAD)


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


def _kernel(g: int, d: int):
    return load_cpp(tuple(_ARGTYPES), "paged_attention.cpp", G=g, D=d, AHEAD=PREFETCH_AHEAD)


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
    return torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % 16 == 0 and _toolchain()


def supported(q: Tensor, k_pages: Tensor) -> bool:
    """`supports` for these queries and pages (both of one dtype)."""
    return q.dtype == k_pages.dtype and supports(q.device, q.dtype, q.shape[-1])


def _dense(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """x as a contiguous tensor of `dtype` (no copy when it already is one)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def paged_attention_cpp(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                        lengths: Tensor, bias_pages: Tensor | None = None,
                        scale: float | None = None, *, threads: int | None = None,
                        chunk: int | None = None, parallel_work: int | None = None) -> Tensor:
    """Decode attention of q (B, Hq, d) over each head's pages -> (B, Hq, d), fp32 on CPU.

    threads: OpenMP threads (default: torch's when the call has at least `parallel_work`
    multiply-adds, default PARALLEL_WORK, else 1; the C++ side decides); chunk: entries per work item (default:
    whole pages, about ITEMS_PER_THREAD runs per thread over all heads, one run per head
    on one thread)."""
    if not supported(q, k_pages):
        raise ValueError("paged_attention_cpp: fp32 CPU tensors with head dim a multiple of 16")
    b, hq, d = q.shape
    h, m = block_table.shape[1:]
    s = k_pages.shape[1]
    g = hq // h
    scale = d ** -0.5 if scale is None else scale
    max_threads = torch.get_num_threads() if threads is None else threads
    work = (PARALLEL_WORK if parallel_work is None else parallel_work) if threads is None else 0  # given: that many
    runs = max(1, -(-ITEMS_PER_THREAD * max_threads // (b * h))) if chunk is None else \
        max(1, -(-m * s // chunk))  # bounds the runs per head the C++ side can choose
    workspace = torch.empty(b * h * runs * g * (d + 2))
    out = torch.empty(b, hq, d)
    _kernel(g, d)(_dense(q), _dense(k_pages), _dense(v_pages), _dense(block_table, torch.long),
                  _dense(lengths, torch.long), _dense(bias_pages) if bias_pages is not None else k_pages,
                  workspace, out, b * h, m, s, int(bias_pages is not None), float(scale), max_threads,
                  ITEMS_PER_THREAD, work, chunk or 0)
    return out
