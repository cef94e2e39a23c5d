"""The eager reference engine: the specification of every policy, in plain PyTorch.

Everything fast (runtime, kernels, compiled graphs) is tested against these functions.
Written for clarity, not speed.

Shapes: B batch, H KV heads, Hq = H·G query heads, N prompt tokens, d head dim.
Left padding: `mask` (B, N) is True for real tokens; a sequence's real tokens have
positions 0 … n_b − 1 (n_b = its real length) and pad tokens are never kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from kvcompile.policies import ranking as ranking_parts
from kvcompile.policies import scoring as scoring_parts


@dataclass
class LayerState:
    """One layer's prefill state, as the model computed it."""

    queries: Tensor  # (B, Hq, R, d): the last R prompt queries, after RoPE
    keys: Tensor  # (B, H, N, d), after RoPE
    values: Tensor  # (B, H, N, d)
    mask: Tensor | None = None  # (B, N) bool, True = real token; None = no padding
    scale: float | None = None  # softmax scale; None = d ** -0.5


@dataclass
class Merged:
    """Residual merge slots of one layer (ZSMerge §3.4)."""

    keys: Tensor  # (B, H, S, d)
    values: Tensor  # (B, H, S, d)
    counts: Tensor  # (B, H, S) long: tokens merged into the slot, 0 = empty


@dataclass
class Selection:
    """What a policy keeps of a prompt."""

    kept: list[Tensor]  # per layer: (B, H, N) bool, retained prompt tokens
    merged: list[Merged | None]  # per layer: residual slots, or None when the policy drops
    budgets: Tensor  # (B, L, H) long: tokens kept = kept[l].sum(-1)
    scores: list[Tensor]  # per layer: (B, H, N) float scores, -inf at padding


def attend(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor | None = None,
           lengths: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Decode attention over a compressed cache: the ground truth for every decode kernel.

    q: (B, Hq, T, d) queries (T new tokens, usually 1) that see every cache entry;
    keys, values: (B, H, S, d), entry s of head h valid when s < lengths[b, h];
    bias: (B, H, S) added to the logits (ZSMerge Eq. 8: α·log w, w = merge count);
    lengths: (B, H) long, None = all S valid. Returns (B, Hq, T, d).
    A head with no valid entry returns zeros.
    """
    b, hq, t, d = q.shape
    h = keys.shape[1]
    g = hq // h
    scale = d ** -0.5 if scale is None else scale
    k = keys.repeat_interleave(g, dim=1).float()
    v = values.repeat_interleave(g, dim=1).float()
    logits = torch.einsum("bhtd,bhsd->bhts", q.float(), k) * scale
    if bias is not None:
        logits = logits + bias.repeat_interleave(g, dim=1).float()[:, :, None, :]
    if lengths is not None:
        valid = torch.arange(keys.shape[2], device=keys.device) < lengths[..., None]  # (B, H, S)
        valid = valid.repeat_interleave(g, dim=1)[:, :, None, :]
        logits = logits.masked_fill(~valid, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # an empty head gives zeros
    return torch.einsum("bhts,bhsd->bhtd", weights, v).to(q.dtype)


# --- scoring -------------------------------------------------------------------------------

def query_rows(policy, n: int) -> int:
    """How many of the last prompt queries the policy's scorer reads (R of LayerState)."""
    return policy.scoring.query_rows(n)


def score_layer(policy, state: LayerState) -> Tensor:
    """The scoring part's scores (B, H, N), −inf at pads."""
    return policy.scoring.score(state)


def layer_entropy(scores: Tensor, valid: Tensor) -> Tensor:
    """LAVa Eq. 7–8: normalized entropy of a layer's scores over heads × valid tokens, (B,)."""
    return scoring_parts.entropy(scores, valid)


# --- budgets -------------------------------------------------------------------------------

def layer_totals(policy, lengths: Tensor, num_layers: int, num_heads: int, entropy: Tensor | None = None,
                 capacity: Tensor | None = None) -> Tensor:
    """Entries kept per layer, (B, L') long: integers adding up to the sequence's total
    (Budget.total over all `num_layers` layers), capped at min(total, L'·H·n_b).

    L' = num_layers, or for a cascade step the L' layers seen so far: `entropy` (B, L')
    (LAVa Alg. 2 line 10: the full total spread over the layers seen; uniform and pyramid
    layers then spread it over L' layers too). Water-filling: no layer exceeds H·n_b, nor
    its `capacity` (B, L') when given (the cascade passes what each seen layer still
    holds, so a layer is never given back entries it has already evicted).
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
        rows.append(budget.layer_totals(budget.total(n, num_heads, num_layers), caps, e))
    return torch.tensor(rows, dtype=torch.long, device=lengths.device).view(len(rows), seen)


class HeadBudgets(NamedTuple):
    """Per (sequence, KV head), (B, H) long each: see Budget.head_layout."""

    entries: Tensor  # B_{l,h}: tokens + residual slots
    tokens: Tensor  # prompt tokens kept
    slots: Tensor  # residual merge slots
    proximity: Tensor  # latest tokens protected by the split


def head_budgets(policy, valid: Tensor, total: Tensor, used_slots: Tensor | None = None) -> HeadBudgets:
    """Split each sequence's layer total (B,) over its heads: uniform shares, water-filled at
    what each head holds (valid (B, H, M) candidates + used_slots (B, H) occupied slots)."""
    tokens = valid.sum(-1)
    used = torch.zeros_like(tokens) if used_slots is None else used_slots
    rows = [policy.budget.head_layout(int(t), n, u, policy.merges)
            for t, n, u in zip(total.tolist(), tokens.tolist(), used.tolist())]
    table = torch.tensor(rows, dtype=torch.long, device=valid.device).view(*tokens.shape, 4)
    return HeadBudgets(*table.unbind(-1))


# --- selection -----------------------------------------------------------------------------

def latest(positions: Tensor, valid: Tensor, count: Tensor) -> Tensor:
    """The `count` (B, H) valid entries of each head with the largest positions (B, H, M)."""
    before_all = torch.iinfo(positions.dtype).min
    latest_first = torch.where(valid, positions, before_all).argsort(dim=-1, descending=True)
    recency = torch.empty_like(latest_first)
    recency.scatter_(-1, latest_first, torch.arange(positions.shape[-1], device=positions.device).expand_as(positions))
    return valid & (recency < count[..., None])


def select(policy, scores: Tensor, positions: Tensor, valid: Tensor, lengths: Tensor, total: Tensor | None,
           layer: int, used_slots: Tensor | None = None) -> Tensor:
    """The entries a layer keeps, (B, H, M) bool, among M candidates per head.

    scores, positions (original prompt positions), valid: (B, H, M); lengths (B,) real
    prompt lengths n_b; total (B,) the layer's entries (tokens + residual slots), None
    under a threshold; used_slots (B, H) merge slots already occupied (cascade).
    Protected (sinks, window, split proximity) are always kept; pads never. Then:
    threshold (DBudgetKV Alg. 1, per head) or the heads part (uniform: each head its
    best up to its budget; pooled: one top-k over the layer, LAVa Alg. 1 / AdaKV).
    The candidates may be a compressed set: the cascade re-selects the kept entries.
    """
    valid = valid.bool()
    ranks = ranking_parts.rank(policy.ranking, scores, positions, valid)
    protected = policy.ranking.protected(positions, lengths.view(-1, 1, 1)) & valid
    threshold = policy.budget.threshold
    if threshold is not None:
        if layer < threshold.keep_layers:
            return valid.clone()
        return torch.stack([threshold.keep(ranks[b], protected[b], valid[b], scores[b])
                            for b in range(len(valid))])
    if total is None:
        raise ValueError("select needs the layer's total unless the policy has a threshold")
    heads = head_budgets(policy, valid, total, used_slots)
    protected |= latest(positions, valid, heads.proximity)
    return torch.stack([policy.budget.heads.keep(ranks[b], protected[b], valid[b], heads.tokens[b], int(total[b]))
                        for b in range(len(valid))])


# --- merge -----------------------------------------------------------------------------------

def merge_evicted(policy, keys: Tensor, values: Tensor, scores: Tensor, evicted: Tensor,
                  slots: Merged | None = None, num_slots: Tensor | None = None,
                  positions: Tensor | None = None) -> Merged | None:
    """ZSMerge §3.4: merge the evicted entries (B, H, M) bool into residual slots.

    keys, values (B, H, M, d), scores (B, H, M). Evicted entries merge one at a time in
    ascending score order (ties: earlier position first; `positions` (B, H, M), default the
    entry order). `slots`: the slots already held (None = none yet); `num_slots` (B, H):
    the slots each head has now (head_budgets(...).slots), default the size of `slots`.
    When a head has fewer slots than it holds, the surplus slots fold into the others
    first (Residual.shrink). Returns None when the policy drops.
    """
    if not policy.merges:
        return None
    rule = policy.merge
    b_, h_, m, d = keys.shape
    if num_slots is None:
        if slots is None:
            raise ValueError("merge_evicted needs num_slots (head_budgets(...).slots) when no slots exist yet")
        num_slots = torch.full((b_, h_), slots.counts.shape[-1], dtype=torch.long)
    size = int(num_slots.max()) if num_slots.numel() else 0
    out = Merged(keys.new_zeros(b_, h_, size, d), values.new_zeros(b_, h_, size, values.shape[-1]),
                 torch.zeros(b_, h_, size, dtype=torch.long, device=keys.device))
    if positions is None:
        positions = torch.arange(m, device=keys.device).expand(b_, h_, m)
    for b in range(b_):
        for h in range(h_):
            n = int(num_slots[b, h])
            if slots is None:
                held = keys.new_zeros(0, d), values.new_zeros(0, values.shape[-1]), out.counts.new_zeros(0)
            else:
                held = rule.shrink(slots.keys[b, h], slots.values[b, h], slots.counts[b, h], n)
            k_r, v_r, w = (torch.cat([x, x.new_zeros(n - len(x), *x.shape[1:])]) for x in held)
            idx = evicted[b, h].nonzero().squeeze(1)
            idx = idx[positions[b, h, idx].argsort(stable=True)]  # earlier position first …
            idx = idx[scores[b, h, idx].argsort(stable=True)]  # … among equal scores, ascending
            k_r, v_r, w = rule.merge(k_r, v_r, w, keys[b, h, idx], values[b, h, idx])
            out.keys[b, h, :n], out.values[b, h, :n], out.counts[b, h, :n] = k_r, v_r, w
    return out


# --- the whole prompt ------------------------------------------------------------------------

def _held_slots(merged: Merged | None, like: Tensor) -> Tensor:
    """(B, H) occupied merge slots."""
    if merged is None:
        return torch.zeros(like.shape[:2], dtype=torch.long, device=like.device)
    return (merged.counts > 0).sum(-1)


def select_and_merge(policy, keys: Tensor, values: Tensor, scores: Tensor, positions: Tensor, candidates: Tensor,
                     lengths: Tensor, total: Tensor | None, layer: int, slots: Merged | None = None):
    """One compression of one layer: select among the candidate tokens (B, H, M), then merge
    the evicted ones into the layer's residual slots (`slots` = those it already holds,
    None at its first compression). The prefill step and every cascade re-selection.
    Returns kept (B, H, M) bool and the new Merged (None when the policy drops)."""
    used = _held_slots(slots, candidates)
    kept = select(policy, scores, positions, candidates, lengths, total, layer, used_slots=used)
    if not policy.merges:
        return kept, None
    num_slots = head_budgets(policy, candidates, total, used).slots if total is not None else torch.zeros_like(used)
    merged = merge_evicted(policy, keys, values, scores, candidates & ~kept, slots, num_slots, positions)
    return kept, merged


def compress(policy, states: list[LayerState]) -> Selection:
    """What a policy keeps of a prompt, layer by layer as prefill goes (DESIGN.md §2).

    Each layer: score_layer → select → merge_evicted. Layer-dynamic policies (layers:
    entropy, or schedule cascade) run LAVa Alg. 2 literally: after layer l, the totals
    of layers 0 … l are recomputed over the layers seen (the full total spread over
    them, capped at what each still holds) and every seen layer is re-selected among
    its kept entries with its new total (the evicted ones merged when the policy merges).
    """
    first = states[0]
    b_, h_, n_, _ = first.keys.shape
    num_layers = len(states)
    mask = torch.ones(b_, n_, dtype=torch.bool, device=first.keys.device) if first.mask is None else first.mask.bool()
    valid = mask[:, None, :].expand(b_, h_, n_)
    lengths = mask.sum(-1)
    positions = (mask.long().cumsum(-1) - 1)[:, None, :].expand(b_, h_, n_)  # left pads get −1
    has_threshold = policy.budget.threshold is not None
    dynamic = policy.layer_dynamic and not has_threshold
    totals = None if (has_threshold or dynamic) else layer_totals(policy, lengths, num_layers, h_)

    scores, kept, merged, entropy = [], [], [], []

    def compress_layer(j: int, total: Tensor | None) -> None:
        kept[j], merged[j] = select_and_merge(policy, states[j].keys, states[j].values, scores[j], positions,
                                              kept[j], lengths, total, j, merged[j])

    for layer, state in enumerate(states):
        scores.append(score_layer(policy, state))
        kept.append(valid.clone())  # the layer holds its whole prompt until compressed
        merged.append(None)
        if not dynamic:
            compress_layer(layer, None if totals is None else totals[:, layer])
            continue
        entropy.append(layer_entropy(scores[layer], valid))
        held = torch.stack([k.sum((1, 2)) + _held_slots(m, k).sum(-1) for k, m in zip(kept, merged)], dim=1)
        step = layer_totals(policy, lengths, num_layers, h_, entropy=torch.stack(entropy, dim=1), capacity=held)
        for j in range(layer + 1):
            compress_layer(j, step[:, j])
    budgets = torch.stack([k.sum(-1) for k in kept], dim=1)
    return Selection(kept, merged, budgets, scores)


def compressed_cache(policy, state: LayerState, kept: Tensor, merged: Merged | None):
    """One layer's compressed cache as `attend` takes it: per head the kept tokens in
    position order, then the occupied merge slots; returns keys, values (B, H, S, d),
    bias (B, H, S) (0 for tokens, α·log w for slots; None when the policy drops) and
    lengths (B, H)."""
    b_, h_, _, d = state.keys.shape
    parts = []
    for b in range(b_):
        for h in range(h_):
            k, v = state.keys[b, h, kept[b, h]], state.values[b, h, kept[b, h]]
            bias = k.new_zeros(len(k), dtype=torch.float32)
            if merged is not None:
                full = merged.counts[b, h] > 0
                k = torch.cat([k, merged.keys[b, h, full]])
                v = torch.cat([v, merged.values[b, h, full]])
                bias = torch.cat([bias, policy.merge.bias(merged.counts[b, h, full])])
            parts.append((k, v, bias))
    size = max(len(k) for k, _, _ in parts)
    keys = state.keys.new_zeros(b_, h_, size, d)
    values = state.values.new_zeros(b_, h_, size, state.values.shape[-1])
    bias = torch.zeros(b_, h_, size)
    lengths = torch.zeros(b_, h_, dtype=torch.long)
    for i, (k, v, c) in enumerate(parts):
        b, h = divmod(i, h_)
        keys[b, h, :len(k)], values[b, h, :len(k)], bias[b, h, :len(k)], lengths[b, h] = k, v, c, len(k)
    return keys, values, (bias if merged is not None else None), lengths
