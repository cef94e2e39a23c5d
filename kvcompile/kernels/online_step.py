"""The decode step's backends: what the plan chose, once, to run a layer's decode step (append the new token's
entry, attend, and where the policy has them update running scores and evict online), called once a layer and
step with one signature and never declining a step (FlashInfer's shape: the plan is made once, `run` per layer):

    out = plan.decode_step(plan, store, layer, q, k, v, position, split, scale)    # (B, Hq, d)

store: the layer's page store (kvcompile.store; every head's next entry has a page: the engine makes room
before the step, `store.make_room`, the append's named host read); q (B, Hq, d), k, v (B, H, d) the new token's
query, key and value of every head; position (B,) long its logical position; split (B, H, 3) long the ZSMerge
(proximity, context, residual) of every head (`DecodeState.split[:, layer]`), or None when nothing is evicted.

The family (`DecodeStep`; each declares the stores it computes, `stores`, and the plan refuses a step that does
not cover its store, dtype or device: `refuses`):
- `kvcompile.engine.online.TorchStep`: the step in torch ops (`LayerStore.append`, then the plan's decode
  attention backend: torch, compiled, C++ or Triton; running scores and online eviction in torch). Complete:
  every store, dtype, device and policy; the plan's choice wherever no fused kernel computes the policy.
- `CppOnlineStep` (kvcompile.store.pages, the store's: the C++ here): the fused C++ step of a float store whose scores run (H2O, ZSMerge) or that evicts
  online (ZSMerge Alg. 1), or of a plain step where the paged C++ kernel does not take the head dim; one thread.
- `kvcompile.store.pages.CppAppendStep` (its C++: kernels.append_step): append, then the paged C++ kernel, one call (fp32 pages or
  int8 / int4 codes per token).
- `kvcompile.kernels.tiered_step.CppTieredStep`: a two-tier store (codes and floats), one call.

`CppOnlineStep` is online_step.cpp beside this module, built with Inductor's C++ toolchain once per (G, d)
(fp32 CPU, any head dim, one thread, no host read). It computes what the torch step does in `LayerStore.append`
+ `_attend_with_probs` + `_update_scores` + `evict_online` + `merge_victims` + `LayerStore.remove_where`
(kvcompile.engine.online), all heads at once (each head independent), with the plan's `StepRule` (numbers read
off the parts: the running update λ·s + a, λ = 1 for accumulated; the GQA reduce; the merge bias α·log w;
whether to evict):
1. the new entry is appended (score 0, count 1);
2. attention of the G query heads over the head's entries with logit bias α·log w (−inf for an empty slot,
   w = 0; no bias at all when the rule has none);
3. running scores of the token entries (position ≥ 0): s ← λ·s + a, a = the attention reduced over the group
   (mean | max);
4. evicting: while the head holds more tokens than proximity + context (once a step when it is within its
   budget; several times at the first step after a prompt that filled the cache), its lowest running score
   outside the latest `proximity` tokens (ties: the earliest position) leaves: into a free residual slot in
   place (position −1 − r, score 0), else folded into the slot r of largest k_r·k (ties: the lowest r),
   k_r ← (w·k_r + k)/(w + 1), the same for v, w ← w + 1, and removed (the head's last entry moves into its
   place); with no slot it is dropped.
The two agree exactly on evictions, positions, slots, counts, keys and values (tests/test_online_step.py);
scores and outputs up to float summation order (the softmax, the GQA mean).
"""
from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels.paged_attention_cpp import load_cpp
from kvcompile.kernels.backend import KernelBackend

_ARGTYPES = ["const float*", "const float*", "const float*", "const int64_t*", "float*", "float*", "float*",
             "int64_t*", "float*", "const int64_t*", "int64_t*", "int64_t*", "const int64_t*", "const int64_t*",
             "float*", "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const float",
             "const int64_t", "const float", "const int64_t", "const int64_t", "const double*", "const int64_t",
             "int64_t*"]


@functools.cache
def _kernel(g: int, d: int):
    return load_cpp(tuple(_ARGTYPES), "online_step.cpp", G=g, D=d)


@functools.cache
def _alpha(alpha: float) -> Tensor:
    """α as a float64 scalar tensor: the bias is computed in double, as MergeRule.bias does."""
    return torch.tensor([alpha], dtype=torch.float64)


class DecodeStep(KernelBackend):
    """A decode step backend: `backend(plan, store, layer, q, k, v, position, split, scale)` -> the output
    (B, Hq, d), the module docstring's contract. `stores`: the store classes (kvcompile.store, by name) it
    computes; `refuses(plan)`: why it cannot run a plan's steps (None: it can), checked when the plan is made.
    (A C++ step's fp32 CPU tensors are `build_plan`'s choice, `choice.resolve`; a plan moved to another device
    after it is refused at its step by the op, engine.op.run_layer.)"""

    name: ClassVar[str]
    stores: ClassVar[tuple[str, ...]] = ()

    def refuses(self, plan) -> str | None:
        if plan.store is not None and plan.store.__name__ not in self.stores:
            return f"it computes {' | '.join(self.stores)} layers, and this policy's are {plan.store.__name__}"
        return None

    def __call__(self, plan, store, layer: int, q: Tensor, k: Tensor, v: Tensor, position: Tensor,
                 split: Tensor | None, scale: float) -> Tensor:
        raise NotImplementedError
