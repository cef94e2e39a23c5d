"""One decode step of a layer whose heads hold entries in two precisions (kvcompile.store.tiers.TieredStore:
`storage: mixed`, MiKV, Yang et al., 2024, arXiv 2402.18096, §3; or codes per token beside merge slots), fused
into one C++ call: what `TieredStore.append` and `TieredPagedAttention` (each tier's paged C++ kernel with its
log-sum-exp, `merge_partials`) do in about 40 small torch ops a layer.

    out = tiered_step_cpp(pages, q, k, v, position, scale, ...)

pages: `TieredStore.tensors()` (the high tier's `PageTensors`, then the low tier's `QuantPageTensors`), updated
in place; q (B, Hq, d), k, v (B, H, d), position (B,) long. Semantics, every head at once:
1. the new entry is appended to the appending tier (`TieredStore._appending`): to the float tier as
   `LayerStore.append` writes float pages (mixed: generated tokens in the model's dtype), or, for a part that
   keeps every token as codes, quantized into the codes' next slot exactly as kernels.append_step does it;
2. attention of the G query heads over both tiers, each by the paged kernel of paged_attention.cpp: the float
   tier's with the merge rule's bias α·log w (ZSMerge Eq. 8; −inf for an empty slot; none where the policy
   drops) and its log-sum-exp lse_h, the codes' with lse_l, combined as `merge_partials` does:
   out = (e^{lse_h} out_h + e^{lse_l} out_l) / (e^{lse_h} + e^{lse_l}) (the attention over the union of the
   two sets of entries); equal to `TieredPagedAttention` up to float summation order.

Every head's next entry has a page in the appending tier (the engine makes room before the step,
`TieredStore.make_room`; a head without one is an error), and the pages have the layout the kernel writes (the
store's, as the plan chose it). KIVI (keys per channel, `residual` given): the entry joins the float tier, then
every head whose float tier holds residual + tokens entries moves its oldest `tokens` into the codes' next page
(keys per channel over them, values per entry, by kernels.quantize's formula bit for bit) and rotates its first
float pages to the end of the run it owns, as `ChannelCodeStore.flush` (which also writes the next page of a head
that does not flush, unused until it does) and `LayerStore.rotate_out`; the codes' page of every head's next
flush is owned before the step (`ChannelCodeStore.reserve_flush`).

The C++ is tiered_step.cpp, compiled after paged_attention.cpp and append_step.cpp (entries renamed), once
per (G, d, group, keys per channel or not). Backend: `CppTieredStep(bits, group, alpha, append_low, parallel_work,
residual)` (`Plan.decode_step`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels import paged_attention_cpp as paged
from kvcompile.store import PageTensors, QuantPageTensors
from kvcompile.store.pages import check_call
from kvcompile.kernels.online_step import DecodeStep, _alpha

_ARGTYPES = ("const float*", "const float*", "const float*", "const int64_t*",
             "float*", "float*", "float*", "int64_t*", "float*", "int64_t*", "int64_t*", "const int64_t*",
             "const int64_t", "const int64_t",
             "uint8_t*", "float*", "float*", "uint8_t*", "float*", "float*", "float*", "int64_t*", "float*",
             "const int64_t*", "int64_t*", "const int64_t*", "const int64_t", "const int64_t",
             "float*", "float*", "float*", "float*", "float*", "float*", "const int64_t", "float*", "const int64_t",
             "const int64_t", "const float", "const int64_t",
             "const double*", "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "int64_t*", "int64_t*")
_HIGH = len(PageTensors._fields)


def source(g: int, d: int, group: int, key_group: int | None = None) -> str:
    """paged_attention.cpp and append_step.cpp (their entries renamed), then tiered_step.cpp; key_group: the
    codes' channels per key scale (None: `group`; 0: keys per channel over a page, KIVI)."""
    text = lambda name: resources.files(__package__).joinpath(name).read_text(encoding="utf-8")  # noqa: E731
    key_group = group if key_group is None else key_group
    return ("#include <torch/csrc/inductor/cpp_prefix.h>\n#define kernel kvcompile_paged_attention_quant\n"
            + paged.source(g, d, key_group, group) + "\n#undef kernel\n#define kernel kvcompile_quant_step\n"
            + "#define KVCOMPILE_TIERED 1\n" + text("append_step.cpp") + "\n#undef kernel\n" + text("tiered_step.cpp"))


@functools.cache
def _kernel(g: int, d: int, group: int, key_group: int | None = None):
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(list(_ARGTYPES), source(g, d, group, key_group))


def tiered_step_cpp(pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, scale: float, bits: int, group: int,
                    alpha: float | None, append_low: bool, parallel_work: int = paged.PARALLEL_WORK,
                    threads: int | None = None, residual: int | None = None) -> Tensor:
    """The C++ step: the output (B, Hq, d).
    alpha: the merge bias α of α·log w on the float tier (None: no bias); append_low: the new entry goes to the
    codes (else to the float tier); residual: KIVI's (keys per channel over the codes' pages of `tokens`
    entries, `k_scale` (P, d)): after the append, a head whose float tier holds residual + tokens entries moves
    its oldest `tokens` into the codes (None: codes per entry, nothing moves)."""
    b, hq, d = q.shape
    h = k.shape[1]
    high, low = PageTensors(*pages[:_HIGH]), QuantPageTensors(*pages[_HIGH:])
    channel = residual is not None
    if channel and (append_low or low.k_pages.shape[1] % high.k_pages.shape[1]):
        raise RuntimeError("kvcompile: a tiered step with keys per channel appends to the float tier, and its codes' "
                           "pages are whole runs of float pages")
    check_call(high, q, k, v, position, d, 32, 0)
    check_call(low, q, k, v, position, d, bits, group, key_group=0 if channel else None)
    max_threads = torch.get_num_threads() if threads is None else threads
    runs = max(1, -(-paged.ITEMS_PER_THREAD * max_threads // (b * h)))
    g = hq // h
    parts = b * h * runs * g * (d + 2)  # the paged kernel's partials, one call after the other
    work = torch.empty(parts + 2 * (b * hq * d + b * hq))
    out_low, lse_low, out_high, lse_high = work[parts:].split([b * hq * d, b * hq, b * hq * d, b * hq])
    bias = out_high if alpha is None else torch.empty(high.count_pages.shape)
    out = work.new_empty(b, hq, d)
    status = torch.empty(1, dtype=torch.long)
    scratch = torch.empty(high.block_table.shape[-1], dtype=torch.long)  # KIVI's rotated block table row
    _kernel(g, d, group, 0 if channel else None)(
        q if q.is_contiguous() else q.contiguous(), k if k.is_contiguous() else k.contiguous(),
        v if v.is_contiguous() else v.contiguous(), position if position.is_contiguous() else position.contiguous(),
        high.k_pages, high.v_pages, high.score_pages, high.pos_pages, high.count_pages, high.block_table,
        high.lengths, high.owned, high.block_table.shape[-1], high.k_pages.shape[1],
        low.k_pages, low.k_scale, low.k_zero, low.v_pages, low.v_scale, low.v_zero, low.score_pages, low.pos_pages,
        low.count_pages, low.block_table, low.lengths, low.owned, low.block_table.shape[-1], low.k_pages.shape[1],
        work, out_low, lse_low, out_high, lse_high, bias, high.count_pages.shape[0], out, b, h, float(scale),
        int(alpha is not None), _alpha(float(alpha or 0.0)), int(append_low), max_threads, paged.ITEMS_PER_THREAD,
        parallel_work if threads is None else 0, bits, residual or 0, scratch, status)
    failed = status.item()
    if failed == 2:
        raise RuntimeError("kvcompile: the fused decode step met a head without the codes' page of its next flush (the "
                           "engine makes room before every step: ChannelCodeStore.reserve_flush)")
    if failed:
        raise RuntimeError("kvcompile: the fused decode step met a head without a page in its appending tier (the "
                           "engine makes room before every step: TieredStore.make_room)")
    return out


@dataclass(frozen=True)
class CppTieredStep(DecodeStep):
    """The fused C++ step of a two-tier store (`tiered_step_cpp`). bits, group: the codes' width and channels
    per scale; alpha: the merge bias α (None: the policy drops); append_low: decode entries go to the codes
    (a part that keeps every token as codes), else to the float tier (mixed); parallel_work: the paged
    kernel's one-thread bound for the codes."""

    name: ClassVar[str] = "cpp"
    bits: int = 4
    group: int = 0
    alpha: float | None = None
    append_low: bool = False
    parallel_work: int = paged.PARALLEL_WORK
    residual: int | None = None  # KIVI (keys per channel): its full-precision residual, after which a head's
    #                              oldest `tokens` move into the codes within the step; None: codes per entry

    stores: ClassVar[tuple[str, ...]] = ("TieredStore",)

    def __call__(self, plan, store, layer, q, k, v, position, split, scale):
        return store.step(self._step, q, k, v, position, split, scale)

    def _step(self, pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, split: Tensor | None,
              scale: float) -> Tensor:
        return tiered_step_cpp(pages, q, k, v, position, scale, self.bits, self.group, self.alpha, self.append_low,
                               self.parallel_work, residual=self.residual)

    def build(self, group: int, head_dim: int) -> None:
        _kernel(group, head_dim, self.group, None if self.residual is None else 0)

    def describe(self) -> str:
        bias = "" if self.alpha is None else f", merge bias {self.alpha}·log w"
        if self.residual is not None:
            bias += f", keys per channel: a full group leaves the float tier past {self.residual} entries"
        return (f"cpp, two tiers (model dtype and int{self.bits}, {self.group} channels a scale{bias}): the new entry "
                f"into the {'codes' if self.append_low else 'float tier'}, both tiers' attention and their "
                f"log-sum-exp merge, one call (codes on one thread below {self.parallel_work} multiply-adds)")
