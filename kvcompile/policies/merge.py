"""Merge rules: what happens to evicted tokens."""
from __future__ import annotations

from dataclasses import dataclass

from kvcompile.policies.registry import part


@part("merge", "drop")
@dataclass(frozen=True)
class Drop:
    """Evicted tokens are gone."""


@part("merge", "residual")
@dataclass(frozen=True)
class Residual:
    """ZSMerge (§3.4–3.5, Eq. 6–8): B_r residual slots (budget.split.residual). An evicted
    (k, v) fills a free slot, else merges into the slot with the largest k_r·k, which
    becomes the count-weighted mean; its count w grows by 1. Attention adds α·log w to
    every entry's logit (w = 1 for plain tokens). Evicted tokens merge one at a time
    in ascending score order."""

    alpha: float = 0.6
