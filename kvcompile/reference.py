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
from kvcompile.policies.budgets import apportion, exact, round_half_up
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


def ranked(policy, scores: Tensor, positions: Tensor, valid: Tensor, lengths: Tensor):
    """What every selection starts from: valid as bool, the ranking part's order of the
    candidates (B, H, M) long, and the protected set (sinks, window) among the valid."""
    valid = valid.bool()
    ranks = ranking_parts.rank(policy.ranking, scores, positions, valid)
    return valid, ranks, policy.ranking.protected(positions, lengths.view(-1, 1, 1)) & valid


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
    valid, ranks, protected = ranked(policy, scores, positions, valid, lengths)
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


# --- decoding: policies that act while tokens are generated (DESIGN.md §2 "Schedule") ------------

@dataclass
class HeadEntries:
    """One (sequence, layer, KV head) cache while decoding: its entries, in no particular order.

    A token has its position (0, 1, … among the sequence's real tokens), count 1 and a
    running score; residual slot r has position −1 − r and count w (tokens merged in)."""

    keys: Tensor  # (E, d)
    values: Tensor  # (E, d)
    positions: Tensor  # (E,) long
    scores: Tensor  # (E,) float32
    counts: Tensor  # (E,) float32

    def tokens(self) -> Tensor:
        return self.positions >= 0

    def drop(self, e: int) -> None:
        keep = torch.arange(len(self.positions)) != e
        for name in ("keys", "values", "positions", "scores", "counts"):
            setattr(self, name, getattr(self, name)[keep])

    def add(self, key: Tensor, value: Tensor, position: int, score: float, count: float) -> None:
        self.keys = torch.cat([self.keys, key[None]])
        self.values = torch.cat([self.values, value[None]])
        self.positions = torch.cat([self.positions, self.positions.new_tensor([position])])
        self.scores = torch.cat([self.scores, self.scores.new_tensor([score])])
        self.counts = torch.cat([self.counts, self.counts.new_tensor([count])])


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


RUNNING_SCORERS = ("accumulated", "decayed")  # scorers whose score keeps running while decoding


def running_update(scoring, scores: Tensor, attention: Tensor) -> Tensor | None:
    """The running score of a token after one more query (None: the scorer has none).
    H2O: s ← s + a (accumulated); ZSMerge Eq. 5: s ← λ·s + a (decayed)."""
    if scoring.name == "accumulated":
        return scores + attention
    if scoring.name == "decayed":
        return scoring.decay * scores + attention
    return None


def head_split(policy, entries: int) -> tuple[int, int, int]:
    """ZSMerge Eq. 3 for one head of `entries` = B_{l,h}: (B_p, B_c, B_r)."""
    split = policy.budget.split
    r = round_half_up(exact(split.residual) * entries) if policy.merges else 0
    p = round_half_up(exact(split.proximity) * entries)
    return p, entries - p - r, r


def decode_budgets(policy, lengths: Tensor, num_layers: int, num_heads: int, held: Tensor) -> Tensor:
    """(B, L, H) entries each head may hold while decoding: its share of the policy's total
    without the prompt-length cap (a short prompt does not shrink the budget generation may
    fill), and never less than what it holds after prefill (layer-dynamic and threshold
    budgets keep their prefill result)."""
    budget = policy.budget
    out = held.clone()
    if budget.threshold is not None or policy.layer_dynamic:
        return out
    big = 2 ** 40
    for b, n in enumerate(lengths.tolist()):
        layers = budget.layer_totals(budget.total(n, num_heads, num_layers), [big] * num_layers, None)
        for layer, total in enumerate(layers):
            shares = apportion(total, [1] * num_heads, [big] * num_heads)
            out[b, layer] = torch.maximum(out[b, layer], torch.tensor(shares))
    return out


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
    online = policy.schedule.decode is not None and policy.schedule.decode.name == "online"
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
            gqa = getattr(policy.scoring, "gqa", "mean")
            a = probs.mean(0) if gqa == "mean" else probs.amax(0)
            new = running_update(policy.scoring, head.scores, a)
            if new is not None:
                head.scores = torch.where(head.tokens(), new, head.scores)
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


def decode_prune(policy, heads: list[list[HeadEntries]], ring: Tensor, lengths: Tensor, budgets: Tensor,
                 layer: int, scale: float | None = None) -> None:
    """`decode: every n`: re-score a layer's cached tokens and prune it back to its budget.

    Scores: the scorer's running score when it has one (H2O, ZSMerge); otherwise the scorer
    applied to the cached tokens in position order with `ring` (B, Hq, R, d), the queries of
    the latest R tokens (always cached: the spec requires ranking.window ≥ R). Then the
    prefill selection (select_and_merge) with the layer's total Σ_h budgets[b, h]; lengths
    (B,) are the sequences' current real lengths.
    """
    b_, h_ = len(heads), len(heads[0])
    g = ring.shape[1] // h_
    width = max(int(head.tokens().sum()) for row in heads for head in row)
    d = heads[0][0].keys.shape[-1]
    keys = ring.new_zeros(b_, h_, width, d)
    values = torch.zeros_like(keys)
    scores = torch.full((b_, h_, width), float("-inf"))
    positions = torch.full((b_, h_, width), -1, dtype=torch.long)
    valid = torch.zeros(b_, h_, width, dtype=torch.bool)
    slot_width = max(int((~head.tokens()).sum()) for row in heads for head in row)
    slots = Merged(ring.new_zeros(b_, h_, slot_width, d), ring.new_zeros(b_, h_, slot_width, d),
                   torch.zeros(b_, h_, slot_width, dtype=torch.long))
    running = policy.scoring.name in RUNNING_SCORERS
    for b in range(b_):
        for h in range(h_):
            head = heads[b][h]
            tok = head.tokens().nonzero().squeeze(1)
            tok = tok[head.positions[tok].argsort()]
            m = len(tok)
            keys[b, h, :m], values[b, h, :m] = head.keys[tok], head.values[tok]
            positions[b, h, :m], valid[b, h, :m] = head.positions[tok], True
            if running:
                scores[b, h, :m] = head.scores[tok]
            else:
                state = LayerState(ring[b:b + 1, h * g:(h + 1) * g], head.keys[tok][None, None],
                                   head.values[tok][None, None], None, scale)
                scores[b, h, :m] = policy.scoring.score(state)[0, 0]
            sl = (~head.tokens()).nonzero().squeeze(1)
            sl = sl[(-1 - head.positions[sl]).argsort()]
            n = len(sl)
            slots.keys[b, h, :n], slots.values[b, h, :n] = head.keys[sl], head.values[sl]
            slots.counts[b, h, :n] = head.counts[sl].long()
    total = None if policy.budget.threshold is not None else budgets.sum(-1)
    kept, merged = select_and_merge(policy, keys, values, scores, positions, valid, lengths, total, layer,
                                    slots if policy.merges else None)
    for b in range(b_):
        for h in range(h_):
            keep = kept[b, h]
            head = HeadEntries(keys[b, h, keep], values[b, h, keep], positions[b, h, keep], scores[b, h, keep],
                               torch.ones(int(keep.sum())))
            if merged is not None:
                for r in range(merged.counts.shape[-1]):
                    if merged.counts[b, h, r] > 0:
                        head.add(merged.keys[b, h, r], merged.values[b, h, r], -1 - r, 0.0,
                                 float(merged.counts[b, h, r]))
            heads[b][h] = head
