"""One decode step of a layer whose step is an append and an attention (no running scores, no online eviction),
fused into one C++ call: the pages of a `LayerStore` (fp32) or of a `CodeStore` (int8 / int4 codes, keys and
values per token). What `LayerStore.append` (for codes `quantize.quantize_pair_into_pages`) and the plan's
decode attention (`paged_attention_cpp`, `paged_attention_quant.CppQuantPagedAttention`) do in about 10 (fp32)
to 40 (codes) small torch ops a layer.

    out = append_step_cpp(pages, q, k, v, position, scale, bits, group)

pages: a layer's tensors (`kvcompile.store.PageTensors`, `LayerStore.tensors()`; `QuantPageTensors` for codes),
updated in place; q (B, Hq, d), k, v (B, H, d) the new token's query, key and value of every head; position
(B,) long its logical position. Returns the attention output (B, Hq, d). Semantics, every head at once:
1. the new entry is appended at the head's next slot (page block_table[b, h, n // S], slot n % S for a head
   of n entries; score 0, position, count 1; n + 1 entries): fp32 pages take the key and value as they are;
   codes are written as `quantize.quantize(x[None], bits, group)` writes them: asymmetric round-to-nearest
   (KIVI, Liu et al., 2024, arXiv 2402.02750, §3.1; MiKV, Yang et al., 2024, arXiv 2402.18096, §3.1), per
   group x of `group` channels zero = min x, scale = (max x − min x) / (2^bits − 1) (1 where that is 0), code =
   clamp(round((x − zero) / scale), 0, 2^bits − 1), round half to even, fp32, int4 packed low nibble first;
   the codes, scales and zero points are bit for bit the torch quantizer's (tests/test_quant_step.py);
2. decode attention of the G query heads over the head's n + 1 entries: the paged kernel of
   paged_attention.cpp itself (the same flash-decoding, threads and work items; the codes dequantized in
   registers), so the output is the unfused C++ path's bit for bit, and `reference.decode_attention` over
   the (dequantized) entries up to float summation order.

Every head's next entry has a page it owns: the engine makes room before the step (`LayerStore.make_room`,
the append's named host read); a head without one is an error, not a fallback. The layout the kernel writes
(dtypes, contiguity, the code width and groups) is the store's, as the plan chose it (`DecodeStep.refuses`).

The C++ is append_step.cpp beside this module, compiled after paged_attention.cpp's text (its entry renamed)
by Inductor's C++ toolchain, once per (G, d, fp32 or codes, group): compile-time constants, as the paged
kernel.

Backend (`Plan.decode_step`, the decode-step family of kernels.online_step): `CppAppendStep(bits, group,
parallel_work)`, bits 32 for fp32 pages (group unused), chosen by the plan for a policy of that store with
neither running scores nor online eviction nor merge slots beside codes, on the CPU for fp32 where the paged
C++ kernel runs (head dim and group multiples of 16).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels import paged_attention_cpp as paged
from kvcompile.kernels.online_step import DecodeStep, _alpha

_ARGTYPES = ("const float*", "const float*", "const float*", "const int64_t*", "uint8_t*", "float*", "float*",
             "uint8_t*", "float*", "float*", "float*", "int64_t*", "float*", "const int64_t*", "int64_t*",
             "const int64_t*", "float*", "float*", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const float", "const int64_t", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const double*", "float*", "const int64_t", "int64_t*")
FLOAT = 32  # `bits` of fp32 pages

# The paged kernel's text is compiled first with its entry renamed; cpp_prefix.h is included before the
# rename (it is included once), so no name in torch's headers changes.
_PRELUDE = "#include <torch/csrc/inductor/cpp_prefix.h>\n#define kernel kvcompile_paged_attention_quant\n"


def source(g: int, d: int, group: int | None) -> str:
    """The fused step's C++ for G query heads per KV head, head dim d and fp32 pages (group None) or codes of
    `group` channels per scale (keys and values): paged_attention.cpp (its entry renamed), then append_step.cpp."""
    text = paged.source(g, d, group, group)
    step = resources.files(__package__).joinpath("append_step.cpp").read_text(encoding="utf-8")
    return _PRELUDE + text + "\n#undef kernel\n" + step


@functools.cache
def _kernel(g: int, d: int, group: int | None):
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(list(_ARGTYPES), source(g, d, group))


def counters_layout(pages) -> bool:
    """A store's block table and counters int64, scores and counts float32, and every tensor contiguous: what the
    fused steps (this one, kernels.tiered_step) write into in place beside the keys and values."""
    return (pages.lengths.dtype == torch.long and pages.block_table.dtype == torch.long
            and pages.owned.dtype == torch.long and pages.pos_pages.dtype == torch.long
            and pages.score_pages.dtype == torch.float32 and pages.count_pages.dtype == torch.float32
            and all(t.is_contiguous() for t in pages))


def _layout(pages, d: int, bits: int, group: int) -> bool:
    """The pages have the layout the kernel writes into in place: fp32 (P, S, d), or codes uint8
    (P, S, d · bits / 8) with scales and zero points float32 (P, S, d / group); and `counters_layout`."""
    if bits == FLOAT:
        return pages.k_pages.dtype == torch.float32 and pages.v_pages.dtype == torch.float32 \
            and pages.k_pages.shape[-1] == d and pages.v_pages.shape[-1] == d and counters_layout(pages)
    kc, vc, ks, kz, vs, vz = pages.k_pages, pages.v_pages, pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero
    width, groups = d * bits // 8, d // group
    return (kc.dtype == torch.uint8 and vc.dtype == torch.uint8 and kc.shape[-1] == width
            and vc.shape[-1] == width and ks.dtype == torch.float32 and kz.dtype == torch.float32
            and vs.dtype == torch.float32 and vz.dtype == torch.float32 and ks.dim() == 3
            and ks.shape[-1] == groups and kz.shape == ks.shape and vs.shape == ks.shape and vz.shape == ks.shape
            and counters_layout(pages))


def check_call(pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, d: int, bits: int, group: int) -> None:
    """RuntimeError where the call is not of the layout a fused step writes into in place (the plan chose the
    step for the store's layout and the model's fp32 CPU tensors: a mismatch is a bug, not a case to skip)."""
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32 \
            or position.dtype != torch.long or q.device.type != "cpu" or not _layout(pages, d, bits, group):
        raise RuntimeError(f"kvcompile: a fused decode step (C++, fp32 CPU) got tensors of another layout: q "
                           f"{q.dtype} on {q.device}, pages {pages.k_pages.dtype} {tuple(pages.k_pages.shape)}")


def append_step_cpp(pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, scale: float, bits: int, group: int,
                    parallel_work: int = paged.PARALLEL_WORK, threads: int | None = None,
                    alpha: float | None = None) -> Tensor:
    """The C++ step: the output (B, Hq, d). bits: 32 (fp32 pages) or the codes' width, group: their channels per
    scale (the storage part's); alpha: the merge rule's bias α·log w of every entry in the attention (ZSMerge
    Eq. 8, −inf for an empty slot; None: no bias); parallel_work, threads: as `paged_attention_cpp.paged_attention_cpp` (one thread
    below parallel_work multiply-adds a call, else `threads`, default torch's)."""
    b, hq, d = q.shape
    h = k.shape[1]
    check_call(pages, q, k, v, position, d, bits, group)
    max_threads = torch.get_num_threads() if threads is None else threads
    runs = max(1, -(-paged.ITEMS_PER_THREAD * max_threads // (b * h)))  # bounds the runs the C++ side chooses
    work = torch.empty(b * h * runs * (hq // h) * (d + 2))
    out = torch.empty(b, hq, d)
    status = torch.empty(1, dtype=torch.long)
    bias = out if alpha is None else torch.empty(pages.count_pages.shape)
    if bits == FLOAT:
        scales = (out, out, out, out)  # fp32 pages have none (never read)
    else:
        scales = (pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero)
    _kernel(hq // h, d, None if bits == FLOAT else group)(
        q if q.is_contiguous() else q.contiguous(), k if k.is_contiguous() else k.contiguous(),
        v if v.is_contiguous() else v.contiguous(), position if position.is_contiguous() else position.contiguous(),
        pages.k_pages, scales[0], scales[1], pages.v_pages, scales[2], scales[3], pages.score_pages,
        pages.pos_pages, pages.count_pages, pages.block_table, pages.lengths, pages.owned, work, out, b, h,
        pages.block_table.shape[-1], pages.k_pages.shape[1], float(scale), max_threads, paged.ITEMS_PER_THREAD,
        parallel_work if threads is None else 0, bits, int(alpha is not None), _alpha(float(alpha or 0.0)), bias,
        pages.count_pages.shape[0], status)
    if status.item():
        raise RuntimeError("kvcompile: the fused decode step met a head without a page for its next entry (the "
                           "engine makes room before every step: LayerStore.make_room)")
    return out


@dataclass(frozen=True)
class CppAppendStep(DecodeStep):
    """The fused C++ step of a layer whose step is an append and an attention (`append_step_cpp`): the new entry
    written into its slot (fp32, or quantized), then the paged kernel, one call a layer and step. bits: 32 for
    fp32 pages, else the storage part's code width; group: its channels per scale; parallel_work: the paged
    kernel's one-thread bound."""

    name: ClassVar[str] = "cpp"
    bits: int = 8
    group: int = 0
    parallel_work: int = paged.PARALLEL_WORK
    alpha: float | None = None  # the merge bias α of α·log w (slots beside fp32 pages); None: no bias

    @property
    def stores(self) -> tuple[str, ...]:
        return ("LayerStore",) if self.bits == FLOAT else ("CodeStore",)

    def __call__(self, plan, store, layer, q, k, v, position, split, scale):
        return store.step(self.run, q, k, v, position, split, scale)

    def run(self, pages, q, k, v, position, split, scale):
        """The kernel on a store's page tensors (`PageTensors`, `QuantPageTensors`; `__call__` hands them)."""
        return append_step_cpp(pages, q, k, v, position, scale, self.bits, self.group, self.parallel_work,
                               alpha=self.alpha)

    def build(self, group: int, head_dim: int) -> None:
        _kernel(group, head_dim, None if self.bits == FLOAT else self.group)

    def describe(self) -> str:
        pages = "fp32 pages" if self.bits == FLOAT else \
            f"quantized pages (int{self.bits}, {self.group} channels a scale)"
        if self.alpha is not None:
            pages += f", merge bias {self.alpha}·log w"
        return (f"cpp, {pages}: the new entry {'copied' if self.bits == FLOAT else 'quantized'} into its slot, then "
                f"the paged kernel, one call (one thread below {self.parallel_work} multiply-adds, else torch's "
                "threads)")


CppQuantStep = CppAppendStep  # the step of a store of codes (bits 8 or 4)


def backend(bits: int, group: int, alpha: float | None = None) -> CppAppendStep:
    """The fused step for fp32 pages (bits 32) or codes of `bits` with `group` channels per scale (a storage
    part's, group resolved for the head dim); alpha: the merge bias of fp32 pages' slots (None: none)."""
    return CppAppendStep(bits, group, paged.PARALLEL_WORK, alpha)
