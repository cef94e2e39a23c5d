"""Decode attention over quantized KV pages (int8, int4): precision as a part of the cache's layout.

Contract: `kvcompile.kernels.paged_attention`'s (one query per head per step, GQA group
G = Hq / H, block_table (B, H, M) int32 or int64, lengths (B, H), optional per-entry bias pages
(P, S) added to the logits, softmax scale, default d^-1/2; entries past a head's length and
block-table entries past its last page never read; an empty head gives zeros), with each float
page pair `k_pages`, `v_pages` (P, S, d) replaced by quantized pages (kvcompile/kernels/quantize.py):

    k_codes, v_codes   uint8 (P, S, d) for int8, (P, S, d // 2) for int4 (low nibble first);
                       the bit width (one for keys and values) is read off their width
    k_scale, k_zero    float32 (P, S, d // group_k): keys per token, groups of group_k channels;
                       or (P, d): keys per channel, each channel over the page's S entries (KIVI)
    v_scale, v_zero    float32 (P, S, d // group_v): values per token (KIVI, MiKV)

The result is, by definition, `paged_attention_quant_torch`: every page dequantized
(x̂ = code · scale + zero, `quantize.dequantize`), then `paged_attention.paged_attention_torch`
on the float pages. With `return_lse=True` every implementation also returns the log-sum-exp of
each query head's logits (B, Hq) (−inf for an empty head): `merge_partials` combines the result
with an attention over other entries, as KIVI's full-precision residual needs
(quantize.py's docstring says how a caller holds it).

Implementations:
- `paged_attention_quant_torch`: the eager reference above (the specification).
- `paged_attention_quant_cpp`: the C++ flash-decoding kernel of the float pages (paged_attention.cpp,
  kvcompile/kernels/paged_attention_cpp.py) with the codes' load: each code row read once and decoded in
  registers, keys per channel through KIVI's fused dequantize-and-multiply, each value vector dequantized
  once for the G query heads (the .cpp's comments say how); every retained byte (codes, scales, zeros,
  bias) comes from memory once. fp32 queries on the CPU; head dim and per-token group sizes multiples of
  16 (`supports`); built once per (G, d, key group, value group), int8 and int4 in each build. AVX2 and
  AVX-512 have their own decode and reduction code (the AVX-512 code is compile-checked only: the
  development machine has AVX2); other CPUs (ARM) take at::vec and plain loops (KVCOMPILE_PORTABLE).
- `paged_attention_quant_triton`: the Triton paged kernel's flash-decoding
  (`paged_attention.paged_attention_triton`): one program per (sequence · KV head, chunk of
  entries) writes online-softmax partials, a second kernel combines them. Codes are loaded as a
  tile of bytes (int4: split into low and high nibbles, `tl.interleave`d back into channel
  order), dequantized in fp32, and both products run in fp32 (`input_precision="ieee"`: the dequantized values are not
  representable in the 16-bit dtypes), BLOCK_N = 16 entries a step, which keeps the fp32 tiles in
  registers on sm_80 and sm_90 (no spill: tests/test_kernels_quant.py compiles it). Runs on CUDA,
  or anywhere under TRITON_INTERPRET=1 (fp32: the interpreter computes bf16 wrong).

Backends (one call signature, `backend(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
block_table, lengths, bias_pages, scale)` -> (B, Hq, d)): `CppQuantPagedAttention(parallel_work,
key_group, value_group)` (the layout `build` compiles ahead of the first call),
`TorchQuantPagedAttention`, `TritonQuantPagedAttention`; `backend(name)` makes one from "cpp",
"torch" or "triton".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels import paged_attention_cpp as fp32_cpp
from kvcompile.kernels.backend import KernelBackend
from kvcompile.kernels.paged_attention_cpp import _ARGTYPES, load_cpp  # noqa: F401 (a build of one's own)
from kvcompile.kernels import paged_attention as float_pages  # its Triton kernels are this kernel's too
from kvcompile.kernels.paged_attention import _gathered, paged_attention_torch
from kvcompile.kernels.quantize import dequantize

# Threads and work items as the fp32 C++ kernel (paged_attention_cpp): one thread below
# PARALLEL_WORK multiply-adds a call.
PARALLEL_WORK = fp32_cpp.PARALLEL_WORK
PREFETCH_AHEAD = fp32_cpp.PREFETCH_AHEAD
CPP_GROUP = 16  # the C++ kernel's head dim and group sizes are multiples of this (the widest vector)

@dataclass(frozen=True)
class Layout:
    """What a call's quantized pages hold (read off their shapes by `check`)."""

    bits: int  # 8 or 4, keys and values
    k_channel: bool  # keys per channel (scale (P, d)) rather than per token
    group_k: int  # channels per key group (S when per channel: the page's entries)
    group_v: int  # channels per value group


def check(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor, v_scale: Tensor,
          v_zero: Tensor, block_table: Tensor, lengths: Tensor, bias_pages: Tensor | None = None) -> Layout:
    """Validate a call's shapes and dtypes (ValueError naming the reason); returns the layout."""
    fn = "paged_attention_quant"
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"{fn}: q must be float (B, Hq, d), got {q.dtype} {tuple(q.shape)}")
    b, hq, d = q.shape
    if block_table.dim() != 3 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: block_table must be int32 or int64 (B, H, M), got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    h = block_table.shape[1]
    if block_table.shape[0] != b or lengths.shape != (b, h) or h == 0 or hq % h:
        raise ValueError(f"{fn}: q {tuple(q.shape)}, block_table {tuple(block_table.shape)}, lengths "
                         f"{tuple(lengths.shape)} do not match")
    if lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: lengths must be int32 or int64, got {lengths.dtype}")
    if k_codes.dtype != torch.uint8 or v_codes.dtype != torch.uint8:
        raise ValueError(f"{fn}: codes must be uint8, got {k_codes.dtype}, {v_codes.dtype}")
    if k_codes.dim() != 3 or k_codes.shape != v_codes.shape:
        raise ValueError(f"{fn}: k_codes {tuple(k_codes.shape)} and v_codes {tuple(v_codes.shape)} must be "
                         f"one shape (P, S, d · bits / 8)")
    p, s, width = k_codes.shape
    if width == d:
        bits = 8
    elif 2 * width == d:
        bits = 4
    else:
        raise ValueError(f"{fn}: codes of {width} bytes an entry for head dim {d}: {d} (int8) or {d / 2:g} "
                         f"(int4) expected")
    for name, x in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale), ("v_zero", v_zero)):
        if x.dtype != torch.float32:
            raise ValueError(f"{fn}: {name} must be float32, got {x.dtype}")
    if k_scale.shape != k_zero.shape or v_scale.shape != v_zero.shape:
        raise ValueError(f"{fn}: k_scale {tuple(k_scale.shape)} / k_zero {tuple(k_zero.shape)} and v_scale "
                         f"{tuple(v_scale.shape)} / v_zero {tuple(v_zero.shape)} must match pairwise")
    if k_scale.shape == (p, d):
        k_channel, group_k = True, s
    elif k_scale.dim() == 3 and k_scale.shape[:2] == (p, s) and k_scale.shape[2] and d % k_scale.shape[2] == 0:
        k_channel, group_k = False, d // k_scale.shape[2]
    else:
        raise ValueError(f"{fn}: k_scale {tuple(k_scale.shape)} must be ({p}, {d}) (per channel) or "
                         f"({p}, {s}, d // group) (per token, group dividing d = {d})")
    if not (v_scale.dim() == 3 and v_scale.shape[:2] == (p, s) and v_scale.shape[2] and d % v_scale.shape[2] == 0):
        raise ValueError(f"{fn}: v_scale {tuple(v_scale.shape)} must be ({p}, {s}, d // group) with the group "
                         f"dividing d = {d} (values are quantized per token)")
    if bias_pages is not None and bias_pages.shape != (p, s):
        raise ValueError(f"{fn}: bias_pages {tuple(bias_pages.shape)} must be ({p}, {s})")
    return Layout(bits, k_channel, group_k, d // v_scale.shape[2])


def _dequantized(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, layout: Layout) -> tuple[Tensor, Tensor]:
    k = dequantize(k_codes, k_scale, k_zero, layout.bits, "channel" if layout.k_channel else "token")
    v = dequantize(v_codes, v_scale, v_zero, layout.bits, "token")
    return k, v


# --------------------------------------------------------------------------- torch (reference)

def paged_attention_quant_torch(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                                v_scale: Tensor, v_zero: Tensor, block_table: Tensor, lengths: Tensor,
                                bias_pages: Tensor | None = None, scale: float | None = None, *,
                                return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The specification: every page dequantized (`quantize.dequantize`: code · scale + zero, fp32),
    then the float pages' attention, `paged_attention_torch` (eager: gather + matmul): only the load
    differs -> (B, Hq, d) in q's dtype. return_lse: also the log-sum-exp of each query head's logits
    (B, Hq) float32, −inf for an empty head (`paged_attention_lse_torch`: the same gathered logits)."""
    layout = check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, lengths, bias_pages)
    k_pages, v_pages = _dequantized(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, layout)
    if return_lse:  # the float pages' attention and its log-sum-exp, from the same logits
        return paged_attention_lse_torch(q, k_pages, v_pages, block_table, lengths, scale, bias_pages)
    return paged_attention_torch(q, k_pages, v_pages, block_table, lengths, bias_pages, scale)


def paged_attention_lse_torch(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, lengths: Tensor,
                              scale: float | None = None, bias_pages: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Decode attention over float pages (`paged_attention_torch`, with per-entry bias pages) and its
    log-sum-exp (B, Hq) (−inf for an empty head): the high tier of a tiered store (kvcompile.store.tiers),
    combined with the codes' attention by `merge_partials`."""
    return _gathered(q, k_pages, v_pages, block_table, lengths, bias_pages, scale, return_lse=True)


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """The attention over two disjoint sets of entries from the attention over each and its
    log-sum-exp (B, Hq): out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b}), taken
    relative to the larger lse; a set with lse −inf (no entry) has weight 0, zeros when both are
    empty. -> (B, Hq, d) in out_a's dtype."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    den = wa + wb
    out = (wa[..., None] * out_a.float() + wb[..., None] * out_b.float()) / torch.where(den > 0, den, 1.0)[..., None]
    return out.to(out_a.dtype)


def dense_attention_lse(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float | None = None
                        ) -> tuple[Tensor, Tensor]:
    """Attention of q (B, Hq, d) over a small dense float cache k, v (B, H, W, d), entry w of head h
    valid when w < lengths[b, h] (KIVI's full-precision residual page) -> (out (B, Hq, d) in q's
    dtype, lse (B, Hq)); an empty head gives zeros and lse −inf. Eager torch: each head's cache as one page."""
    b, h, w, d = k.shape
    table = torch.arange(b * h, device=k.device).view(b, h, 1)
    return paged_attention_lse_torch(q, k.reshape(b * h, w, d), v.reshape(b * h, w, d), table, lengths, scale)


# -------------------------------------------------------------------------------------- C++

def _kernel(g: int, d: int, group_k: int, group_v: int):
    """The C++ kernel built once per (G, d, key group (0: per channel), value group): compile-time
    constants, so every loop over the head dim unrolls; int8 and int4 in one build."""
    return fp32_cpp._kernel(g, d, group_k, group_v)


def supports(device: torch.device | str, dtype: torch.dtype, head_dim: int, groups: tuple[int, ...] = ()) -> bool:
    """The C++ kernel runs here: fp32 queries on the CPU, head dim and the per-token group sizes
    `groups` multiples of 16 (a vector never straddles two groups), and a C++ toolchain."""
    return (fp32_cpp.supports(device, dtype, head_dim)
            and all(group % CPP_GROUP == 0 for group in groups))


def paged_attention_quant_cpp(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                              v_scale: Tensor, v_zero: Tensor, block_table: Tensor, lengths: Tensor,
                              bias_pages: Tensor | None = None, scale: float | None = None, *,
                              return_lse: bool = False, threads: int | None = None, chunk: int | None = None,
                              parallel_work: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Decode attention of q (B, Hq, d) fp32 over quantized pages on the CPU -> (B, Hq, d) (and the
    log-sum-exp (B, Hq) with return_lse), equal to `paged_attention_quant_torch` up to float
    summation order.

    threads: OpenMP threads (default: torch's when the call has at least `parallel_work`
    multiply-adds, default PARALLEL_WORK, else 1); chunk: entries per work item (default: whole
    pages, about ITEMS_PER_THREAD runs per thread over all heads), as `paged_attention_cpp`."""
    layout = check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, lengths, bias_pages)
    b, hq, d = q.shape
    groups = (layout.group_v,) + (() if layout.k_channel else (layout.group_k,))
    if not (supports(q.device, q.dtype, d, groups) and k_codes.device.type == "cpu"):
        raise ValueError(f"paged_attention_quant_cpp: fp32 CPU tensors, head dim and per-token groups "
                         f"multiples of {CPP_GROUP} and a C++ compiler; here {q.device.type}, {q.dtype}, head dim "
                         f"{d}, groups {groups}")
    u8, dense = torch.uint8, fp32_cpp._dense
    pages = (dense(k_codes, u8), dense(k_scale), dense(k_zero), dense(v_codes, u8), dense(v_scale), dense(v_zero))
    kernel = _kernel(hq // block_table.shape[1], d, 0 if layout.k_channel else layout.group_k, layout.group_v)
    return fp32_cpp.launch(kernel, q, pages, layout.bits, block_table, lengths, bias_pages, scale,
                           return_lse=return_lse, threads=threads, chunk=chunk, parallel_work=parallel_work)


# ----------------------------------------------------------------------------------- triton

# Entries per inner step: 16 keeps the fp32 tiles (codes, dequantized K and V, 16 x 128 at d = 128) in
# registers on sm_80 / sm_90 without a spill (tests/test_kernels_quant.py compiles it); 32 spills for int4.
BLOCK_N = 16


def paged_attention_quant_triton(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                                 v_scale: Tensor, v_zero: Tensor, block_table: Tensor, lengths: Tensor,
                                 bias_pages: Tensor | None = None, scale: float | None = None, *,
                                 return_lse: bool = False, block_n: int = BLOCK_N,
                                 chunk_tokens: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Flash-decoding in Triton over quantized pages: grid (B·H, chunks) of partials, then a (B·H,)
    reduce -> (B, Hq, d) in q's dtype (and the log-sum-exp (B, Hq) float32 with return_lse).

    block_n: entries per inner step (rounded up to a power of two, at least paged_attention.MIN_BLOCK_N);
    chunk_tokens: entries per program (default paged_attention.CHUNK_TOKENS, rounded up to a multiple of the
    block_n asked for), a runtime argument, so one compiled kernel serves every cache size. Codes, scales and
    zeros are read as contiguous tensors (made so when they are not); the block table and lengths as given."""
    layout = check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, lengths, bias_pages)
    pages = tuple(x.contiguous() for x in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
    return float_pages.flash_decode_triton(  # the float pages' kernels with the codes' load
        q, pages, (0, 0, 0, 0), block_table, lengths, bias_pages, scale, bits=layout.bits, width=k_codes.shape[2],
        k_channel=layout.k_channel, groups=(layout.group_k, layout.group_v), block_n=block_n,
        chunk_tokens=chunk_tokens, dot_fp32=True, return_lse=return_lse)


# ---------------------------------------------------------------------------------- backends

@dataclass(frozen=True)
class QuantPagedAttention(KernelBackend):
    """A quantized decode attention backend: `backend(q, k_codes, k_scale, k_zero, v_codes, v_scale,
    v_zero, block_table, lengths, bias_pages, scale)` -> (B, Hq, d), the module docstring's
    contract (shapes checked on every call)."""

    name: ClassVar[str]

    def __call__(self, q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                 v_scale: Tensor, v_zero: Tensor, block_table: Tensor, lengths: Tensor,
                 bias_pages: Tensor | None = None, scale: float | None = None, *,
                 return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        # every implementation's function checks the call (`check`) once
        return self.run(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, lengths,
                        bias_pages, scale, return_lse=return_lse)

    def run(self, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, lengths, bias_pages,
            scale, return_lse=False) -> Tensor | tuple[Tensor, Tensor]:
        raise NotImplementedError


@dataclass(frozen=True)
class CppQuantPagedAttention(QuantPagedAttention):
    """The C++ CPU kernel (`paged_attention_quant_cpp`): fp32 queries, head dim and groups multiples
    of 16. A call of fewer than `parallel_work` multiply-adds runs on one thread. `key_group` (0:
    keys per channel) and `value_group`, when given, are the layout `build` compiles the kernel for
    ahead of the first call (one build per (G, d, key group, value group)); any layout runs."""

    name: ClassVar[str] = "cpp"
    parallel_work: int = PARALLEL_WORK
    key_group: int | None = None
    value_group: int | None = None

    def run(self, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, lengths, bias_pages,
            scale, return_lse=False):
        return paged_attention_quant_cpp(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                                         lengths, bias_pages, scale, parallel_work=self.parallel_work,
                                         return_lse=return_lse)

    def build(self, group: int, head_dim: int) -> None:
        if self.key_group is not None and self.value_group is not None:
            _kernel(group, head_dim, self.key_group, self.value_group)

    def describe(self) -> str:
        return f"cpp, quantized pages (one thread below {self.parallel_work} multiply-adds a call, else torch's threads)"


@dataclass(frozen=True)
class TorchQuantPagedAttention(QuantPagedAttention):
    """The eager reference: dequantize the pages, then `paged_attention_torch`."""

    name: ClassVar[str] = "torch"
    run = staticmethod(paged_attention_quant_torch)


@dataclass(frozen=True)
class TritonQuantPagedAttention(QuantPagedAttention):
    """Flash-decoding in Triton over quantized pages: CUDA tensors, or any under TRITON_INTERPRET=1."""

    name: ClassVar[str] = "triton"
    run = staticmethod(paged_attention_quant_triton)


@dataclass(frozen=True, eq=False)
class SoftcapQuantPagedAttention(QuantPagedAttention):
    """The eager reference over codes with a model's logit soft-cap (Gemma 2: cap·tanh(s/cap) before the softmax,
    s the scaled logit, before any merge bias) and/or a layer's learned sinks (gpt-oss: one logit per query head
    in the softmax's denominator): the pages dequantized, then `paged_attention.SoftcapPagedAttention`'s
    attention. return_lse (the low tier of a two-tier store): the capped attention over these entries and its
    log-sum-exp, without the sinks, which the caller adds once over all its entries
    (store.tiers.SoftcapTieredPagedAttention). The plan's decode attention over codes on such a model
    (`with_sinks` gives a layer's)."""

    name: ClassVar[str] = "torch"
    softcap: float = 0.0
    sinks: Tensor | None = None  # (Hq,) one layer's sinks, else None

    def with_sinks(self, sinks: Tensor | None) -> "SoftcapQuantPagedAttention":
        return SoftcapQuantPagedAttention(self.softcap, sinks)

    def run(self, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, lengths, bias_pages,
            scale, return_lse=False):
        layout = check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, lengths, bias_pages)
        k_pages, v_pages = _dequantized(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, layout)
        return float_pages.SoftcapPagedAttention(self.softcap, self.sinks).run(
            q, k_pages, v_pages, block_table, lengths, bias_pages, scale, return_lse=return_lse)

    def describe(self) -> str:
        return float_pages.SoftcapPagedAttention.describe(self).replace("torch (", "torch, quantized pages (")


def backend(name: str) -> QuantPagedAttention:
    """The backend of impl `name`: "cpp" | "torch" | "triton" (ValueError for another name)."""
    if name == "cpp":
        return CppQuantPagedAttention(PARALLEL_WORK)
    if name not in ("torch", "triton"):
        raise ValueError(f"paged_attention_quant: unknown impl {name!r}; one of cpp | torch | triton")
    return {"triton": TritonQuantPagedAttention, "torch": TorchQuantPagedAttention}[name]()


def target_cases(model, dtype: torch.dtype) -> list:
    """(case name, a call of `paged_attention_quant_triton`) at a model's shapes (kvcompile.kernels.
    targets.Model: batch 1, its KV heads, query heads, head dim, page and prompt), one per variant:
    int8 and int4, keys per token (group 32, as KIVI's) or per channel, with and without bias.
    What kvcompile.kernels.targets compiles for sm_80 / sm_90 (tests/test_kernels_quant.py)."""
    from kvcompile.kernels.quantize import code_width

    b, h, hq, d, s, n = 1, model.kv_heads, model.q_heads, model.head_dim, model.page, model.prompt
    pages = -(-n // s)
    pool = b * h * pages + 4

    def call(bits: int, k_channel: bool, bias: bool):
        q = torch.zeros(b, hq, d, dtype=dtype)
        codes = torch.zeros(pool, s, code_width(d, bits), dtype=torch.uint8)
        per_token = torch.zeros(pool, s, d // 32)
        k_scale = torch.zeros(pool, d) if k_channel else per_token
        table = torch.zeros(b, h, pages, dtype=torch.int32)
        lengths = torch.full((b, h), n, dtype=torch.int32)
        bias_pages = torch.zeros(pool, s) if bias else None
        return lambda: paged_attention_quant_triton(q, codes, k_scale, k_scale, codes, per_token, per_token,
                                                    table, lengths, bias_pages, return_lse=bias)

    return [(f"quantized decode, int{bits}, keys per {'channel' if k_channel else 'token'}"
             f"{', merge bias, lse' if bias else ''}", call(bits, k_channel, bias))
            for bits in (8, 4) for k_channel in (False, True) for bias in (False, True)
            if not bias or (bits == 8 and not k_channel)]
