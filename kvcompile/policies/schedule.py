"""Schedules: when compression runs."""
from __future__ import annotations

from dataclasses import dataclass

from kvcompile.policies.registry import part


@part("decode", "every")
@dataclass(frozen=True)
class Every:
    """Re-score and prune back to the budget every n generated tokens (window queries
    kept in a small ring buffer per layer)."""

    n: int = 16


@part("decode", "online")
@dataclass(frozen=True)
class Online:
    """ZSMerge Alg. 1: each generated token may push one token out of the proximity part
    into context, and one out of context into the residual slots."""


@dataclass(frozen=True)
class Schedule:
    """`cascade`: re-compress lower layers during prefill when layer budgets move (LAVa,
    CAKE). Layer-dynamic budgets (layers: entropy) always run as a cascade.
    `decode`: None (compress once after the prompt), every{n} or online."""

    cascade: bool = False
    decode: object | None = None
