"""The eager reference engine: the specification of every policy, in plain PyTorch.

Everything fast (runtime, kernels, compiled graphs) is tested against these functions.
Written for clarity, not speed.

Shapes: B batch, H KV heads, Hq = H·G query heads, N prompt tokens, d head dim.
Left padding: `mask` (B, N) is True for real tokens; a sequence's real tokens have
positions 0 … n_b − 1 (n_b = its real length) and pad tokens are never kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerState:
    """One layer's prefill state, as the model computed it."""

    queries: Tensor  # (B, Hq, R, d): the last R prompt queries, after RoPE
    keys: Tensor  # (B, H, N, d), after RoPE
    values: Tensor  # (B, H, N, d)
    mask: Tensor | None = None  # (B, N) bool, True = real token; None = no padding
    scale: float | None = None  # softmax scale; None = d ** -0.5


@dataclass
class Merged:
    """Residual merge slots of one layer (ZSMerge §3.4)."""

    keys: Tensor  # (B, H, S, d)
    values: Tensor  # (B, H, S, d)
    counts: Tensor  # (B, H, S) long: tokens merged into the slot, 0 = empty


@dataclass
class Selection:
    """What a policy keeps of a prompt."""

    kept: list[Tensor]  # per layer: (B, H, N) bool, retained prompt tokens
    merged: list[Merged | None]  # per layer: residual slots, or None when the policy drops
    budgets: Tensor  # (B, L, H) long: tokens kept = kept[l].sum(-1)
    scores: list[Tensor]  # per layer: (B, H, N) float scores, -inf at padding


def attend(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor | None = None,
           lengths: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Decode attention over a compressed cache: the ground truth for every decode kernel.

    q: (B, Hq, T, d) queries (T new tokens, usually 1) that see every cache entry;
    keys, values: (B, H, S, d), entry s of head h valid when s < lengths[b, h];
    bias: (B, H, S) added to the logits (ZSMerge Eq. 8: α·log w, w = merge count);
    lengths: (B, H) long, None = all S valid. Returns (B, Hq, T, d).
    A head with no valid entry returns zeros.
    """
    b, hq, t, d = q.shape
    h = keys.shape[1]
    g = hq // h
    scale = d ** -0.5 if scale is None else scale
    k = keys.repeat_interleave(g, dim=1).float()
    v = values.repeat_interleave(g, dim=1).float()
    logits = torch.einsum("bhtd,bhsd->bhts", q.float(), k) * scale
    if bias is not None:
        logits = logits + bias.repeat_interleave(g, dim=1).float()[:, :, None, :]
    if lengths is not None:
        valid = torch.arange(keys.shape[2], device=keys.device) < lengths[..., None]  # (B, H, S)
        valid = valid.repeat_interleave(g, dim=1)[:, :, None, :]
        logits = logits.masked_fill(~valid, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # an empty head gives zeros
    return torch.einsum("bhts,bhsd->bhtd", weights, v).to(q.dtype)
