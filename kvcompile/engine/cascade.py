"""LAVa's cascade (Alg. 2): after each layer of a prompt, the layer totals move with the entropy of the
layers scored so far, and every lower layer is re-selected among what it holds with its new total."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.engine.compress import choose, merge_slots, over_heads, store_layer
from kvcompile.store import Entries
from kvcompile.selection import select_and_merge

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache


def cascade(cache: KVCompileCache, layer: int, totals: Tensor) -> None:
    """LAVa Alg. 2 after `layer`: every lower layer is re-selected among what it holds with its
    new total. A lazy cascade (a nested heads rule: Plan.lazy_cascade) only counts what each
    layer would hold, max(protected, min(total, held)), and re-selects its pages when they hold
    more than twice that, and once more after the last layer: what it keeps is the same, in
    O(L log L) re-selections instead of L(L − 1)/2 (pages up to twice the budget meanwhile)."""
    plan, prompt = cache.plan, cache.prompt
    last = layer == plan.num_layers - 1
    if not plan.lazy_cascade:
        for lower in range(layer):
            recompress(cache, lower, totals[:, lower])
        if layer:  # what the layers below hold now, over all heads
            held = over_heads(plan, layer_sums(cache, range(layer), totals.device))
            prompt.held[:layer] = list(held.unbind(1))
        return
    if layer:  # what the pages of the layers below hold, over all heads (B, layer)
        hold = over_heads(plan, layer_sums(cache, range(layer), totals.device))
    for lower in range(layer):
        prompt.held[lower] = torch.maximum(prompt.protected, torch.minimum(totals[:, lower], prompt.held[lower]))
        pages_hold = hold[:, lower]
        if bool((pages_hold > prompt.held[lower]).any()) and (last or bool((pages_hold > 2 * prompt.held[lower]).any())):
            recompress(cache, lower, totals[:, lower])


def layer_sums(cache: KVCompileCache, layers, device: torch.device) -> Tensor:
    """(B, len(layers)) entries each of these layers' pages hold over this process's heads, on `device`
    (the layers' pages may live on several devices)."""
    return torch.stack([cache.stores[i].lengths.sum(-1).to(device) for i in layers], 1)


def recompress(cache: KVCompileCache, layer: int, total: Tensor) -> None:
    """Cascade step (LAVa Alg. 2): re-select a compressed layer with its new, smaller total. A total that
    covers every entry the layer holds (tokens and slots, in every sequence) keeps them all, evicting and
    merging nothing (the head budgets water-fill to what each head holds): that re-selection is skipped
    (most of a chunked prompt's cascade steps). Under tensor parallelism the store holds this rank's heads
    only, so every step runs."""
    policy = cache.policy
    store = cache.stores[layer]
    total = total.to(store.lengths.device)  # a later layer's step: it may run on another device
    if cache.plan.shard is None and bool((total >= store.lengths.sum(-1)).all()):
        return
    k, v, scores, pos, counts, stored = store.gather()
    is_token = stored & (torch.arange(k.shape[2], device=k.device) >= store.slots[..., None])
    slots = merge_slots(k, v, counts, stored, store.slots) if policy.merges else None
    ranks = None if cache.plan.shard is None else functools.partial(choose, cache, kernels=False)
    kept, merged = select_and_merge(policy, k, v, scores.masked_fill(~is_token, float("-inf")),
                                    pos, is_token, cache.prompt.lengths.to(k.device), total, layer, slots, ranks)
    cache.hold_store(layer, store_layer(cache, Entries(k, v, scores, pos, counts, kept), merged))

