"""Ranking parts: the order in which tokens are kept, and the protected sets.

Protected tokens are never evicted: the first `sinks` tokens and the last `window`
tokens of each sequence (padding excluded). Ties are broken deterministically:
among equal keys the later token (larger position) is kept first.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcompile.policies.registry import part


@part("ranking", "by_score")
@dataclass(frozen=True)
class ByScore:
    """Keep the highest scores first (SnapKV, PyramidKV, AdaKV, LAVa, H2O, TOVA)."""

    sinks: int = 0
    window: int = 0


@part("ranking", "by_position")
@dataclass(frozen=True)
class ByPosition:
    """DBudgetKV §3.2 / StreamingLLM: the first `sinks` tokens, then the rest most recent first."""

    sinks: int = 4
    window: int = 0
