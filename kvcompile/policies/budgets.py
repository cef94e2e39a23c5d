"""Budget allocation parts: how many tokens each (layer, KV head) keeps.

Totals count retained tokens per sequence, protected tokens included:
`per_head: n` means n·H·L tokens (the papers' "nHL"), `ratio: r` means r·N·H·L.
A budget never exceeds what exists; the excess is redistributed (water-filling).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvcompile.policies.registry import part


@part("layers", "uniform")
@dataclass(frozen=True)
class UniformLayers:
    """B_l = B / L."""


@part("layers", "pyramid")
@dataclass(frozen=True)
class PyramidLayers:
    """PyramidKV (Eq. 1): B_{L−1} = B/(β·L), B_0 = 2B/L − B_{L−1}, linear in between."""

    beta: float = 20.0


@part("layers", "entropy")
@dataclass(frozen=True)
class EntropyLayers:
    """LAVa (Eq. 7–8, Alg. 2): B_l = e_l / Σ e · B, e_l the normalized entropy of the
    layer's scores over heads × tokens. Computed as a cascade during prefill."""


@part("heads", "uniform")
@dataclass(frozen=True)
class UniformHeads:
    """B_{l,h} = B_l / H."""


@part("heads", "pooled")
@dataclass(frozen=True)
class PooledHeads:
    """AdaKV / LAVa Alg. 1: one top-k over all heads of the layer, so head budgets follow
    the scores; each head keeps at least floor·B_l/H tokens."""

    floor: float = 0.0


@part("threshold", "attention_norm")
@dataclass(frozen=True)
class AttentionNorm:
    """DBudgetKV (§3.2–3.3, Alg. 1): no preset budget. Tokens ordered least important
    first; evict the longest prefix whose removal changes ‖s‖₂ (s = the policy's scores,
    the last token's attention for DBudgetKV) by at most t, relatively:
    1 − ‖s_kept‖₂ / ‖s‖₂ ≤ t. The first `keep_layers` layers are kept whole."""

    t: float = 0.01
    keep_layers: int = 2


@dataclass(frozen=True)
class Split:
    """ZSMerge (Eq. 3): each head's budget B = B_p + B_c + B_r, given as fractions of B
    that add up to 1: the latest B_p tokens (proximity), the top B_c by score (context),
    B_r residual merge slots (with `merge: residual`)."""

    proximity: float
    context: float
    residual: float = 0.0


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
