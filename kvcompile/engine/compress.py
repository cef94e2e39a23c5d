"""What a layer keeps: the selection of its candidates (by the plan's selection kernels, or under tensor
parallelism over what the ranks gather), the merge of the prompt's evicted tokens into residual slots, and
the pages that hold the result. Every compression runs through here: a prompt's layer (engine.prefill),
a chunk (engine.chunked), the cascade's re-selection (engine.cascade) and `decode: every` pruning."""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.allocation import head_budgets, head_budgets_of
from kvcompile.store import Entries
from kvcompile.selection import Merged, merge_evicted, select, select_with

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache


def choose(cache: KVCompileCache, scores: Tensor, positions: Tensor, valid: Tensor, lengths: Tensor,
           total: Tensor | None, layer: int, used: Tensor | None = None, *, kernels: bool, every=None,
           same_heads: bool = False):
    """The selection of this process's heads and their HeadBudgets (None under a threshold):
    kept (B, H', M) bool; lengths (B,) the sequences' real lengths. With one process, `select` over its heads (the kernels', or
    kvcompile.selection's where a layer is re-selected). Under tensor parallelism, exactly what
    one process selects over all heads (Plan.heads_exchange): "counts": every head's candidate
    and slot counts (B, H, 2) are gathered for the head budgets and each head selects from its
    own scores (`same_heads`: a prompt, where every head has the same candidates and no slots:
    nothing to gather); "scores": every head's candidates (`every`: scores, positions, valid, used,
    when the caller has them; else gathered) and the selection over all heads, of which this rank
    keeps its heads' part."""
    plan = cache.plan
    with plan.selection.serial() if kernels else contextlib.nullcontext():
        policy, shard = plan.policy, plan.shard
        run = functools.partial(select_with, plan.selection) if kernels else select
        if used is None:
            used = torch.zeros(valid.shape[:2], dtype=torch.long, device=valid.device)
        if plan.heads_exchange != "scores":
            budgets = None
            if total is not None:
                counts = torch.stack([valid.sum(-1), used], dim=-1)
                if same_heads:
                    counts = counts[:, :1].expand(-1, plan.num_heads, -1)
                elif shard is not None:  # (B, H/P, 2) candidates and used slots of each head → (B, H, 2)
                    counts = shard.gather_heads(counts)
                budgets = head_budgets_of(policy, counts[..., 0], total, counts[..., 1]).heads(plan.heads)
            return run(policy, scores, positions, valid, lengths, total, layer, used, budgets=budgets), budgets
        s, p, v, u = shard.gather_entries(scores, positions, valid, used) if every is None else every
        budgets = None if total is None else head_budgets(policy, v, total, u)
        kept = shard.local(run(policy, s, p, v, lengths, total, layer, u, budgets=budgets))[..., :valid.shape[-1]]
        return kept, None if budgets is None else budgets.heads(plan.heads)


def select_and_merge_kernels(cache: KVCompileCache, k, v, scores, positions, valid, total, layer, every=None):
    """A layer's first compression: the selection kernels (kvcompile.kernels.select: equal to
    selection.select), then the evicted tokens merged into the merge slots: by the merge
    kernel the plan names (kvcompile.kernels.merge: the same sequential rule, bit for bit),
    else by the merge rule itself, head by head (selection.merge_evicted). `every`: every
    head's candidates when a tensor-parallel rank has gathered them (see choose); in a prompt every
    head has the same candidates."""
    plan = cache.plan
    policy = plan.policy
    kept, budgets = choose(cache, scores, positions, valid, cache.prompt.lengths, total, layer, kernels=True,
                           every=every, same_heads=True)
    if not policy.merges:
        return kept, None
    b, h, _, d = k.shape
    if total is None:  # a threshold gives no slots: the evicted tokens are dropped
        return kept, Merged(k.new_zeros(b, h, 0, d), v.new_zeros(b, h, 0, v.shape[-1]),
                            torch.zeros(b, h, 0, dtype=torch.long, device=k.device))
    num_slots = budgets.slots
    if plan.prompt_merge is None:
        return kept, merge_evicted(policy, k, v, scores, valid & ~kept, None, num_slots, positions)
    from kvcompile.kernels.merge import merge_order

    keys, values, num = merge_order(k, v, scores, valid & ~kept, positions)
    size = int(num_slots.max())
    sk, sv, counts = plan.prompt_merge(k.new_zeros(b, h, size, d), v.new_zeros(b, h, size, v.shape[-1]),
                                       torch.zeros(b, h, size, dtype=torch.long, device=k.device), keys, values,
                                       num, num_slots)
    return kept, Merged(sk, sv, counts)


def store_layer(cache: KVCompileCache, tokens: Entries, merged: Merged | None):
    """Pages for one layer: the occupied residual slots of each head first, then its kept tokens, in a
    store the page store lays out and the plan's gather kernel fills (kvcompile.kernels.select)."""
    b, h = tokens.take.shape[:2]
    sources = [tokens]
    slots = torch.zeros(b, h, dtype=torch.long, device=tokens.take.device)
    if merged is not None:
        counts = merged.counts
        occupied = counts > 0
        slots = occupied.sum(-1)
        sources.insert(0, Entries(merged.keys, merged.values, torch.zeros_like(counts, dtype=torch.float32),
                                  -1 - torch.arange(counts.shape[-1], device=counts.device).expand_as(counts),  # slot r at -1 - r
                                  counts.float(), occupied))
    return cache.plan.store.build(sources, slots, cache.page_size, gather=cache.plan.selection.gather_pages,
                                  storage=cache.policy.storage, dtype=cache.plan.dtype,
                                  reserve=cache.plan.spare_entries)


def merge_slots(keys: Tensor, values: Tensor, counts: Tensor, stored: Tensor, slot_count: Tensor) -> Merged:
    """The merge slots each head holds, the first `slot_count` (B, H) of a store's gathered entries (B, H, E, ·)
    (the cascade's re-selection, a chunk's), as `Merged`: counts 0 past a head's own slots."""
    size = int(slot_count.max())
    own = stored[:, :, :size] & (torch.arange(size, device=stored.device) < slot_count[..., None])
    return Merged(keys[:, :, :size], values[:, :, :size], torch.where(own, counts[:, :, :size], 0).long())


def over_heads(plan, x: Tensor) -> Tensor:
    """A count over this process's heads → over all heads (tensor parallelism: a sum over ranks)."""
    return x if plan.shard is None else plan.shard.total(x)

