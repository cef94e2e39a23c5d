"""Selection and merging of one layer's entries (docs/SPECS.md §2 "Ranking", "Budget",
"Merge"), in plain PyTorch: the definition the selection and merge kernels are tested
against, and the path the runtime takes where a layer is re-selected (the cascade's lower
layers, `decode: every` pruning), which is rare and small.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompile.allocation import HeadBudgets, head_budgets, latest, ranked
from kvcompile.layer_state import LayerState


@dataclass
class Merged:
    """Residual merge slots of one layer (ZSMerge §3.4)."""

    keys: Tensor  # (B, H, S, d)
    values: Tensor  # (B, H, S, d)
    counts: Tensor  # (B, H, S) long: tokens merged into the slot, 0 = empty


def select(policy, scores: Tensor, positions: Tensor, valid: Tensor, lengths: Tensor, total: Tensor | None,
           layer: int, used_slots: Tensor | None = None, budgets: HeadBudgets | None = None) -> Tensor:
    """The entries a layer keeps, (B, H, M) bool, among M candidates per head.

    scores, positions (original prompt positions), valid: (B, H, M); lengths (B,) real
    prompt lengths n_b; total (B,) the layer's entries (tokens + residual slots), None
    under a threshold; used_slots (B, H) merge slots already occupied (cascade).
    Protected (sinks, window, split proximity) are always kept; pads never. Then:
    threshold (DBudgetKV Alg. 1, per head) or the heads part (uniform: each head its
    best up to its budget; pooled: one top-k over the layer, LAVa Alg. 1 / AdaKV).
    The candidates may be a compressed set: the cascade re-selects the kept entries.
    `budgets`: the heads' HeadBudgets when the caller has them (a tensor-parallel rank's,
    computed over all heads); default head_budgets(policy, valid, total, used_slots).
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
    heads = head_budgets(policy, valid, total, used_slots) if budgets is None else budgets
    protected |= latest(positions, valid, heads.proximity)
    return torch.stack([policy.budget.heads.keep(ranks[b], protected[b], valid[b], heads.tokens[b], int(total[b]))
                        for b in range(len(valid))])


def select_with(kernels, policy, scores: Tensor, positions: Tensor, valid: Tensor, lengths: Tensor,
                total: Tensor | None, layer: int, used_slots: Tensor | None = None,
                budgets: HeadBudgets | None = None) -> Tensor:
    """`select` (same arguments, same result) with its cuts made by a selection backend's kernels
    (`kernels`: a kvcompile.kernels.select.Selection): the ranking, protected sets and head budgets are
    `select`'s own functions; the top-k over each head or over the layer (`kernels.keep_best`) and the
    threshold's cut (`kernels.keep_threshold`) are the kernels, one call per layer, not one per sequence."""
    valid, ranks, protected = ranked(policy, scores, positions, valid, lengths)
    threshold = policy.budget.threshold
    if threshold is not None:
        if threshold.keeps_whole(layer):
            return valid.clone()
        return threshold.keep_ranked(ranks, protected, valid, scores, kernels.keep_threshold)
    if total is None:
        raise ValueError("select needs the layer's total unless the policy has a threshold")
    heads = head_budgets(policy, valid, total, used_slots) if budgets is None else budgets
    protected |= latest(positions, valid, heads.proximity)
    # the heads part says how its selection is made of top-k's (its reference, per sequence, otherwise)
    return policy.budget.heads.keep_ranked(ranks, protected, valid, heads.tokens, total, kernels.keep_best)


# --- merge ---------------------------------------------------------------------------------------

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
        num_slots = torch.full((b_, h_), slots.counts.shape[-1], dtype=torch.long, device=keys.device)
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


def _held_slots(merged: Merged | None, like: Tensor) -> Tensor:
    """(B, H) occupied merge slots."""
    if merged is None:
        return torch.zeros(like.shape[:2], dtype=torch.long, device=like.device)
    return (merged.counts > 0).sum(-1)


def select_and_merge(policy, keys: Tensor, values: Tensor, scores: Tensor, positions: Tensor, candidates: Tensor,
                     lengths: Tensor, total: Tensor | None, layer: int, slots: Merged | None = None, choose=None):
    """One compression of one layer: select among the candidate tokens (B, H, M), then merge
    the evicted ones into the layer's residual slots (`slots` = those it already holds,
    None at its first compression). The prefill step and every cascade re-selection.
    Returns kept (B, H, M) bool and the new Merged (None when the policy drops).
    `choose(scores, positions, candidates, lengths, total, layer, used)` -> (kept, HeadBudgets | None):
    the selection and head budgets when the caller makes them (a tensor-parallel rank selects
    over all heads' scores); default `select` and `head_budgets` over these heads."""
    used = _held_slots(slots, candidates)
    if choose is None:
        kept = select(policy, scores, positions, candidates, lengths, total, layer, used_slots=used)
        budgets = head_budgets(policy, candidates, total, used) if total is not None and policy.merges else None
    else:
        kept, budgets = choose(scores, positions, candidates, lengths, total, layer, used)
    if not policy.merges:
        return kept, None
    num_slots = budgets.slots if total is not None else torch.zeros_like(used)
    merged = merge_evicted(policy, keys, values, scores, candidates & ~kept, slots, num_slots, positions)
    return kept, merged



# --- decoding: a layer re-selected while tokens are generated ------------------------------------

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
        keep = torch.arange(len(self.positions), device=self.positions.device) != e
        for name in ("keys", "values", "positions", "scores", "counts"):
            setattr(self, name, getattr(self, name)[keep])

    def add(self, key: Tensor, value: Tensor, position: int, score: float, count: float) -> None:
        self.keys = torch.cat([self.keys, key[None]])
        self.values = torch.cat([self.values, value[None]])
        self.positions = torch.cat([self.positions, self.positions.new_tensor([position])])
        self.scores = torch.cat([self.scores, self.scores.new_tensor([score])])
        self.counts = torch.cat([self.counts, self.counts.new_tensor([count])])


def decode_prune(policy, heads: list[list[HeadEntries]], ring: Tensor, lengths: Tensor, budgets: Tensor,
                 layer: int, scale: float | None = None, *, total: Tensor | None = None, choose=None,
                 softcap: float | None = None, sinks: Tensor | None = None) -> None:
    """`decode: every n`: re-score a layer's cached tokens and prune it back to its budget.

    Scores: the scorer's running score when it has one (H2O, ZSMerge); otherwise the scorer
    applied to the cached tokens in position order with `ring` (B, Hq, R, d), the queries of
    the latest R tokens (always cached: the spec requires ranking.window ≥ R). Then the
    prefill selection (select_and_merge) with the layer's total Σ_h budgets[b, h]; lengths
    (B,) are the sequences' current real lengths. A tensor-parallel rank passes the layer's
    `total` over all heads and its `choose` (select_and_merge); `heads` are then its own. softcap, sinks (Hq,):
    the model's soft-cap and the layer's learned sinks, which the scorer's attention weights apply (LayerState).
    """
    b_, h_ = len(heads), len(heads[0])
    g = ring.shape[1] // h_
    width = max(int(head.tokens().sum()) for row in heads for head in row)
    d = heads[0][0].keys.shape[-1]
    keys = ring.new_zeros(b_, h_, width, d)
    values = torch.zeros_like(keys)
    scores = torch.full((b_, h_, width), float("-inf"), device=ring.device)
    positions = torch.full((b_, h_, width), -1, dtype=torch.long, device=ring.device)
    valid = torch.zeros(b_, h_, width, dtype=torch.bool, device=ring.device)
    slot_width = max(int((~head.tokens()).sum()) for row in heads for head in row)
    slots = Merged(ring.new_zeros(b_, h_, slot_width, d), ring.new_zeros(b_, h_, slot_width, d),
                   torch.zeros(b_, h_, slot_width, dtype=torch.long, device=ring.device))
    running = policy.scoring.running
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
                                   head.values[tok][None, None], None, scale, softcap=softcap,
                                   sinks=None if sinks is None else sinks[h * g:(h + 1) * g])
                scores[b, h, :m] = policy.scoring.score(state)[0, 0]
            sl = (~head.tokens()).nonzero().squeeze(1)
            sl = sl[(-1 - head.positions[sl]).argsort()]
            n = len(sl)
            slots.keys[b, h, :n], slots.values[b, h, :n] = head.keys[sl], head.values[sl]
            slots.counts[b, h, :n] = head.counts[sl].long()
    if policy.budget.threshold is not None:
        total = None
    elif total is None:
        total = budgets.sum(-1)
    kept, merged = select_and_merge(policy, keys, values, scores, positions, valid, lengths, total, layer,
                                    slots if policy.merges else None, choose)
    for b in range(b_):
        for h in range(h_):
            keep = kept[b, h]
            head = HeadEntries(keys[b, h, keep], values[b, h, keep], positions[b, h, keep], scores[b, h, keep],
                               torch.ones(int(keep.sum()), device=keys.device))
            if merged is not None:
                for r in range(merged.counts.shape[-1]):
                    if merged.counts[b, h, r] > 0:
                        head.add(merged.keys[b, h, r], merged.values[b, h, r], -1 - r, 0.0,
                                 float(merged.counts[b, h, r]))
            heads[b][h] = head
