"""One decode step of a layer whose step is an append and an attention (no running scores, no online eviction),
fused into one C++ call: the pages of a `LayerStore` (fp32) or of a `CodeStore` (int8 / int4 codes, keys and
values per token). This module is the C++ (its text and its build); the call on a store's tensors is the
store's (kvcompile.store.pages `append_step_cpp`, the plan's `CppAppendStep`). What `LayerStore.append` (for codes `quantize.quantize_pair_into_pages`) and the plan's
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

The append alone (step 1, every head of every row: a batched decode step's write before its attention backend's
one call, kvcompile.store.pages `CppAppend`) is the same C++ built with KVCOMPILE_APPEND_ONLY (`_append_kernel`,
once per (d, fp32 or codes, group)):

    append_cpp(pages, k, v, position, bits, group)   # kvcompile.store.pages: status 1 where a head has no page

Backend (`Plan.decode_step`, the decode-step family of kernels.online_step): kvcompile.store.pages
`CppAppendStep(bits, group, parallel_work)`, bits 32 for fp32 pages (group unused), chosen by the plan for a policy of that store with
neither running scores nor online eviction nor merge slots beside codes, on the CPU for fp32 where the paged
C++ kernel runs (head dim and group multiples of 16).
"""
from __future__ import annotations

import functools
from importlib import resources

from kvcompile.kernels import paged_attention_cpp as paged

_ARGTYPES = ("const float*", "const float*", "const float*", "const int64_t*", "uint8_t*", "float*", "float*",
             "uint8_t*", "float*", "float*", "float*", "int64_t*", "float*", "const int64_t*", "int64_t*",
             "const int64_t*", "float*", "float*", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const float", "const int64_t", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const double*", "float*", "const int64_t", "int64_t*")
_APPEND_ARGTYPES = ("const float*", "const float*", "const int64_t*", "uint8_t*", "float*", "float*", "uint8_t*",
                    "float*", "float*", "float*", "int64_t*", "float*", "const int64_t*", "int64_t*", "const int64_t*",
                    "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t", "int64_t*")
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


@functools.cache
def _append_kernel(d: int, group: int | None):
    """The append alone (append_step.cpp's entry with KVCOMPILE_APPEND_ONLY), for head dim d and fp32 pages (group
    None) or codes of `group` channels per scale."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(list(_APPEND_ARGTYPES),
                                                     "#define KVCOMPILE_APPEND_ONLY 1\n" + source(1, d, group))
