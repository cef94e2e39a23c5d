"""Merge rules: what happens to evicted tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompile.policies.fields import FRACTION, Part, bounded
from kvcompile.policies.registry import part


class MergeRule(Part):
    """Base of the merge rules: what becomes of evicted tokens.

    `merges`: the rule keeps evicted tokens in merge slots (the budget's split.residual share
    of each head's entries). `bias(counts)`: the logit bias of every cache entry from its
    merge count (plain tokens have count 1), added by every attention over the cache, after a
    model's logit soft-cap (Gemma 2: cap·tanh(s/cap) + bias, so a slot weighs exp(bias) times
    exp(its capped logit), as the tokens it stands for would); a model's learned sinks (gpt-oss)
    only join the softmax's denominator (reference.decode_attention).
    `merge` folds evicted tokens into one head's slots, in order; `shrink` cuts a head's
    slots to fewer (the cascade lowered its budget). The runtime asks the rule for all of
    this; a rule with a batched kernel is named in the plan (kvcompile.plan)."""

    merges = True

    def bias(self, counts: Tensor) -> Tensor:
        """No bias for any entry held (count ≥ 1); empty slots (count 0) are masked (−inf)."""
        return torch.where(counts > 0, 0.0, float("-inf"))

    @property
    def bias_alpha(self) -> float | None:
        """α when `bias` is α·log w for held entries (w ≥ 1) and −inf for empty slots (what a
        fused decode step computes), else None. This rule's bias is α = 0."""
        return 0.0 if type(self).bias is MergeRule.bias else None

    def merge(self, slot_keys: Tensor, slot_values: Tensor, counts: Tensor, keys: Tensor, values: Tensor):
        raise NotImplementedError

    def shrink(self, slot_keys: Tensor, slot_values: Tensor, counts: Tensor, size: int):
        raise NotImplementedError


@part("merge", "drop")
@dataclass(frozen=True)
class Drop(MergeRule):
    """Evicted tokens are gone."""

    merges = False

    def merge(self, slot_keys, slot_values, counts, keys, values):
        return slot_keys, slot_values, counts

    def shrink(self, slot_keys, slot_values, counts, size: int):
        return slot_keys[:size], slot_values[:size], counts[:size]


def _target(slot_keys: Tensor, counts: Tensor, key: Tensor) -> int:
    """ZSMerge §3.4: the first empty slot (count 0), else the slot with the largest k_r·k
    (ties: the lowest slot index, as argmax returns the first maximum)."""
    empty = (counts == 0).nonzero()
    if len(empty):
        return int(empty[0])
    compute = torch.promote_types(slot_keys.dtype, torch.float32)
    return int((slot_keys.to(compute) @ key.to(compute)).argmax())


def _fold(slot_keys: Tensor, slot_values: Tensor, counts: Tensor, r: int, key: Tensor, value: Tensor,
          weight: int) -> None:
    """ZSMerge Eq. 6–7, in place: slot r becomes the count-weighted mean of itself and an entry
    that stands for `weight` tokens (1 for a token, w for a slot being folded in)."""
    w = int(counts[r])
    compute = torch.promote_types(slot_keys.dtype, torch.float32)
    for slot, new in ((slot_keys, key), (slot_values, value)):
        slot[r] = ((w * slot[r].to(compute) + weight * new.to(compute)) / (w + weight)).to(slot.dtype)
    counts[r] = w + weight


@part("merge", "residual")
@dataclass(frozen=True)
class Residual(MergeRule):
    """ZSMerge (§3.4–3.5, Eq. 6–8): B_r residual slots (budget.split.residual). An evicted
    (k, v) fills a free slot, else merges into the slot with the largest k_r·k, which
    becomes the count-weighted mean; its count w grows by 1. Attention adds α·log w to
    every entry's logit (w = 1 for plain tokens). Evicted tokens merge one at a time
    in ascending score order."""

    alpha: float = bounded(0.6, **FRACTION)

    def bias(self, counts: Tensor) -> Tensor:
        """ZSMerge Eq. 8: α·log w for a slot holding w tokens; empty slots (w = 0) are masked (−inf)."""
        return torch.where(counts > 0, self.alpha * counts.clamp(min=1).double().log(), float("-inf")).float()

    @property
    def bias_alpha(self) -> float | None:
        return float(self.alpha) if type(self).bias is Residual.bias else None

    def shrink(self, slot_keys: Tensor, slot_values: Tensor, counts: Tensor, size: int):
        """One head's slots (S, d), (S, d), (S,) cut to `size` slots (the cascade lowered its
        budget): the surplus slots, last first, fold into the first `size` by the same rule
        as a token (weighted by their counts), so every slot stays the mean of its tokens.
        With size 0 the merged tokens are dropped."""
        slot_keys, slot_values, counts = slot_keys.clone(), slot_values.clone(), counts.clone()
        if size > 0:
            for s in range(len(counts) - 1, size - 1, -1):
                if counts[s] > 0:
                    r = _target(slot_keys[:size], counts[:size], slot_keys[s])
                    _fold(slot_keys, slot_values, counts, r, slot_keys[s], slot_values[s], int(counts[s]))
        return slot_keys[:size], slot_values[:size], counts[:size]

    def merge(self, slot_keys: Tensor, slot_values: Tensor, counts: Tensor, keys: Tensor, values: Tensor):
        """One head: merge the evicted tokens keys, values (E, d), already in merge order,
        one at a time into the slots (S, d), (S, d), (S,) (ZSMerge Alg. 1 lines 11–15)."""
        slot_keys, slot_values, counts = slot_keys.clone(), slot_values.clone(), counts.clone()
        if len(counts) == 0:
            return slot_keys, slot_values, counts  # no slot: evicted tokens are dropped
        for key, value in zip(keys, values):
            r = _target(slot_keys, counts, key)
            _fold(slot_keys, slot_values, counts, r, key, value, 1)
        return slot_keys, slot_values, counts
