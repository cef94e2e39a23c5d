"""Budgets in integers, shared by the reference engine and the runtime: layer totals, head
budgets, decode budgets, ZSMerge's split, and the protected / latest sets every selection
starts from. Exact arithmetic (kvcompile.policies.budgets.apportion); the parts decide
(docs/SPECS.md §2 "Budget"), these functions lay their answers out as tensors.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kvcompile.policies import ranking as ranking_parts
from kvcompile.policies.budgets import apportion


def layer_totals(policy, lengths: Tensor, num_layers: int, num_heads: int, entropy: Tensor | None = None,
                 capacity: Tensor | None = None, reserved: Tensor | None = None) -> Tensor:
    """Entries kept per layer, (B, L') long: integers adding up to the sequence's total
    (Budget.total over all `num_layers` layers), capped at min(total, L'·H·n_b).

    L' = num_layers, or for a cascade step the L' layers seen so far: `entropy` (B, L')
    (LAVa Alg. 2 line 10: the full total spread over the layers seen; uniform and pyramid
    layers then spread it over L' layers too). Water-filling: no layer exceeds H·n_b, nor
    its `capacity` (B, L') when given (the cascade passes what each seen layer still
    holds, so a layer is never given back entries it has already evicted). `reserved` (B,):
    entries held by the layers not seen yet (a chunked prompt's cascade: the layers above,
    still holding their previous chunk's entries); the seen layers share the total less
    these, never less than 0.
    """
    budget = policy.budget
    if budget.threshold is not None:
        raise ValueError("a threshold decides its budget itself: there are no layer totals")
    seen = num_layers if entropy is None else entropy.shape[1]
    rows = []
    for b, n in enumerate(lengths.tolist()):
        caps = [num_heads * n] * seen
        if capacity is not None:
            caps = [min(cap, int(c)) for cap, c in zip(caps, capacity[b].tolist())]
        e = None if entropy is None else entropy[b].tolist()
        total = budget.total(n, num_heads, num_layers)
        if reserved is not None:
            total = max(0, total - int(reserved[b]))
        rows.append(budget.layer_totals(total, caps, e))
    return torch.tensor(rows, dtype=torch.long, device=lengths.device).view(len(rows), seen)


class HeadBudgets(NamedTuple):
    """Per (sequence, KV head), (B, H) long each: see Budget.head_layout."""

    entries: Tensor  # B_{l,h}: tokens + residual slots
    tokens: Tensor  # prompt tokens kept
    slots: Tensor  # residual merge slots
    proximity: Tensor  # latest tokens protected by the split

    def heads(self, index: slice) -> "HeadBudgets":
        """The budgets of some heads (a tensor-parallel rank's), (B, H') each."""
        return HeadBudgets(*(x[:, index] for x in self))


def head_budgets(policy, valid: Tensor, total: Tensor, used_slots: Tensor | None = None) -> HeadBudgets:
    """Split each sequence's layer total (B,) over its heads: uniform shares, water-filled at
    what each head holds (valid (B, H, M) candidates + used_slots (B, H) occupied slots)."""
    tokens = valid.sum(-1)
    return head_budgets_of(policy, tokens, total, torch.zeros_like(tokens) if used_slots is None else used_slots)


def head_budgets_of(policy, tokens: Tensor, total: Tensor, used: Tensor) -> HeadBudgets:
    """head_budgets from what each head holds: tokens (B, H) candidates, used (B, H) occupied slots
    (what a tensor-parallel rank gathers instead of every head's candidates)."""
    rows = [policy.budget.head_layout(int(t), n, u, policy.merges)
            for t, n, u in zip(total.tolist(), tokens.tolist(), used.tolist())]
    table = torch.tensor(rows, dtype=torch.long, device=tokens.device).view(*tokens.shape, 4)
    return HeadBudgets(*table.unbind(-1))


def latest(positions: Tensor, valid: Tensor, count: Tensor) -> Tensor:
    """The `count` (B, H) valid entries of each head with the largest positions (B, H, M)."""
    before_all = torch.iinfo(positions.dtype).min
    latest_first = torch.where(valid, positions, before_all).argsort(dim=-1, descending=True)
    recency = torch.empty_like(latest_first)
    recency.scatter_(-1, latest_first, torch.arange(positions.shape[-1], device=positions.device).expand_as(positions))
    return valid & (recency < count[..., None])


def ranked(policy, scores: Tensor, positions: Tensor, valid: Tensor, lengths: Tensor):
    """What every selection starts from: valid as bool, the ranking part's order of the
    candidates (B, H, M) long, and the protected set (sinks, window) among the valid, with each
    head's floor of the layers rule (layers: global: its best ⌊floor·n⌋ other entries)."""
    valid = valid.bool()
    ranks = ranking_parts.rank(policy.ranking, scores, positions, valid)
    protected = policy.ranking.protected(positions, lengths.view(-1, 1, 1)) & valid
    return valid, ranks, protected | head_floor(policy, ranks, protected, valid, lengths)


def head_floor(policy, ranks: Tensor, protected: Tensor, valid: Tensor, lengths: Tensor) -> Tensor:
    """(B, H, M) each head's best `LayersRule.floor_tokens(n)` valid entries outside `protected`, by `ranks`
    (n = the per-head budget of the sequence's n_b = `lengths` real tokens); none for most layers rules."""
    budget = policy.budget
    free = valid & ~protected
    if not budget.layers.floors or budget.threshold is not None:  # (no read of the lengths back to the host)
        return torch.zeros_like(free)
    floor = [budget.layers.floor_tokens(budget.total(n, 1, 1)) for n in lengths.tolist()]
    if not any(floor):
        return torch.zeros_like(free)
    place = torch.empty_like(ranks)  # the entry's place among its head's free entries, best first
    order = torch.where(free, ranks, torch.iinfo(ranks.dtype).max).argsort(dim=-1)
    place.scatter_(-1, order, torch.arange(ranks.shape[-1], device=ranks.device).expand_as(ranks))
    return free & (place < torch.tensor(floor, device=ranks.device).view(-1, 1, 1))


class Pool(NamedTuple):
    """One sequence's entries of one layer outside the protected sets and floors, in the layer's keep
    order (the ranking's key descending, the later position, the lower head): what layers: global ranks."""

    key: Tensor  # (m,) float64: the ranking part's key
    position: Tensor  # (m,) long
    head: Tensor  # (m,) long


def layer_pool(policy, scores: Tensor, positions: Tensor, valid: Tensor, lengths: Tensor
               ) -> tuple[Tensor, list[Pool]]:
    """A layer's part of the global ranking, from every head's scores, positions, valid (B, H, M): the
    (B,) entries it keeps whatever the ranking says (protected and floors), and per sequence its Pool."""
    valid, ranks, protected = ranked(policy, scores, positions, valid, lengths)
    free = valid & ~protected
    key = policy.ranking.key(scores, positions)
    heads = torch.arange(scores.shape[1], device=scores.device).view(1, -1, 1).expand_as(positions)
    pools = []
    for b in range(len(valid)):
        order = ranks[b][free[b]].argsort()
        pools.append(Pool(key[b][free[b]][order], positions[b][free[b]][order], heads[b][free[b]][order]))
    return protected.sum((1, 2)), pools


def global_totals(policy, reserved: list[Tensor], pools: list[list[Pool]], lengths: Tensor, num_layers: int,
                  num_heads: int) -> tuple[Tensor, list[list[Pool]]]:
    """layers: global over the L' = len(pools) layers seen: per sequence, the best R = n·H·L − Σ reserved of
    all their pooled entries by one order (key descending, the later position, the lower layer, the lower
    head); layer j's total is reserved[j] + its entries among them. Returns the totals (B, L') and the pools
    cut to those entries: an entry outside the best R of some layers is outside the best R' ≤ R of more
    layers (R only shrinks as layers are added), so a later step needs nothing else."""
    device = lengths.device
    seen = len(pools)
    rows, cut = [], [[None] * len(lengths) for _ in range(seen)]
    for b, n in enumerate(lengths.tolist()):
        fixed = [int(r[b]) for r in reserved]
        parts = [pools[j][b] for j in range(seen)]
        sizes = [len(p.key) for p in parts]
        best = max(0, policy.budget.total(n, num_heads, num_layers) - sum(fixed))
        counts = sizes if best >= sum(sizes) else [0] * seen if best == 0 else _best_counts(parts, best, device)
        rows.append([f + c for f, c in zip(fixed, counts)])
        for j, p in enumerate(parts):
            cut[j][b] = Pool(*(x[:counts[j]] for x in p))
    return torch.tensor(rows, dtype=torch.long, device=device).view(len(rows), seen), cut


def _best_counts(parts: list[Pool], best: int, device: torch.device) -> list[int]:
    """How many entries of each layer's pool (each in its keep order) are among the `best` of all of them by
    the global order: the key descending, then the later position, the lower layer, the lower head. Without a
    sort: the best-th largest key t (a selection, O(m)); every entry above t is in, and of the entries equal to
    t the first by (position descending, layer, head) fill the rest. Each pool keeps a prefix: its entries
    above t come first in its own order, then its ties by position descending and head. On `device` (the layers'
    pools may live on several)."""
    keys = [p.key.to(device) for p in parts]
    key = torch.cat(keys)
    t = key.kthvalue(len(key) - best + 1).values
    counts = torch.stack([(k > t).sum() for k in keys])
    need = best - int(counts.sum())
    if need:
        tied = (key == t).nonzero().view(-1)  # layer by layer: (layer, position descending, head) order already
        layer = torch.cat([torch.full((len(k),), j, dtype=torch.long, device=device) for j, k in enumerate(keys)])
        position = torch.cat([p.position.to(device) for p in parts])[tied]
        first = layer[tied][torch.sort(position, descending=True, stable=True).indices[:need]]
        counts += torch.bincount(first, minlength=len(keys))
    return counts.tolist()


def head_split(policy, entries: int) -> tuple[int, int, int]:
    """ZSMerge Eq. 3 for one head of `entries` = B_{l,h}: (B_p, B_c, B_r)."""
    return policy.budget.split.parts(entries, policy.merges)


def decode_budgets(policy, lengths: Tensor, num_layers: int, num_heads: int, held: Tensor,
                   heads: slice | None = None) -> Tensor:
    """(B, L, H) entries each head may hold while decoding: its share of the policy's total
    without the prompt-length cap (a short prompt does not shrink the budget generation may
    fill), and never less than what it holds after prefill (layer-dynamic and threshold
    budgets keep their prefill result). `heads`: the heads `held` (B, L, H') holds, of the
    model's `num_heads` (a tensor-parallel rank's; default all)."""
    budget = policy.budget
    out = held.clone()
    if budget.threshold is not None or policy.layer_dynamic:
        return out
    big = 2 ** 40
    for b, n in enumerate(lengths.tolist()):
        layers = budget.layer_totals(budget.total(n, num_heads, num_layers), [big] * num_layers, None)
        for layer, total in enumerate(layers):
            shares = torch.tensor(apportion(total, [1] * num_heads, [big] * num_heads), device=held.device)
            out[b, layer] = torch.maximum(out[b, layer], shares if heads is None else shares[heads])
    return out
