"""One decode step of a layer whose pages hold integer codes (storage int8 / int4, keys and values per
token), fused into one C++ call: what `CodeStore.append` (`quantize.quantize_pair_into_pages`) and
`CodeStore.attend` with the quantized decode backend (`paged_attention_quant.CppQuantPagedAttention`) do
in about 40 small torch ops a layer.

    out = quant_step_cpp(pages, q, k, v, position, scale)   # None: not run, the pages untouched

pages: a quantized layer's tensors (`kvcompile.store.QuantPageTensors`, `CodeStore.tensors()`),
updated in place; q (B, Hq, d), k, v (B, H, d) the new token's query, key and value of every head; position
(B,) long its logical position. Returns the attention output (B, Hq, d). Semantics, every head at once:
1. the new entry is appended at the head's next slot (page block_table[b, h, n // S], slot n % S for a head
   of n entries; score 0, position, count 1; n + 1 entries), its key and value written as
   `quantize.quantize(x[None], bits, group)` writes them: asymmetric round-to-nearest (KIVI, Liu et al.,
   2024, arXiv 2402.02750, §3.1; MiKV, Yang et al., 2024, arXiv 2402.18096, §3.1), per group x of `group`
   channels zero = min x, scale = (max x − min x) / (2^bits − 1) (1 where that is 0), code =
   clamp(round((x − zero) / scale), 0, 2^bits − 1), round half to even, fp32, int4 packed low nibble first;
   the codes, scales and zero points are bit for bit the torch quantizer's (tests/test_quant_step.py);
2. decode attention of the G query heads over the head's n + 1 entries, x̂ = code · scale + zero
   dequantized in registers: the paged kernel of paged_attention_quant.cpp itself (the same flash-decoding,
   threads and work items), so the output is the unfused C++ path's, and `reference.decode_attention` over the
   dequantized entries up to float summation order.

Not its case (the pages untouched, None returned; the engine's path runs that step): a head whose next entry
needs a fresh page (past the pages it owns: `LayerStore.append`'s allocation, a named host read), pages not
of the layout the kernel writes (dtypes, contiguity, the code width and groups of `bits` and `group`).

The C++ is quant_step.cpp beside this module, compiled after paged_attention_quant.cpp's text (its entry
renamed) by Inductor's C++ toolchain, once per (G, d, group): compile-time constants, as the paged kernel.

Backend (`Plan.online_step`, the decode-step family of kernels.online_step): `CppQuantStep(bits, group,
parallel_work)`, chosen by the plan for a quantized store of keys per token with neither running scores nor
online eviction nor merge slots (those are the engine's Python path, or a tiered store), on the CPU for fp32
where the quantized C++ kernel runs (head dim and group multiples of 16). Its fallback is the engine's path:
`LayerStore.append` then the plan's quantized decode backend.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels import paged_attention_quant as quant
from kvcompile.kernels.online_step import OnlineStep

_ARGTYPES = ("const float*", "const float*", "const float*", "const int64_t*", "uint8_t*", "float*", "float*",
             "uint8_t*", "float*", "float*", "float*", "int64_t*", "float*", "const int64_t*", "int64_t*",
             "const int64_t*", "float*", "float*", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const float", "const int64_t", "const int64_t", "const int64_t", "const int64_t",
             "int64_t*")

# The paged kernel's text is compiled first with its entry renamed; cpp_prefix.h is included before the
# rename (it is included once), so no name in torch's headers changes.
_PRELUDE = "#include <torch/csrc/inductor/cpp_prefix.h>\n#define kernel kvcompile_paged_attention_quant\n"


def source(g: int, d: int, group: int) -> str:
    """The fused step's C++ for G query heads per KV head, head dim d and `group` channels per scale (keys and
    values): paged_attention_quant.cpp (its entry renamed) followed by quant_step.cpp."""
    paged = quant.cpp_source(g, d, group, group)
    step = resources.files(__package__).joinpath("quant_step.cpp").read_text(encoding="utf-8")
    return _PRELUDE + paged + "\n#undef kernel\n" + step


@functools.cache
def _kernel(g: int, d: int, group: int):
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
    """The pages have the layout the kernel writes into in place: codes uint8 (P, S, d · bits / 8), scales and
    zero points float32 (P, S, d / group), and `counters_layout`."""
    kc, vc, ks, kz, vs, vz = pages.k_pages, pages.v_pages, pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero
    width, groups = d * bits // 8, d // group
    return (kc.dtype == torch.uint8 and vc.dtype == torch.uint8 and kc.shape[-1] == width
            and vc.shape[-1] == width and ks.dtype == torch.float32 and kz.dtype == torch.float32
            and vs.dtype == torch.float32 and vz.dtype == torch.float32 and ks.dim() == 3
            and ks.shape[-1] == groups and kz.shape == ks.shape and vs.shape == ks.shape and vz.shape == ks.shape
            and counters_layout(pages))


def quant_step_cpp(pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, scale: float, bits: int, group: int,
                   parallel_work: int = quant.PARALLEL_WORK, threads: int | None = None) -> Tensor | None:
    """The C++ step: the output (B, Hq, d), or None where it is not its case (the pages untouched).

    bits, group: the store's code width and channels per scale (the storage part's); parallel_work,
    threads: as `paged_attention_quant.paged_attention_quant_cpp` (one thread below parallel_work
    multiply-adds a call, else `threads`, default torch's)."""
    b, hq, d = q.shape
    h = k.shape[1]
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32 \
            or position.dtype != torch.long or q.device.type != "cpu" or not _layout(pages, d, bits, group):
        return None
    max_threads = torch.get_num_threads() if threads is None else threads
    runs = max(1, -(-quant.ITEMS_PER_THREAD * max_threads // (b * h)))  # bounds the runs the C++ side chooses
    work = torch.empty(b * h * runs * (hq // h) * (d + 2))
    out = torch.empty(b, hq, d)
    status = torch.empty(1, dtype=torch.long)
    _kernel(hq // h, d, group)(
        q if q.is_contiguous() else q.contiguous(), k if k.is_contiguous() else k.contiguous(),
        v if v.is_contiguous() else v.contiguous(), position if position.is_contiguous() else position.contiguous(),
        pages.k_pages, pages.k_scale, pages.k_zero, pages.v_pages, pages.v_scale, pages.v_zero, pages.score_pages,
        pages.pos_pages, pages.count_pages, pages.block_table, pages.lengths, pages.owned, work, out, b, h,
        pages.block_table.shape[-1], pages.k_pages.shape[1], float(scale), max_threads, quant.ITEMS_PER_THREAD,
        parallel_work if threads is None else 0, bits, status)
    return None if status.item() else out


@dataclass(frozen=True)
class CppQuantStep(OnlineStep):
    """The fused C++ step of a quantized store (`quant_step_cpp`): the new entry quantized into its slot, then
    the quantized paged kernel, one call a layer and step. bits, group: the storage part's code width and
    channels per scale; parallel_work: the paged kernel's one-thread bound (as CppQuantPagedAttention's)."""

    name: ClassVar[str] = "cpp"
    bits: int = 8
    group: int = 0
    parallel_work: int = quant.PARALLEL_WORK

    def runs(self, pages, query_heads: int) -> bool:
        return True

    def __call__(self, pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, split: Tensor | None,
                 scale: float) -> Tensor | None:
        return quant_step_cpp(pages, q, k, v, position, scale, self.bits, self.group, self.parallel_work)

    def build(self, group: int, head_dim: int) -> None:
        _kernel(group, head_dim, self.group)

    def describe(self) -> str:
        return (f"cpp, quantized pages (int{self.bits}, {self.group} channels a scale): the new entry quantized "
                f"into its slot, then the quantized paged kernel, one call (one thread below {self.parallel_work} "
                "multiply-adds, else torch's threads)")


def backend(bits: int, group: int) -> CppQuantStep:
    """The fused step for codes of `bits` with `group` channels per scale (a storage part's, group resolved
    for the head dim)."""
    return CppQuantStep(bits, group, quant.PARALLEL_WORK)
