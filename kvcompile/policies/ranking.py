"""Ranking parts: the order in which tokens are kept, and the protected sets.

Protected tokens are never evicted: the first `sinks` tokens and the last `window`
tokens of each sequence (padding excluded). Ties are broken deterministically:
among equal keys the later token (larger position) is kept first, then the lower head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompile.policies.fields import Part, bounded
from kvcompile.policies.registry import part


class _Protects(Part):
    """The protected set shared by every ranking: sinks and the recent window."""

    sinks: int
    window: int

    def protected(self, positions: Tensor, lengths: Tensor) -> Tensor:
        """positions < sinks or positions ≥ n_b − window; lengths broadcast against positions."""
        return (positions < self.sinks) | (positions >= lengths - self.window)


@part("ranking", "by_score")
@dataclass(frozen=True)
class ByScore(_Protects):
    """Keep the highest scores first (SnapKV, PyramidKV, AdaKV, LAVa, H2O, TOVA)."""

    sinks: int = bounded(0, low=0)
    window: int = bounded(0, low=0)

    def key(self, scores: Tensor, positions: Tensor) -> Tensor:
        """Higher = kept first: the score itself."""
        return scores.double()


@part("ranking", "by_position")
@dataclass(frozen=True)
class ByPosition(_Protects):
    """DBudgetKV §3.2 / StreamingLLM: the first `sinks` tokens, then the rest most recent first."""

    sinks: int = bounded(4, low=0)
    window: int = bounded(0, low=0)

    def key(self, scores: Tensor, positions: Tensor) -> Tensor:
        """Higher = kept first: x_1 … x_m, then x_n, x_{n−1}, … x_{m+1} (DBudgetKV §3.2)."""
        first = float(2 ** 50)  # above any position; exact in float64
        p = positions.double()
        return torch.where(positions < self.sinks, first - p, p)


def rank(ranking, scores: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
    """The keep order of every entry of a layer, (B, H, M) long: 0 = kept first.

    One order over all heads of a sequence (so pooled head budgets are one top-k), and
    restricted to a head it is that head's order. Sort keys, most significant first:
    valid entries before pads, the ranking's key (descending), the later position, the
    lower head. Built from stable sorts, least significant key first.
    """
    b, h, m = scores.shape
    keys = [valid.flatten(1).long(), ranking.key(scores, positions).flatten(1), positions.flatten(1)]
    order = torch.arange(h * m, device=scores.device).expand(b, -1)  # head-major: lower head first
    for key in reversed(keys):
        step = torch.sort(key.gather(1, order), dim=1, descending=True, stable=True).indices
        order = order.gather(1, step)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(h * m, device=scores.device).expand(b, -1))
    return ranks.view(b, h, m)
