"""Decode attention over a paged, head-granular KV cache (flash-decoding).

Layout (docs/INTERNALS.md "Paged cache layout"): `k_pages`, `v_pages` (P, S, d) hold
S-token pages from a pool; `block_table` (B, H, M) int32 lists the pages of each
(sequence, KV head) in order; entry t of a head lives at slot t % S of page
block_table[b, h, t // S] and is valid when t < lengths[b, h]. `bias_pages` (P, S) is
the per-entry logit bias α·log w of ZSMerge Eq. 8 (None = no bias). Query head
h·G + g attends over KV head h (GQA, G = Hq / H). Entries past a head's length, and
block-table entries past its last page, are never read, so they may hold anything.

The result equals `kvcompile.reference.decode_attention(q[:, :, None], K, V, bias, lengths)` on
the gathered cache; a head with no entry gives zeros.

Three implementations and a dispatcher:
- `paged_attention_triton`: flash-decoding (Dao et al., 2023, "Flash-Decoding for
  long-context inference"). Each program takes one (sequence, KV head) and one chunk of
  its entries, loads the G query heads of the group once, streams K/V of the chunk
  through an online softmax (Milakov & Gimelshein, 2018) and writes partials
  (running max m, denominator l, unnormalized output); a second kernel reduces the
  chunks of a head. Each retained K/V byte is read once.
- `paged_attention_torch`: the lowering used on CPU, written so that Inductor fuses the
  block-table indexing into its reductions (see its docstring); run eagerly it takes a
  plain gather + matmul path.
- `paged_attention_cpp` (kvcompile/kernels/paged_attention_cpp.py): the same flash-decoding
  kernel hand-written in C++ for the CPU, compiled by Inductor's C++ toolchain; the
  default on a CPU for fp32 (it reads the cache at close to the memory bandwidth, which
  the Inductor-compiled torch lowering does not: benchmarks/HISTORY.md).

Backends (what a Plan holds, `Plan.decode_attention`): one class per implementation with the
same call, `backend(q, k_pages, v_pages, block_table, lengths, bias_pages, scale)`:
`TritonPagedAttention`, `CppPagedAttention`, `TorchPagedAttention` (eager) and
`CompiledPagedAttention` (the torch lowering through Inductor); `backend(name)` makes one from
its impl name (`kvcompile.kernels.choice.resolve` decides the name). The threshold that
decides threading is a field of the backend (`parallel_work`), shown by `describe()`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels import paged_attention_cpp as paged_attention_cpp_module
from kvcompile.kernels.choice import resolve
from kvcompile.kernels.paged_attention_cpp import paged_attention_cpp
from kvcompile.kernels.backend import KernelBackend

try:  # Triton is optional: the torch lowering covers machines without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                    lengths: Tensor, bias_pages: Tensor | None = None,
                    scale: float | None = None, *, impl: str | None = None) -> Tensor:
    """Decode attention of q (B, Hq, d) over each head's pages -> (B, Hq, d).

    impl: "triton" | "cpp" (the C++ CPU kernel) | "torch" (eager) | "compiled" (the torch
    lowering through Inductor) | None = Triton on CUDA tensors, else the C++ kernel where
    it applies (fp32, head dim a multiple of 16), else the torch lowering
    (`kvcompile.kernels.choice.resolve`, which raises ValueError for a name that cannot
    run on these tensors). Called from
    inside an opaque custom op, the torch lowering runs eagerly: ask for "compiled" to get
    the fused kernel. (The runtime calls the backend its plan holds, `Plan.decode_attention`.)
    """
    _check(q, k_pages, v_pages, block_table, lengths, bias_pages)
    name = resolve("paged_attention", impl, q.device, q.dtype if q.dtype == k_pages.dtype else None,
                   head_dim=q.shape[-1])
    return backend(name).run(q, k_pages, v_pages, block_table, lengths, bias_pages, scale)


@dataclass(frozen=True)
class PagedAttention(KernelBackend):
    """A decode attention backend: `backend(q, k_pages, v_pages, block_table, lengths, bias_pages,
    scale)` -> (B, Hq, d), the module docstring's contract (shapes checked on every call)."""

    name: ClassVar[str]

    def __call__(self, q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, lengths: Tensor,
                 bias_pages: Tensor | None = None, scale: float | None = None) -> Tensor:
        _check(q, k_pages, v_pages, block_table, lengths, bias_pages)
        return self.run(q, k_pages, v_pages, block_table, lengths, bias_pages, scale)

    def run(self, q, k_pages, v_pages, block_table, lengths, bias_pages, scale) -> Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class TritonPagedAttention(PagedAttention):
    """Flash-decoding in Triton (`paged_attention_triton`): CUDA tensors, or any under TRITON_INTERPRET=1."""

    name: ClassVar[str] = "triton"

    def run(self, q, k_pages, v_pages, block_table, lengths, bias_pages, scale):
        return paged_attention_triton(q, k_pages, v_pages, block_table, lengths, bias_pages, scale)


@dataclass(frozen=True)
class CppPagedAttention(PagedAttention):
    """The C++ CPU kernel (`paged_attention_cpp`): fp32, head dim a multiple of 16. A call of fewer than
    `parallel_work` multiply-adds runs on one thread, a larger one on torch's threads."""

    name: ClassVar[str] = "cpp"
    parallel_work: int = paged_attention_cpp_module.PARALLEL_WORK

    def run(self, q, k_pages, v_pages, block_table, lengths, bias_pages, scale):
        return paged_attention_cpp(q, k_pages, v_pages, block_table, lengths, bias_pages, scale,
                                   parallel_work=self.parallel_work)

    def build(self, group: int, head_dim: int) -> None:
        paged_attention_cpp_module._kernel(group, head_dim)

    def describe(self) -> str:
        return f"cpp (one thread below {self.parallel_work} multiply-adds a call, else torch's threads)"


@dataclass(frozen=True)
class TorchPagedAttention(PagedAttention):
    """The torch lowering run eagerly (gather + matmul)."""

    name: ClassVar[str] = "torch"

    def run(self, q, k_pages, v_pages, block_table, lengths, bias_pages, scale):
        return paged_attention_torch(q, k_pages, v_pages, block_table, lengths, bias_pages, scale)


@dataclass(frozen=True, eq=False)
class SoftcapPagedAttention(PagedAttention):
    """The torch lowering run eagerly with the model's logit soft-cap (Gemma 2: cap·tanh(s/cap) before the
    softmax, s the scaled logit, before any merge bias) and/or a layer's learned sinks (gpt-oss: one logit per
    query head in the softmax's denominator: the output scaled by sigmoid(lse − sink), lse the log-sum-exp of
    the head's logits); the plan's decode attention of such a model (`with_sinks` gives a layer's). Equal to
    `reference.decode_attention(..., softcap=, sinks=)`: the merge bias pages are added after the cap.
    `run(..., return_lse=True)`: the capped attention and its log-sum-exp, without the sinks (a caller that
    attends over other entries too adds them once over all)."""

    name: ClassVar[str] = "torch"
    softcap: float = 0.0
    sinks: Tensor | None = None  # (Hq,) one layer's sinks, else None

    def with_sinks(self, sinks: Tensor | None) -> "SoftcapPagedAttention":
        return SoftcapPagedAttention(self.softcap, sinks)

    def run(self, q, k_pages, v_pages, block_table, lengths, bias_pages, scale, return_lse=False):
        if self.sinks is None and not return_lse:
            return _gathered(q, k_pages, v_pages, block_table, lengths, bias_pages, scale, softcap=self.softcap)
        out, lse = _gathered(q, k_pages, v_pages, block_table, lengths, bias_pages, scale, return_lse=True,
                             softcap=self.softcap)
        return (out, lse) if return_lse else with_sinks(out, lse, self.sinks)

    def describe(self) -> str:
        return f"torch (eager{f', logits soft-capped at {self.softcap:g}' if self.softcap else ''}" \
               f"{', learned sinks' if self.sinks is not None else ''})"


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """The attention `out` (B, Hq, d) over some entries, whose logits' log-sum-exp is `lse` (B, Hq), with learned
    sinks (Hq,) joining its softmax's denominator: out · e^lse / (e^lse + e^sink) = out · sigmoid(lse − sink) (an
    empty head, lse −inf, stays zeros)."""
    return (out.float() * torch.sigmoid(lse - sinks.float())[..., None]).to(out.dtype)


@dataclass(frozen=True)
class CompiledPagedAttention(PagedAttention):
    """The torch lowering through Inductor (`compiled_paged_attention_torch`): its one-thread graph below
    `parallel_work` multiply-adds a call, its parallel one above."""

    name: ClassVar[str] = "compiled"
    parallel_work: int = 1 << 22  # PARALLEL_WORK below

    def run(self, q, k_pages, v_pages, block_table, lengths, bias_pages, scale):
        return compiled_paged_attention_torch(q, k_pages, v_pages, block_table, lengths, bias_pages, scale,
                                              parallel_work=self.parallel_work)

    def describe(self) -> str:
        return f"compiled (one-thread graph below {self.parallel_work} multiply-adds a call, else parallel loops)"


def backend(name: str) -> PagedAttention:
    """The backend of impl `name` (a name `choice.resolve("paged_attention", ...)` returned), with this
    module's thresholds as they are now."""
    if name == "cpp":
        return CppPagedAttention(paged_attention_cpp_module.PARALLEL_WORK)
    if name == "compiled":
        return CompiledPagedAttention(PARALLEL_WORK)
    return {"triton": TritonPagedAttention, "torch": TorchPagedAttention}[name]()


def _check(q, k_pages, v_pages, block_table, lengths, bias_pages) -> None:
    b, hq, d = q.shape
    bt, h, _ = block_table.shape
    if bt != b or lengths.shape != (b, h) or hq % h:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, block_table "
                         f"{tuple(block_table.shape)}, lengths {tuple(lengths.shape)} do not match")
    if k_pages.shape != v_pages.shape or k_pages.shape[-1] != d:
        raise ValueError(f"paged_attention: k_pages {tuple(k_pages.shape)}, v_pages "
                         f"{tuple(v_pages.shape)} must be (P, S, {d})")
    if bias_pages is not None and bias_pages.shape != k_pages.shape[:2]:
        raise ValueError(f"paged_attention: bias_pages {tuple(bias_pages.shape)} must be "
                         f"{tuple(k_pages.shape[:2])}")


# --------------------------------------------------------------------------- torch

def paged_attention_torch(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                          lengths: Tensor, bias_pages: Tensor | None = None,
                          scale: float | None = None, *, chunk: int = 256) -> Tensor:
    """The torch lowering: eager = gather + matmul; under torch.compile = fused reductions.

    Compiled (`compiled_paged_attention_torch`), the logits are written as a broadcast
    product summed over d and the output as a probability-weighted sum over entries,
    not as matmuls: Inductor then inlines the page gather `k_pages[table]` (an indirect
    load) into its two reduction loops, so K and V are read once from the pages and no
    gathered copy is written, whereas a matmul would force the gathered operand to be
    materialized for the BLAS call. Checked by reading the generated C++ (one fused
    kernel; its only buffers are the (B, H, C, G, Pc, S) logits and the per-chunk partials)
    and timed by benchmarks/bench_decode.py. The gather is page-granular (one block-table
    load per S·d contiguous elements) and the entries are split into chunks of `chunk`
    tokens whose softmax partials are combined at the end (flash-decoding): a chunk's
    K/V stays in L2 while the G query heads of the group use it, and the chunks give
    Inductor an outer loop to run on all cores even when B·H is small. A block table
    shorter than one chunk is one chunk of its own length (not padded to `chunk`). The
    one-thread variant uses chunks of 4096 entries: a float sum over more than 4096
    terms makes Inductor sum in a cascade for accuracy, twice as slow here.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if torch.compiler.is_compiling():
        return _fused(q, k_pages, v_pages, block_table, lengths, bias_pages, scale, chunk)
    return _gathered(q, k_pages, v_pages, block_table, lengths, bias_pages, scale)


def _live_pages(block_table: Tensor, lengths: Tensor, page_size: int) -> Tensor:
    """The block table with every page past a head's last entry replaced by page 0, so
    block-table entries past a head's length are never used as indices."""
    m = block_table.shape[-1]
    live = torch.arange(m, device=block_table.device) < (lengths[..., None] + page_size - 1) // page_size
    return torch.where(live, block_table, 0).long()


def _valid(lengths: Tensor, tokens: int) -> Tensor:
    """(B, H, tokens) bool: entry t of a head is valid when t < its length."""
    return torch.arange(tokens, device=lengths.device) < lengths[..., None]


def _gathered(q, k_pages, v_pages, block_table, lengths, bias_pages, scale, return_lse: bool = False,
              softcap: float | None = None):
    """Eager path: gather each head's pages, then grouped attention by matmul (return_lse: also the
    log-sum-exp of each query head's logits (B, Hq), −inf for an empty head, from the same logits;
    softcap: the logits soft-capped, cap·tanh(s/cap), before the bias; scale None: d^-1/2)."""
    b, hq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    h, m = block_table.shape[1:]
    s = k_pages.shape[1]
    table = _live_pages(block_table, lengths, s)
    valid = _valid(lengths, m * s)  # (B, H, T)
    keys = k_pages[table].view(b, h, m * s, d).float()
    values = v_pages[table].view(b, h, m * s, d).float().masked_fill(~valid[..., None], 0.0)
    qg = q.float().view(b, h, hq // h, d)
    logits = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # (B, H, G, T)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if bias_pages is not None:
        logits = logits + bias_pages[table].view(b, h, 1, m * s).float()
    logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # an empty head gives zeros
    out = torch.matmul(weights, values).view(b, hq, d).to(q.dtype)
    return (out, torch.logsumexp(logits, dim=-1).view(b, hq)) if return_lse else out


def _fused(q, k_pages, v_pages, block_table, lengths, bias_pages, scale, chunk: int = 256):
    """Compiled path: per-chunk online-softmax partials, every page gather inlined
    (chunk: entries per chunk; a shorter table is one chunk of its own length)."""
    b, hq, d = q.shape
    h, m = block_table.shape[1:]
    s = k_pages.shape[1]
    g = hq // h
    per_chunk = max(1, chunk // s)  # pages per chunk
    if m <= per_chunk:  # under compile: a guard, and one graph for each side of it
        per_chunk = m
    chunks = -(-m // per_chunk)
    table = torch.nn.functional.pad(block_table, (0, chunks * per_chunk - m))
    table = _live_pages(table, lengths, s).view(b, h, chunks, per_chunk)
    valid = _valid(lengths, chunks * per_chunk * s).view(b, h, chunks, 1, per_chunk, s)
    keys = k_pages[table][:, :, :, None].float()  # (B, H, C, 1, Pc, S, d): never stored
    qg = q.float().view(b, h, 1, g, 1, 1, d)
    logits = (qg * keys).sum(-1) * scale  # (B, H, C, G, Pc, S)
    if bias_pages is not None:
        logits = logits + bias_pages[table][:, :, :, None].float()
    logits = logits.masked_fill(~valid, float("-inf"))
    m_c = logits.amax((-1, -2))  # (B, H, C, G), -inf for an empty chunk
    p = torch.exp(logits - _finite(m_c)[..., None, None])  # 0 at invalid entries
    l_c = p.sum((-1, -2))
    values = torch.where(valid[..., None], v_pages[table][:, :, :, None].float(), 0.0)
    acc_c = (p[..., None] * values).sum((-2, -3))  # (B, H, C, G, d)
    w = torch.exp(m_c - _finite(m_c.amax(2, keepdim=True)))  # chunk weights, 0 when empty
    den = (w * l_c).sum(2)  # (B, H, G), 0 for an empty head
    out = (w[..., None] * acc_c).sum(2) / torch.where(den > 0, den, 1.0)[..., None]
    return out.reshape(b, hq, d).to(q.dtype)


def _finite(m: Tensor) -> Tensor:
    """A running max with -inf (nothing seen) replaced by 0, so exp(x - m) stays defined."""
    return torch.where(m == float("-inf"), 0.0, m)


# Inductor opens an OpenMP parallel region once a loop has cpp.min_chunk_size (512)
# elements per thread, and decides it at compile time from the first call's sizes. A
# decode step over a compressed cache (4k prompt, 128 per head: 10^5 multiply-adds) is
# far below anything worth splitting, and while another process holds a core each
# region's join waits for a time slice (a 30 ms call instead of 50 us on the shared
# 2-core machine). So there are two compiled variants, chosen per call by the work, as
# ATen chooses by its grain size: one thread below PARALLEL_WORK multiply-adds
# (entries x query heads x d, about a millisecond on one core), Inductor's parallel
# loops above.
PARALLEL_WORK = 1 << 22
SERIAL = {"cpp.threads": 1}
SERIAL_CHUNK = 4096  # entries per chunk on one thread (see paged_attention_torch)


@functools.cache
def _compiled(parallel: bool):
    if parallel:
        return torch.compile(paged_attention_torch)
    return torch.compile(functools.partial(paged_attention_torch, chunk=SERIAL_CHUNK), options=SERIAL)


def compiled_paged_attention_torch(q: Tensor, k_pages: Tensor, v_pages: Tensor,
                                   block_table: Tensor, lengths: Tensor,
                                   bias_pages: Tensor | None = None,
                                   scale: float | None = None, *, parallel_work: int | None = None) -> Tensor:
    """The torch lowering compiled by Inductor (its one-thread graph below `parallel_work`
    multiply-adds, default PARALLEL_WORK, its parallel one above). Only the sizes that grow with the cache
    (pages per head M, pool size P) are dynamic: one graph serves every cache length,
    while d, S, G stay static so the inner loops have constant trip counts (fully
    dynamic shapes measured about 3x slower here). A second graph is compiled once a
    head outgrows one chunk (4096 entries on one thread).

    The call runs without grad and below autograd and ADInplaceOrView, whatever the
    caller's state, so one graph serves every caller: dynamo guards on grad mode and on
    the inputs' dispatch keys seen through the thread's excluded keys, and the first run
    of an AOTAutograd graph (its custom-op aliasing check, a dispatch mode) calls the
    opaque op with those keys excluded while later runs do not, which compiled this
    kernel twice. It computes no gradient (the op it serves has none)."""
    if block_table.shape[-1] == 1:  # dynamo specialises a size of 1: a second graph
        block_table = torch.nn.functional.pad(block_table, (0, 1))  # a page past every length
    torch._dynamo.maybe_mark_dynamic(block_table, 2)
    for pages in (k_pages, v_pages) + (() if bias_pages is None else (bias_pages,)):
        torch._dynamo.maybe_mark_dynamic(pages, 0)
    work = block_table.shape[-1] * k_pages.shape[1] * q.shape[0] * q.shape[1] * q.shape[2]
    parallel_work = PARALLEL_WORK if parallel_work is None else parallel_work
    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        return _compiled(work >= parallel_work)(q, k_pages, v_pages, block_table, lengths, bias_pages, scale)


# -------------------------------------------------------------------------- triton

# Entries per program of the Triton kernel (flash-decoding's split size; vLLM's v2 paged
# attention uses 512). A runtime argument, so the kernel never recompiles as the cache
# grows: a head of C entries is split into ceil(C / 256) programs, enough of them to fill
# the GPU's SMs even at batch 1 with 8 KV heads from 4k entries on, and each program's
# partials (G·(D + 2) floats) are under 2 % of the 128 KB of K/V it reads at D = 128 in bf16.
CHUNK_TOKENS = 256
BLOCK_N = 64  # entries per inner step: K and V tiles of 64 x 128 in bf16 are 16 KB each
MIN_BLOCK_N = 16  # the K dimension of p·V on tensor cores is at least 16 (Triton's min_dot_size)


def paged_attention_triton(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                           lengths: Tensor, bias_pages: Tensor | None = None,
                           scale: float | None = None, *, block_n: int = BLOCK_N,
                           chunk_tokens: int | None = None) -> Tensor:
    """Flash-decoding in Triton: grid (B·H, chunks) of partials, then a (B·H,) reduce.

    block_n: entries per inner step (at least MIN_BLOCK_N); chunk_tokens: entries per
    program (default CHUNK_TOKENS, rounded up to a multiple of block_n), a runtime
    argument: one compiled kernel serves every cache size. The G query heads of a KV
    head are the rows of two tl.dot products (q·Kᵀ, p·V), so the (G, block_n, d) product
    is never formed in registers. The block table and lengths are read as given (int32
    or int64, any strides): no conversion or copy per call; the partials are one buffer.
    """
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("paged_attention_triton: pages must be contiguous in d")
    strides = (k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1))
    return flash_decode_triton(q, (k_pages, k_pages, k_pages, v_pages, v_pages, v_pages), strides, block_table,
                               lengths, bias_pages, scale, bits=32, width=q.shape[-1], k_channel=False,
                               groups=(q.shape[-1], q.shape[-1]), block_n=block_n, chunk_tokens=chunk_tokens,
                               dot_fp32=q.dtype != k_pages.dtype or k_pages.dtype == torch.float32)


def flash_decode_triton(q: Tensor, pages: tuple[Tensor, ...], strides: tuple[int, int, int, int],
                        block_table: Tensor, lengths: Tensor, bias_pages: Tensor | None, scale: float | None, *,
                        bits: int, width: int, k_channel: bool, groups: tuple[int, int], block_n: int,
                        chunk_tokens: int | None, dot_fp32: bool, return_lse: bool = False):
    """The one launch of the Triton kernels for float pages (bits 32: pages (k, k, k, v, v, v), each read by
    `strides`, its page and entry strides of k and v) and for codes (bits 8 / 4: pages (k_codes, k_scale,
    k_zero, v_codes, v_scale, v_zero), contiguous, strides unused, `width` code bytes an entry, keys per
    channel or per token, groups (key group, value group) of channels): grid (B·H, chunks) of partials, then
    a (B·H,) reduce -> out (B, Hq, d) in q's dtype (and the log-sum-exp (B, Hq) with return_lse).
    dot_fp32: q·Kᵀ in fp32 (else in the cache's dtype, on tensor cores)."""
    if triton is None:
        raise RuntimeError("paged_attention_triton needs triton")
    b, hq, d = q.shape
    h, m = block_table.shape[1:]
    s = pages[0].shape[1]
    g = hq // h
    scale = d ** -0.5 if scale is None else scale
    chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    chunk_tokens = -(-chunk_tokens // block_n) * block_n
    block_n = max(MIN_BLOCK_N, triton.next_power_of_2(block_n))
    chunks = max(1, -(-(m * s) // chunk_tokens))
    q = q.contiguous()
    parts = b * h * chunks * g
    work = torch.empty(parts * (d + 2), device=q.device, dtype=torch.float32)  # one allocation
    acc_part, m_part, l_part = work[: parts * d], work[parts * d: parts * (d + 1)], work[parts * (d + 1):]
    has_bias = bias_pages is not None
    bias = bias_pages if has_bias else pages[1]  # a dummy pointer when there is no bias
    # q·Kᵀ's K dimension is d: tensor cores need at least 16 (loads are masked by D; the interpreter takes any)
    block_g, block_d = triton.next_power_of_2(g), max(16, triton.next_power_of_2(d))
    group_k, group_v = groups
    _partials_kernel[(b * h, chunks)](
        q, *pages, block_table, lengths, bias, m_part, l_part, acc_part, scale, h, chunk_tokens, chunks,
        block_table.stride(0), block_table.stride(1), block_table.stride(2),
        lengths.stride(0), lengths.stride(1), *strides,
        bias.stride(0) if has_bias else 0, bias.stride(1) if has_bias else 0,
        G=g, D=d, S=s, W=width, BITS=bits, K_CHANNEL=k_channel, NGK=1 if k_channel else d // group_k,
        GROUP_K=group_k, NGV=d // group_v, GROUP_V=group_v, HAS_BIAS=has_bias,
        DOT_FP32=dot_fp32, BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_D=block_d)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, device=q.device, dtype=torch.float32) if return_lse else m_part
    _reduce_kernel[(b * h,)](m_part, l_part, acc_part, out, lse, chunks,
                             G=g, D=d, HAS_LSE=return_lse, BLOCK_G=block_g, BLOCK_D=block_d)
    return (out, lse) if return_lse else out


if triton is not None:

    @triton.jit
    def _codes(ptrs, mask, BITS: tl.constexpr):
        """The codes of a (BLOCK_N, BLOCK_D · BITS / 8) tile of code bytes as a (BLOCK_N, BLOCK_D) int32
        tile: int8 as they are; int4 split into the low nibble (channel 2i) and the high nibble
        (channel 2i + 1) of byte i and interleaved back into channel order."""
        raw = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        if BITS == 4:
            raw = tl.interleave(raw & 15, raw >> 4)
        return raw

    @triton.jit
    def _partials_kernel(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, table_ptr, len_ptr, bias_ptr,
                         m_ptr, l_ptr, acc_ptr, scale, H, chunk_tokens, num_chunks,
                         stride_tb, stride_th, stride_tm, stride_lb, stride_lh,
                         stride_kp, stride_ks, stride_vp, stride_vs, stride_bp, stride_bs,
                         G: tl.constexpr, D: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
                         BITS: tl.constexpr, K_CHANNEL: tl.constexpr, NGK: tl.constexpr,
                         GROUP_K: tl.constexpr, NGV: tl.constexpr, GROUP_V: tl.constexpr,
                         HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """Online-softmax partials of one (sequence·KV head, chunk) for its G query heads, over float pages
        (BITS 32: keys and values loaded as they are, by their strides) or codes (BITS 8 or 4: W bytes an
        entry, dequantized to fp32 as they are loaded, kvcompile.kernels.paged_attention_quant): only the
        load of a key or value tile differs."""
        bh = tl.program_id(0)
        chunk = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_g = offs_g < G
        mask_d = offs_d < D
        q = tl.load(q_ptr + (bh * G + offs_g)[:, None] * D + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        offs_w = tl.arange(0, BLOCK_D * BITS // 8)  # code bytes of an entry (int4: two codes each)
        mask_w = offs_w < W
        length = tl.load(len_ptr + b * stride_lb + h * stride_lh).to(tl.int32)
        table_row = table_ptr + b.to(tl.int64) * stride_tb + h * stride_th
        lo = chunk * chunk_tokens
        hi = tl.minimum(lo + chunk_tokens, length)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            t = start + offs_n
            valid = t < hi
            page = tl.load(table_row + (t // S) * stride_tm, mask=valid, other=0).to(tl.int64)
            slot = t % S
            entry = page * S + slot  # the entry's row in the pool, (BLOCK_N,)
            kv_mask = valid[:, None] & mask_d[None, :]
            if BITS == 32:
                k = tl.load(k_ptr + (page * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                if DOT_FP32:
                    k = k.to(tl.float32)
            else:
                codes = _codes(k_ptr + entry[:, None] * W + offs_w[None, :], valid[:, None] & mask_w[None, :],
                               BITS)
                if K_CHANNEL:
                    at = page[:, None] * D + offs_d[None, :]
                else:
                    at = entry[:, None] * NGK + (offs_d // GROUP_K)[None, :]
                k = (codes.to(tl.float32) * tl.load(ks_ptr + at, mask=kv_mask, other=0.0)
                     + tl.load(kz_ptr + at, mask=kv_mask, other=0.0))
            logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BLOCK_G, BLOCK_N)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + page * stride_bp + slot * stride_bs, mask=valid, other=0.0)
                logits += bias.to(tl.float32)[None, :]
            logits = tl.where(valid[None, :], logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(logits - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            if BITS == 32:
                v = tl.load(v_ptr + (page * stride_vp + slot * stride_vs)[:, None] + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                if DOT_FP32:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:  # p = hi + lo in V's dtype: two tensor-core products, p kept to 2x its bits
                    p_hi = p.to(v.dtype)
                    p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
                    pv = tl.dot(p_hi, v) + tl.dot(p_lo, v)
            else:
                codes = _codes(v_ptr + entry[:, None] * W + offs_w[None, :], valid[:, None] & mask_w[None, :],
                               BITS)
                at = entry[:, None] * NGV + (offs_d // GROUP_V)[None, :]
                v = (codes.to(tl.float32) * tl.load(vs_ptr + at, mask=kv_mask, other=0.0)
                     + tl.load(vz_ptr + at, mask=kv_mask, other=0.0))
                pv = tl.dot(p, v, input_precision="ieee")
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        part = (bh * num_chunks + chunk) * G + offs_g
        tl.store(m_ptr + part, m_i, mask=mask_g)
        tl.store(l_ptr + part, l_i, mask=mask_g)
        tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc,
                 mask=mask_g[:, None] & mask_d[None, :])

    @triton.jit
    def _reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr, num_chunks,
                       G: tl.constexpr, D: tl.constexpr, HAS_LSE: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """Combine the chunk partials of one (sequence·KV head): rescale to a common max; the log-sum-exp
        m + log l (−inf for an empty head) when asked. The float and the quantized pages' kernels share it
        (kvcompile.kernels.paged_attention_quant)."""
        bh = tl.program_id(0)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < G
        mask_gd = mask_g[:, None] & (offs_d < D)[None, :]
        m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for c in range(num_chunks):
            m_c = tl.load(m_ptr + (bh * num_chunks + c) * G + offs_g, mask=mask_g,
                          other=float("-inf"))
            m_all = tl.maximum(m_all, m_c)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for c in range(num_chunks):
            part = (bh * num_chunks + c) * G + offs_g
            w = tl.exp(tl.load(m_ptr + part, mask=mask_g, other=float("-inf")) - m_safe)
            den += w * tl.load(l_ptr + part, mask=mask_g, other=0.0)
            acc += w[:, None] * tl.load(acc_ptr + part[:, None] * D + offs_d[None, :],
                                        mask=mask_gd, other=0.0)
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(out_ptr + (bh * G + offs_g)[:, None] * D + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_gd)
        if HAS_LSE:
            lse = tl.where(den > 0, m_safe + tl.log(tl.where(den > 0, den, 1.0)), float("-inf"))
            tl.store(lse_ptr + bh * G + offs_g, lse, mask=mask_g)
