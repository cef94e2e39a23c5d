"""Schedules: when compression runs."""
from __future__ import annotations

from dataclasses import dataclass

from kvcompile.policies.fields import Part, bounded
from kvcompile.policies.registry import part


class DecodeRule(Part):
    """Base of the decode schedules: what happens to a layer's cache while tokens are generated.

    `spare_growth(headroom)`: the most tokens a head can grow by between two compactions,
    for spare pages (a generation of `headroom` tokens). `prune_every`: re-score and prune
    back to the budget every so many generated tokens (0: never). `online`: evict one
    token per head and step, moving it through a split's parts (needs budget.split)."""

    prune_every = 0
    online = False

    def spare_growth(self, headroom: int) -> int:
        return headroom


@part("decode", "every")
@dataclass(frozen=True)
class Every(DecodeRule):
    """Re-score and prune back to the budget every n generated tokens (window queries
    kept in a small ring buffer per layer)."""

    n: int = bounded(16, low=1)

    @property
    def prune_every(self) -> int:
        return self.n

    def spare_growth(self, headroom: int) -> int:
        """n tokens, then a prune writes fresh pages."""
        return min(headroom, self.n) if headroom else self.n


@part("decode", "online")
@dataclass(frozen=True)
class Online(DecodeRule):
    """ZSMerge Alg. 1: each generated token may push one token out of the proximity part
    into context, and one out of context into the residual slots."""

    online = True

    def spare_growth(self, headroom: int) -> int:
        """One token, then the head evicts."""
        return min(headroom, 1)


class PrefillRule(Part):
    """Base of the prefill schedules: how the prompt goes through the model.

    `chunk_tokens`: the prompt is fed in chunks of this many tokens, each compressed back to
    the budget before the next one runs (docs/SPECS.md `prefill: chunk`; the
    definition is `kvcompile.reference.ChunkedPrefill`); 0: the whole prompt in one pass."""

    chunk_tokens = 0


@part("prefill", "chunk")
@dataclass(frozen=True)
class Chunk(PrefillRule):
    """Compress while prefilling in chunks of `size` tokens: chunk k attends to the entries
    kept after chunk k−1 plus itself (causal inside the chunk); then every layer is scored
    over those entries and the chunk and selected back to its budget (the budget of the
    tokens seen so far), merging the evicted entries where the policy merges. Peak KV
    memory: the budget plus one chunk, whatever the prompt length; a chunk at least as long
    as the prompt is one-pass compression exactly. `size` has no default (the chunk is the
    point of the part: `prefill: chunk` and `{chunk: null}` are refused) and is at most
    2^24 tokens (above any model's context; a chunk at least as long as the prompt is one pass)."""

    size: int = bounded(low=1, high=1 << 24, why="tokens per chunk, at most 2^24: above any model's context")

    @property
    def chunk_tokens(self) -> int:
        return self.size


@dataclass(frozen=True)
class Schedule:
    """`cascade`: re-compress lower layers during prefill when layer budgets move (LAVa,
    CAKE). Layer-dynamic budgets (layers: entropy) always run as a cascade.
    `decode`: None (compress once after the prompt), every{n} or online.
    `prefill`: None (the prompt in one pass) or chunk{size} (compress while prefilling in chunks)."""

    cascade: bool = False
    decode: object | None = None
    prefill: object | None = None

    @property
    def chunk_tokens(self) -> int:
        """Tokens per prompt chunk when the prompt is compressed while prefilling (0: one pass)."""
        return 0 if self.prefill is None else self.prefill.chunk_tokens
