"""The eager reference engine: the specification of every policy, in plain PyTorch.

Everything fast (runtime, kernels, compiled graphs) is tested against these functions.
Written for clarity, not speed.

Shapes: B batch, H KV heads, Hq = H·G query heads, N prompt tokens, d head dim.
Left padding: `mask` (B, N) is True for real tokens; a sequence's real tokens have
positions 0 … n_b − 1 (n_b = its real length) and pad tokens are never kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompile.allocation import (HeadBudgets, decode_budgets, head_budgets, head_split, latest,  # noqa: F401
                                  layer_totals, ranked)
from kvcompile.layer_state import LayerState
from kvcompile.policies import scoring as scoring_parts
from kvcompile.selection import (HeadEntries, Merged, decode_prune, merge_evicted, select,  # noqa: F401
                                 select_and_merge)
from kvcompile.selection import _held_slots


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

# --- selection -----------------------------------------------------------------------------

# --- merge -----------------------------------------------------------------------------------

# --- the whole prompt ------------------------------------------------------------------------

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


# --- decoding: policies that act while tokens are generated (DESIGN.md §2 "Schedule") ------------

def decode_heads(policy, state: LayerState, kept: Tensor, merged: Merged | None, scores: Tensor
                 ) -> list[list[HeadEntries]]:
    """The [b][h] HeadEntries of one layer after its prefill compression."""
    b_, h_, n_, _ = state.keys.shape
    mask = torch.ones(b_, n_, dtype=torch.bool) if state.mask is None else state.mask.bool()
    positions = mask.long().cumsum(-1) - 1
    heads = []
    for b in range(b_):
        row = []
        for h in range(h_):
            keep = kept[b, h]
            entry = HeadEntries(state.keys[b, h, keep], state.values[b, h, keep], positions[b, keep],
                                scores[b, h, keep].float(), torch.ones(int(keep.sum())))
            if merged is not None:
                for r in range(merged.counts.shape[-1]):
                    if merged.counts[b, h, r] > 0:
                        entry.add(merged.keys[b, h, r], merged.values[b, h, r], -1 - r, 0.0,
                                  float(merged.counts[b, h, r]))
            row.append(entry)
        heads.append(row)
    return heads


def _merge_one(policy, head: HeadEntries, e: int, slots: int) -> None:
    """Evict entry e of the head: it fills a free slot, or merges into the slot with the largest
    key dot product (ZSMerge Alg. 1 lines 11–15); dropped when the head has no slot."""
    key, value = head.keys[e], head.values[e]
    head.drop(e)
    if slots == 0:
        return
    is_slot = ~head.tokens()
    order = (-1 - head.positions[is_slot]).argsort()
    idx = is_slot.nonzero().squeeze(1)[order]
    pad = slots - len(idx)
    k_r = torch.cat([head.keys[idx], head.keys.new_zeros(pad, key.shape[-1])])
    v_r = torch.cat([head.values[idx], head.values.new_zeros(pad, value.shape[-1])])
    w = torch.cat([head.counts[idx].long(), torch.zeros(pad, dtype=torch.long)])
    k_r, v_r, w = policy.merge.merge(k_r, v_r, w, key[None], value[None])
    for r in range(slots):
        if r < len(idx):
            i = idx[r]
            head.keys[i], head.values[i], head.counts[i] = k_r[r], v_r[r], float(w[r])
        elif w[r] > 0:
            head.add(k_r[r], v_r[r], -1 - r, 0.0, float(w[r]))


def decode_step(policy, heads: list[list[HeadEntries]], q: Tensor, k: Tensor, v: Tensor, position: Tensor,
                budgets: Tensor, scale: float | None = None) -> Tensor:
    """One generated token at one layer: append it, attend, update running scores, and
    (decode: online, ZSMerge Alg. 1) evict the lowest-scored context token into the slots.

    q (B, Hq, d), k, v (B, H, d), position (B,) the new token's position, budgets (B, H)
    entries per head (decode_budgets). Returns the attention output (B, Hq, d).
    """
    b_, hq, d = q.shape
    h_ = k.shape[1]
    g = hq // h_
    scale = d ** -0.5 if scale is None else scale
    online = policy.schedule.decode is not None and policy.schedule.decode.online
    out = q.new_zeros(b_, hq, d, dtype=torch.float32)
    for b in range(b_):
        for h in range(h_):
            head = heads[b][h]
            head.add(k[b, h], v[b, h], int(position[b]), 0.0, 1.0)
            bias = torch.zeros(len(head.counts))
            if policy.merges:
                bias = torch.where(head.tokens(), 0.0, policy.merge.bias(head.counts))
            logits = q[b, h * g:(h + 1) * g].float() @ head.keys.float().T * scale + bias
            probs = torch.softmax(logits, dim=-1)  # (G, E)
            out[b, h * g:(h + 1) * g] = probs @ head.values.float()
            if policy.scoring.running:  # H2O: s ← s + a; ZSMerge Eq. 5: s ← λ·s + a
                a = policy.scoring.reduce_group(probs, 0)
                head.scores = torch.where(head.tokens(), policy.scoring.running_update(head.scores, a), head.scores)
            if online:
                prox, context, slots = head_split(policy, int(budgets[b, h]))
                while int(head.tokens().sum()) > prox + context:
                    tok = head.tokens()
                    recent = latest(head.positions[None], tok[None], torch.tensor([prox]))[0]
                    cand = (tok & ~recent).nonzero().squeeze(1)
                    cand = cand[head.positions[cand].argsort(stable=True)]  # ties: earliest position …
                    e = int(cand[head.scores[cand].argsort(stable=True)[0]])  # … lowest running score
                    _merge_one(policy, head, e, slots)
    return out.to(q.dtype)


