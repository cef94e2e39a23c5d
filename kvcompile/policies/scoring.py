"""Scoring parts: how important is each prompt token, per layer and KV head.

Every scorer maps one layer's state to scores (B, H, N): higher = more important.
The eager reference of each part is written for clarity; kernels are tested against it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvcompile.policies.registry import part


@dataclass(frozen=True)
class Pooling:
    """1-D pooling of the scores over tokens, same length out (SnapKV §4.3 "clustering").

    kind: avg | max | none;  kernel: odd window size (1 = no pooling).
    """

    kind: Literal["avg", "max", "none"] = "none"
    kernel: int = 1


@part("scoring", "window_attention")
@dataclass(frozen=True)
class WindowAttention:
    """SnapKV / PyramidKV / AdaKV: s[i] = mean over the last `window` queries j of A[j, i].

    A is the model's softmax attention (own scaling, causal mask, queries after RoPE).
    The G query heads of a GQA group reduce to their KV head by `gqa` (mean | max),
    then `pooling` smooths the scores over tokens.
    """

    window: int = 32
    pooling: Pooling = field(default_factory=Pooling)
    gqa: Literal["mean", "max"] = "mean"


@part("scoring", "lava")
@dataclass(frozen=True)
class Lava:
    """LAVa (Eq. 6): window attention × max over all tokens k of ‖V[k]‖₁ of that KV head.

    GQA: max over the group (LAVa §4.3).
    """

    window: int = 32
    pooling: Pooling = field(default_factory=Pooling)
    gqa: Literal["mean", "max"] = "max"


@part("scoring", "last_token")
@dataclass(frozen=True)
class LastToken:
    """TOVA / DBudgetKV (k = 1): s[i] = A[N-1, i], the attention of the last prompt token."""

    gqa: Literal["mean", "max"] = "mean"


@part("scoring", "accumulated")
@dataclass(frozen=True)
class Accumulated:
    """H2O: s[i] = Σ over all queries j ≥ i of A[j, i] (accumulated attention)."""

    gqa: Literal["mean", "max"] = "mean"


@part("scoring", "decayed")
@dataclass(frozen=True)
class Decayed:
    """ZSMerge (Eq. 5): s ← λ·s + a at every step; over the prompt s[i] = Σ_j λ^(N−1−j) A[j, i]."""

    decay: float = 0.98
    gqa: Literal["mean", "max"] = "mean"


@part("scoring", "key_norm")
@dataclass(frozen=True)
class KeyNorm:
    """A cheap baseline (Devoto et al., 2024): s[i] = −‖K[i]‖₂ (low key norm = important)."""


@part("scoring", "recency")
@dataclass(frozen=True)
class Recency:
    """StreamingLLM: s[i] = i, later tokens matter more (no attention needed)."""
