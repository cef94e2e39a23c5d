"""One decode step of a layer whose scores run (H2O, ZSMerge) or that evicts online (ZSMerge
Alg. 1), fused: what the engine's Python path does in `LayerStore.append` + `_attend_with_probs` +
`_update_scores` + `evict_online` + `merge_victims` + `LayerStore.remove_where`, in one call.

    out = online_step_cpp(pages, q, k, v, position, split, rule, scale)   # None: not run

pages: a layer's page tensors (`kvcompile.store.PageTensors`, `LayerStore.tensors()`: docs/INTERNALS.md
"Paged cache layout"), updated in place;
q (B, Hq, d), k, v (B, H, d) the new token's query, key and value of every head; position
(B,) long its logical position; split (B, H, 3) long the ZSMerge (proximity, context,
residual) of every head (`DecodeState.split[:, layer]`), or None when nothing is evicted;
rule: the plan's `StepRule` (numbers read off the parts: the running update λ·s + a, λ = 1
for accumulated; the GQA reduce; the merge bias α·log w; whether to evict). Returns the
attention output (B, Hq, d). Semantics, all heads at once (each head independent):
1. the new entry is appended (score 0, count 1);
2. attention of the G query heads over the head's entries with logit bias α·log w (−inf for
   an empty slot, w = 0; no bias at all when the rule has none);
3. running scores of the token entries (position ≥ 0): s ← λ·s + a, a = the attention
   reduced over the group (mean | max);
4. evicting: while the head holds more tokens than proximity + context, its lowest running
   score outside the latest `proximity` tokens (ties: the earliest position) leaves: into a
   free residual slot in place (position −1 − r, score 0), else folded into the slot r of
   largest k_r·k (ties: the lowest r), k_r ← (w·k_r + k)/(w + 1), the same for v, w ← w + 1,
   and removed (the head's last entry moves into its place); with no slot it is dropped.

Impls (`kvcompile.kernels.choice.resolve("online_step", ...)`): "cpp" (online_step.cpp beside
this module, built with Inductor's C++ toolchain once per (G, d), as paged_attention_cpp;
fp32 CPU, any head dim, one thread, no host sync) and "torch" (the runtime's own Python path,
kvcompile.engine.decode and kvcompile.engine.online: LayerStore.append, _attend_with_probs, _update_scores,
evict_online). The C++ kernel
runs the common case of a decode step: every head's next entry has a page and at most one
token leaves; otherwise (a head taking a fresh page, the first step after a prompt that filled
the cache: several rounds) it changes nothing and returns None, and the runtime's path runs
that step. The two agree exactly on evictions, positions, slots, counts, keys and values
(tests/test_online_step.py); scores and outputs up to float summation order (the softmax,
the GQA mean).

Backends (`Plan.online_step`): `CppOnlineStep` (the C++ kernel, with the plan's StepRule and when it
runs: every step where scores run or tokens leave, else only below `one_thread_work` multiply-adds, where
the paged-attention kernel would run on one thread anyway) and `TorchOnlineStep` (the runtime's path:
`runs` is False). `backend.runs(pages, query_heads)` says whether `backend(pages, q, k, v, position,
split, scale)` is called for a step. The same slot and call hold the fused steps of quantized stores:
`kernels.quant_step.CppQuantStep` (codes per token) and `kernels.tiered_step.CppTieredStep` (two tiers).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels import paged_attention_cpp
from kvcompile.kernels.paged_attention_cpp import load_cpp
from kvcompile.kernels.backend import KernelBackend

_ARGTYPES = ["const float*", "const float*", "const float*", "const int64_t*", "float*", "float*", "float*",
             "int64_t*", "float*", "const int64_t*", "int64_t*", "int64_t*", "const int64_t*", "const int64_t*",
             "float*", "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const float",
             "const int64_t", "const float", "const int64_t", "const int64_t", "const double*", "const int64_t",
             "int64_t*"]


def _kernel(g: int, d: int):
    return load_cpp(tuple(_ARGTYPES), "online_step.cpp", G=g, D=d)


@functools.cache
def _alpha(alpha: float) -> Tensor:
    """α as a float64 scalar tensor: the bias is computed in double, as MergeRule.bias does."""
    return torch.tensor([alpha], dtype=torch.float64)


_NO_SPLIT = torch.zeros(1, 3, dtype=torch.long)


def _writable_layout(pages) -> bool:
    """The page tensors have the layout the C++ kernel writes into in place."""
    return (pages.k_pages.dtype == torch.float32 and pages.v_pages.dtype == torch.float32
            and pages.lengths.dtype == torch.long and pages.slots.dtype == torch.long
            and pages.block_table.dtype == torch.long and pages.owned.dtype == torch.long
            and pages.k_pages.is_contiguous() and pages.v_pages.is_contiguous()
            and pages.lengths.is_contiguous() and pages.slots.is_contiguous()
            and pages.block_table.is_contiguous() and pages.owned.is_contiguous())


def online_step_cpp(pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, split: Tensor | None,
                    rule, scale: float) -> Tensor | None:
    """The C++ kernel: the output (B, Hq, d), or None when the common case does not hold for
    some head (the pages are then untouched)."""
    b, hq, d = q.shape
    h = k.shape[1]
    if not _writable_layout(pages) or q.dtype != torch.float32 or k.dtype != torch.float32 \
            or v.dtype != torch.float32 or position.dtype != torch.long:
        return None
    out = torch.empty(b, hq, d)
    status = torch.empty(1, dtype=torch.long)
    if split is not None and not split.is_contiguous():
        split = split.contiguous()
    _kernel(hq // h, d)(
        q if q.is_contiguous() else q.contiguous(), k if k.is_contiguous() else k.contiguous(),
        v if v.is_contiguous() else v.contiguous(), position, pages.k_pages, pages.v_pages, pages.score_pages,
        pages.pos_pages, pages.count_pages, pages.block_table, pages.lengths, pages.slots, pages.owned,
        _NO_SPLIT if split is None else split, out, b, h, pages.block_table.shape[-1], pages.k_pages.shape[1],
        float(scale), int(rule.decay is not None), float(rule.decay or 0.0), int(rule.gqa_max),
        int(rule.alpha is not None), _alpha(float(rule.alpha or 0.0)), int(rule.evict and split is not None),
        status)
    return None if int(status[0]) else out


@dataclass(frozen=True)
class OnlineStep(KernelBackend):
    """A decode step backend: `runs(pages, query_heads)` whether this step goes through it, and
    `backend(pages, q, k, v, position, split, scale)` -> the output (B, Hq, d), or None where the
    kernel's common case does not hold (the pages untouched; the engine's path runs that step)."""

    name: ClassVar[str]

    def runs(self, pages, query_heads: int) -> bool:
        return False

    def __call__(self, pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, split: Tensor | None,
                 scale: float) -> Tensor | None:
        return None




@dataclass(frozen=True)
class TorchOnlineStep(OnlineStep):
    """The engine's own Python path (LayerStore.append, _attend_with_probs, _update_scores, evict_online)."""

    name: ClassVar[str] = "torch"

    def describe(self) -> str:
        return "torch (the engine's path)"


@dataclass(frozen=True)
class CppOnlineStep(OnlineStep):
    """The fused C++ step (`online_step_cpp`) computing `rule`. always: every step runs it (scores run
    or tokens leave online); else (append + attention only) a step runs it where it has fewer than
    `one_thread_work` multiply-adds (entries · query heads per KV head · d, the paged-attention C++
    kernel's one-thread bound): the separate append and paged-attention calls cost ~0.1 ms a layer in
    small torch ops there, and the fused step runs on one thread."""

    name: ClassVar[str] = "cpp"
    rule: object = None  # kvcompile.plan.StepRule
    always: bool = True
    one_thread_work: int = paged_attention_cpp.PARALLEL_WORK

    def runs(self, pages, query_heads: int) -> bool:
        if self.always:
            return True
        heads = pages.lengths.shape[1]
        return int(pages.lengths.sum()) * (query_heads // heads) * pages.k_pages.shape[-1] < self.one_thread_work

    def __call__(self, pages, q, k, v, position, split, scale):
        return online_step_cpp(pages, q, k, v, position, split, self.rule, scale)

    def build(self, group: int, head_dim: int) -> None:
        _kernel(group, head_dim)

    def describe(self) -> str:
        when = "every step" if self.always else f"steps below {self.one_thread_work} multiply-adds (one thread)"
        return f"cpp ({when}; {self.rule})"


def backend(name: str, rule=None, always: bool = True) -> OnlineStep:
    """The backend of impl `name` (one `choice.resolve("online_step", ...)` returned)."""
    if name == "cpp":
        return CppOnlineStep(rule, always, paged_attention_cpp.PARALLEL_WORK)
    return TorchOnlineStep()
