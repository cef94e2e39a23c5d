"""Budget allocation parts: how many cache entries each (layer, KV head) keeps.

Totals count cache entries per sequence, protected tokens included (and the residual
merge slots when the policy merges): `per_head: n` means n·H·L entries (the papers'
"nHL"), `ratio: r` means max(1, round(r·n_b))·H·L (n_b = the sequence's real length).
A budget never exceeds what exists; the excess is redistributed (water-filling).
All integer budgets come from `apportion` (water-filling, then largest remainder), in
exact rational arithmetic so that ties are decided by the rule, not by float noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from kvcompile.policies.fields import FRACTION, Part, bounded
from kvcompile.policies.registry import part


def exact(x) -> Fraction:
    """A number as the exact fraction the user wrote (0.29 → 29/100, not the nearest float)."""
    return x if isinstance(x, Fraction) else Fraction(str(x))


def round_half_up(x) -> int:
    """Round to the nearest integer, halves up (Python's round() sends 2.5 to 2)."""
    return math.floor(exact(x) + Fraction(1, 2))


def apportion(total: int, weights: Sequence, caps: Sequence[int]) -> list[int]:
    """Integers proportional to `weights`, none above its cap, summing to min(total, Σ caps).

    Water-filling: an entry whose share exceeds its cap gets its cap, and what it cannot
    take goes to the others in proportion to their weights (repeated until none exceeds).
    Then largest remainder: every entry gets the floor of its share, the remaining units
    go to the largest fractional parts, ties to the lower index. If the uncapped entries
    all have weight 0, they share equally. No share exceeds its cap, since caps are integers.
    """
    weights = [exact(w) for w in weights]
    if any(w < 0 for w in weights):
        raise ValueError(f"negative allocation weight in {weights}")
    target = max(0, min(int(total), sum(int(c) for c in caps)))
    share = [Fraction(0)] * len(weights)
    active = list(range(len(weights)))
    remaining = Fraction(target)
    while active:
        w = {i: weights[i] for i in active}
        if sum(w.values()) == 0:
            w = {i: Fraction(1) for i in active}
        level = remaining / sum(w.values())
        over = [i for i in active if level * w[i] > caps[i]]
        if not over:
            for i in active:
                share[i] = level * w[i]
            break
        for i in over:
            share[i] = Fraction(int(caps[i]))
            remaining -= share[i]
            active.remove(i)
    counts = [math.floor(s) for s in share]
    left = target - sum(counts)
    by_remainder = sorted(range(len(share)), key=lambda i: (-(share[i] - counts[i]), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return counts


# --- layers ------------------------------------------------------------------------------

LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")  # transformers' config.layer_types


def _kinds_field():
    """Every layers part's `kinds`: the kinds of layer (transformers' config.layer_types) the policy compresses;
    a hybrid model's other layers keep their window (kvcompile.layer_kinds). Keyword-only, after the part's own
    fields (a one-field part's `{name: value}` form still names its own field)."""
    return field(default=("full_attention",), kw_only=True, metadata={"choices": LAYER_KINDS})


@dataclass(frozen=True)
class LayersRule(Part):
    """Base of the layer allocation parts. `needs_scores`: the shares depend on the layers'
    scores (computed as a cascade during prefill). `ranks_entries`: the layer totals are counted
    from one ranking of every layer's entries (layers: global), not from shares; such a rule ranks every
    head's entries together, so it admits one heads value beside it, `sole_heads`: that heads part at its
    declared defaults (read only where ranks_entries; the spec validator and tune's space both read it).
    `kinds`: the kinds of layer the policy applies to (default full_attention; a kind the model does not
    have is refused at compile())."""

    kinds: tuple[str, ...] = _kinds_field()

    needs_scores = False
    ranks_entries = False  # True: the layer totals are counted from one ranking over every layer's entries
    sole_heads = "pooled"  # read where ranks_entries: the one heads part admitted beside it, at its defaults

    floors = False  # True: heads keep `floor_tokens` entries beyond their protected ones

    def floor_tokens(self, per_head: int) -> int:
        """Entries every head keeps beyond its protected ones before the heads part selects (0)."""
        return 0

    def shares(self, num_layers: int, entropy: Sequence[float] | None = None) -> list[Fraction]:
        raise NotImplementedError


@part("layers", "uniform")
@dataclass(frozen=True)
class UniformLayers(LayersRule):
    """B_l = B / L."""

    def shares(self, num_layers: int, entropy: Sequence[float] | None = None) -> list[Fraction]:
        return [Fraction(1)] * num_layers


@part("layers", "pyramid")
@dataclass(frozen=True)
class PyramidLayers(LayersRule):
    """PyramidKV (Eq. 1): B_{L−1} = B/(β·L), B_0 = 2B/L − B_{L−1}, linear in between."""

    beta: float = bounded(20.0, low=1, why="below 1 the pyramid is inverted; below 1/2 the bottom layer "
                                           "gets a negative budget")

    def shares(self, num_layers: int, entropy: Sequence[float] | None = None) -> list[Fraction]:
        """The fractions B_l / B of PyramidKV Eq. 1 (they add up to 1; one layer gets all)."""
        L = num_layers
        if L == 1:
            return [Fraction(1)]
        top = 1 / (exact(self.beta) * L)
        bottom = Fraction(2, L) - top
        if bottom < 0:
            raise ValueError(f"pyramid beta {self.beta} < 1/2 gives the bottom layer a negative budget")
        return [bottom - (bottom - top) / (L - 1) * l for l in range(L)]


@part("layers", "entropy")
@dataclass(frozen=True)
class EntropyLayers(LayersRule):
    """LAVa (Eq. 7–8, Alg. 2): B_l = e_l / Σ e · B, e_l the normalized entropy of the
    layer's scores over heads × tokens. Computed as a cascade during prefill."""

    needs_scores = True

    def shares(self, num_layers: int, entropy: Sequence[float] | None = None) -> list[Fraction]:
        """e_l over the layers seen (LAVa Alg. 2 line 10); all zeros → uniform."""
        if entropy is None or len(entropy) != num_layers:
            raise ValueError("layers: entropy needs the entropy of every layer it allocates")
        return [Fraction(float(e)) for e in entropy]  # apportion: all-zero weights share equally


@part("layers", "global")
@dataclass(frozen=True)
class GlobalLayers(LayersRule):
    """KVzip (arXiv:2505.23416: §3, scores S ∈ R^{L×H×n_c} by Eq. 2; §4.1 "Eviction Structure": the top r % of
    the scores across all heads are kept, non-uniform head budgets): once every layer of the
    prompt is scored, one ranking over all (layer, KV head, token) keeps the entries that score
    highest anywhere, so layers and heads keep what their scores earn. Every head keeps its protected
    entries (the ranking's sinks and window) and its best ⌊floor·n⌋ others (n = the per-head budget:
    `per_head`, or round(ratio·n_b)); the rest of the total n·H·L goes to the best of the remaining
    entries of every layer and head by one order. The layer totals are counted from that order
    (kvcompile.allocation.global_totals), computed as a cascade during prefill (each layer's top
    entries among the layers seen so far: the same entries, see docs/INTERNALS.md)."""

    floor: float = bounded(0.0, **FRACTION)

    needs_scores = True
    ranks_entries = True
    sole_heads = "pooled"  # one pooled ranking, no floor beside it (the per-head floor is this part's)

    @property
    def floors(self) -> bool:
        return self.floor > 0

    def floor_tokens(self, per_head: int) -> int:
        """⌊floor·n⌋: the entries every head keeps beyond its protected ones, before the global ranking."""
        return math.floor(exact(self.floor) * int(per_head))

    def shares(self, num_layers: int, entropy: Sequence[float] | None = None) -> list[Fraction]:
        raise ValueError("layers: global has no shares of the total: its layer totals are counted from one "
                         "ranking of every layer's entries (kvcompile.allocation.global_totals)")


# --- heads -------------------------------------------------------------------------------

def _best(rank: Tensor, candidates: Tensor, count: int) -> Tensor:
    """The `count` candidates with the lowest rank (best first), as a mask like `rank`."""
    picked = torch.zeros_like(candidates)
    if count <= 0:
        return picked
    idx = candidates.nonzero(as_tuple=True)
    best = rank[idx].argsort()[:count]
    picked[tuple(i[best] for i in idx)] = True
    return picked


class HeadsRule(Part):
    """Base of the head allocation parts: `keep` is the reference (one sequence at a time);
    `keep_ranked` is the runtime's path over a batch, given the selection kernel `keep_best`
    (kvcompile.kernels.select.keep_best with its impl bound). A part without a kernel
    formulation runs its reference per sequence.

    `nested`: re-selecting what the rule kept, with a smaller total, keeps exactly what one
    selection with that total keeps from the first candidates (so a cascade may defer its
    re-selections: kvcompile.plan.Plan.lazy_cascade). False unless a part proves it.

    `head_local`: given the head budgets (HeadBudgets over all heads), a head's selection reads
    only its own entries, so a tensor-parallel rank selects its heads from their scores and the
    heads' counts alone (kvcompile.sharding); False: it reads every head's scores."""

    nested = False
    head_local = False

    def keep(self, rank: Tensor, protected: Tensor, valid: Tensor, tokens: Tensor, total) -> Tensor:
        raise NotImplementedError

    def keep_ranked(self, ranks: Tensor, protected: Tensor, valid: Tensor, tokens: Tensor, total: Tensor,
                    keep_best) -> Tensor:
        """ranks, protected, valid (B, H, M); tokens (B, H) token budgets; total (B,) the layer's."""
        return torch.stack([self.keep(ranks[b], protected[b], valid[b], tokens[b], int(total[b]))
                            for b in range(len(valid))])


@part("heads", "uniform")
@dataclass(frozen=True)
class UniformHeads(HeadsRule):
    """B_{l,h} = B_l / H."""

    head_local = True

    def keep(self, rank: Tensor, protected: Tensor, valid: Tensor, tokens: Tensor, total) -> Tensor:
        """One sequence: rank, protected, valid (H, M); tokens (H,) tokens per head.
        Each head keeps its protected set, then its best entries up to its token budget."""
        kept = protected & valid
        for h in range(rank.shape[0]):
            need = int(tokens[h]) - int(kept[h].sum())
            kept[h] |= _best(rank[h], valid[h] & ~kept[h], need)
        return kept

    def keep_ranked(self, ranks, protected, valid, tokens, total, keep_best):
        return keep_best(ranks, protected, valid, tokens)


@part("heads", "pooled")
@dataclass(frozen=True)
class PooledHeads(HeadsRule):
    """AdaKV / LAVa Alg. 1: one top-k over all heads of the layer, so head budgets follow
    the scores; each head keeps at least floor·B_l/H tokens."""

    floor: float = bounded(0.0, **FRACTION)

    @property
    def nested(self) -> bool:
        """With no floor the layer keeps its protected entries and the best of the rest by one
        ranking, min(total, held) in all: the best k of the best k' ≥ k are the best k."""
        return self.floor == 0

    def guaranteed(self, total: int, num_heads: int) -> int:
        """⌊floor·B_l/H⌋: the tokens every head keeps before the pooled top-k."""
        return math.floor(exact(self.floor) * int(total) / num_heads)

    def keep(self, rank: Tensor, protected: Tensor, valid: Tensor, tokens: Tensor, total) -> Tensor:
        """One sequence: the protected entries of every head; then each head's best entries
        up to ⌊floor·B_l/H⌋ (B_l = total); then one top-k over the remaining entries of all
        heads (LAVa Alg. 1 line 9), k = Σ tokens − what is already kept. `rank` orders all
        heads' entries together, so this top-k is a single sort of the layer."""
        kept = protected & valid
        num_heads = rank.shape[0]
        guaranteed = self.guaranteed(total, num_heads)
        for h in range(num_heads):
            kept[h] |= _best(rank[h], valid[h] & ~kept[h], guaranteed - int(kept[h].sum()))
        return kept | _best(rank, valid & ~kept, int(tokens.sum()) - int(kept.sum()))

    def keep_ranked(self, ranks, protected, valid, tokens, total, keep_best):
        """The floor per head first, then one top-k over the layer (keep_best pooled)."""
        b, h = tokens.shape
        floor = torch.tensor([self.guaranteed(t, h) for t in total.tolist()], dtype=torch.long, device=valid.device)
        kept = keep_best(ranks, protected, valid, floor[:, None].expand(b, h))
        return keep_best(ranks, kept, valid, tokens.sum(-1), pooled=True)


# --- threshold ---------------------------------------------------------------------------

class ThresholdRule(Part):
    """Base of the threshold parts (no preset budget): `keep` is the reference for one
    sequence; `keep_ranked` the runtime's path over a batch given the threshold kernel
    `cut(ranks, protected, valid, scores, t)` (kvcompile.kernels.select.keep_threshold);
    the first `keep_layers` layers are kept whole. `head_local`: a head's cut reads only its own
    entries (a tensor-parallel rank needs nothing of the other ranks' heads); False: all heads'."""

    keep_layers = 0
    head_local = False

    def keeps_whole(self, layer: int) -> bool:
        return layer < self.keep_layers

    def keep(self, rank: Tensor, protected: Tensor, valid: Tensor, scores: Tensor) -> Tensor:
        raise NotImplementedError

    def keep_ranked(self, ranks: Tensor, protected: Tensor, valid: Tensor, scores: Tensor, cut) -> Tensor:
        return torch.stack([self.keep(ranks[b], protected[b], valid[b], scores[b]) for b in range(len(valid))])


@part("threshold", "attention_norm")
@dataclass(frozen=True)
class AttentionNorm(ThresholdRule):
    """DBudgetKV (§3.2–3.3, Alg. 1): no preset budget. Tokens ordered least important
    first; evict the longest prefix whose removal changes ‖s‖₂ (s = the policy's scores,
    the last token's attention for DBudgetKV) by at most t, relatively:
    1 − ‖s_kept‖₂ / ‖s‖₂ ≤ t. The first `keep_layers` layers are kept whole."""

    t: float = bounded(0.01, low=0, high=1, high_open=True)
    keep_layers: int = bounded(2, low=0)

    head_local = True  # DBudgetKV Alg. 1 runs "in parallel for every head"

    def keep_ranked(self, ranks, protected, valid, scores, cut):
        return cut(ranks, protected, valid, scores, self.t)

    def norm_change(self, evict_order: Tensor, scores: Tensor, valid: Tensor) -> Tensor:
        """One head: 1 − ‖s_kept‖₂/‖s_all‖₂ after evicting the first j entries of
        `evict_order`, for j = 0 … len (DBudgetKV Eq. 2: suffix sums of squares, in float64).
        Norms run over all valid entries; a head whose scores are all 0 changes by 0."""
        sq = torch.where(valid, scores.double(), 0.0) ** 2
        staying = valid.clone()
        staying[evict_order] = False  # the entries this order never evicts (protected)
        staying = sq[staying].sum()
        suffix = torch.cat([sq[evict_order].flip(0).cumsum(0).flip(0), sq.new_zeros(1)])
        kept_norm = (staying + suffix).clamp(min=0).sqrt()
        full = kept_norm[0]
        return 1 - kept_norm / full if full > 0 else torch.zeros_like(kept_norm)

    def keep(self, rank: Tensor, protected: Tensor, valid: Tensor, scores: Tensor) -> Tensor:
        """One sequence, (H, M) each: per head, evict the longest least-important-first
        prefix of the unprotected entries whose norm change stays ≤ t."""
        kept = valid.clone()
        for h in range(rank.shape[0]):
            candidates = (valid[h] & ~protected[h]).nonzero(as_tuple=True)[0]
            evict_order = candidates[rank[h, candidates].argsort(descending=True)]  # least important first
            change = self.norm_change(evict_order, scores[h], valid[h])
            cut = int((change <= self.t).sum()) - 1  # change is non-decreasing in j; change[0] = 0
            kept[h, evict_order[:cut]] = False
        return kept


# --- split and the budget ----------------------------------------------------------------

@dataclass(frozen=True)
class Split(Part):
    """ZSMerge (Eq. 3): each head's budget B = B_p + B_c + B_r, given as fractions of B
    that add up to 1: the latest B_p tokens (proximity), the top B_c by score (context),
    B_r residual merge slots (with `merge: residual`)."""

    proximity: float = bounded(**FRACTION, noun="a fraction")
    context: float = bounded(**FRACTION, noun="a fraction")
    residual: float = bounded(0.0, **FRACTION, noun="a fraction")

    def parts(self, entries: int, merges: bool) -> tuple[int, int, int]:
        """(B_p, B_c, B_r) of a head with `entries` = B (Eq. 3; rounded half up; no slots
        when the policy does not merge)."""
        r = round_half_up(exact(self.residual) * entries) if merges else 0
        p = round_half_up(exact(self.proximity) * entries)
        return p, entries - p - r, r


class HeadLayout(NamedTuple):
    """One head's share of a layer budget (cache entries)."""

    entries: int  # B_{l,h}: tokens + residual slots
    tokens: int  # prompt tokens kept (protected included)
    slots: int  # residual merge slots
    proximity: int  # the latest tokens, protected (split proximity)


@dataclass(frozen=True)
class Budget:
    """How many tokens are kept. Exactly one of per_head / ratio, unless a threshold
    decides the budget by itself."""

    per_head: int | None = None
    ratio: float | None = None
    layers: object = field(default_factory=UniformLayers)
    heads: object = field(default_factory=UniformHeads)
    threshold: object | None = None
    split: Split | None = None

    def total(self, length: int, num_heads: int, num_layers: int) -> int | None:
        """Entries per sequence of n_b = `length` real tokens: n·H·L with n = per_head, or
        n = max(1, round(ratio·n_b)); None when a threshold decides (no preset total)."""
        if self.threshold is not None:
            return None
        if self.per_head is not None:
            n = self.per_head
        elif self.ratio is not None:
            n = max(1, round_half_up(exact(self.ratio) * int(length)))
        else:
            raise ValueError("a budget needs per_head, ratio or a threshold")
        return n * num_heads * num_layers

    def layer_totals(self, total: int, caps: Sequence[int], entropy: Sequence[float] | None = None) -> list[int]:
        """B_l for the len(caps) layers that share `total`, water-filled under `caps`."""
        return apportion(total, self.layers.shares(len(caps), entropy), caps)

    def head_layout(self, total: int, tokens: Sequence[int], slots: Sequence[int], merges: bool) -> list[HeadLayout]:
        """Split a layer's entries `total` over its heads (uniform shares, largest remainder,
        water-filled at what each head holds: `tokens` candidates + `slots` used merge slots).

        A head whose share covers all it holds keeps it all. Otherwise (ZSMerge Eq. 3)
        slots = round(residual·B_{l,h}) when the policy merges, proximity = round(proximity·B_{l,h}),
        tokens = the rest (the context part plus proximity); if that is more tokens than
        the head has, it keeps them all and the remaining entries stay slots.
        The heads part decides which tokens (uniform: per head; pooled: Σ tokens over the layer).
        """
        held = [int(t) + int(s) for t, s in zip(tokens, slots)]
        entries = apportion(total, [1] * len(held), held)
        layout = []
        for b, n, used, have in zip(entries, tokens, slots, held):
            n, used = int(n), int(used)
            if b >= have:
                layout.append(HeadLayout(b, n, used, 0))
                continue
            p, _, r = self.split.parts(b, merges) if self.split is not None else (0, b, 0)
            keep = min(b - r, n)
            layout.append(HeadLayout(b, keep, b - keep, min(p, keep)))
        return layout
