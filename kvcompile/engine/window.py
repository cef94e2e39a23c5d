"""A local (sliding-window) layer of a hybrid model, left to its window: it attends as transformers'
sliding-window attention does and holds what transformers' own cache holds there.

A hybrid model (Gemma 3: a `sliding_attention` layer on 5 of every 6) gives each local layer a window of
`window` positions: the query at (padded) position i sees the real keys at positions j with
i - window < j <= i. The window already bounds the layer's cache, so a policy leaves it alone (it compresses
the kinds of layer it applies to, `layers: {<part>: {kinds: [...]}}`, docs/SPECS.md) and the layer keeps the
keys and values of its last `window - 1` positions (pads included, masked), as transformers'
DynamicSlidingWindowLayer does: those and a new token's own key are all a next query may see. Older ones
leave the layer's memory as each step runs (the held tensors are copied, never views of a longer one).

Positions are the padded index of the sequence (transformers' cache positions), as the model's sliding mask
reads them; a left pad is held as a masked entry, as transformers holds it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile.engine.explicit import explicit_attention


@dataclass
class WindowLayer:
    """One local layer's held entries: its last min(seen, window - 1) positions."""

    window: int  # the layer's sliding window (transformers' `sliding_window`: keys less than it behind)
    keys: Tensor  # (B, H, n, d), n <= window - 1: the latest positions' keys, oldest first
    values: Tensor  # (B, H, n, d)
    valid: Tensor  # (B, n) bool: a real token (False: a left pad)
    seen: int  # positions the layer has run (pads included): the next query's position

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held (what transformers' cache holds for the layer)."""
        return self.keys.nbytes + self.values.nbytes

    def rows(self, index: Tensor) -> "WindowLayer":
        """The layer for the rows `index` (beam search, expanded inputs): each row its own copy."""
        index = index.to(self.keys.device)
        return WindowLayer(self.window, self.keys[index], self.values[index], self.valid[index], self.seen)

    def can_crop(self, tokens: int) -> bool:
        """Whether the layer holds what it held before its last `tokens` positions: every position of the window
        then (the last window - 1 before them), or all it had seen."""
        return self.keys.shape[2] - tokens >= min(self.seen - tokens, self.window - 1)

    def cropped(self, tokens: int) -> "WindowLayer":
        """The layer without its last `tokens` positions (assisted decoding's rejected candidates), back to at most
        the last window - 1 positions (copies); `can_crop(tokens)` must hold."""
        end = self.keys.shape[2] - tokens
        start = max(0, end - (self.window - 1))
        return WindowLayer(self.window, self.keys[:, :, start:end].clone(), self.values[:, :, start:end].clone(),
                           self.valid[:, start:end].clone(), self.seen - tokens)


def window_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float, window: int,
                     offset: int, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Sliding-window causal attention: query t (at position offset + t, against keys at positions 0..N-1 of
    `k`) sees the real keys j with offset + t - window < j <= offset + t. A query that sees no real key (a left
    pad's) attends to its own key, so no NaN appears (its output is never read by a real token).
    q (B, Hq, T, d), k/v (B, H, N, d), valid (B, N) bool; softcap: the model's logit soft-cap (Gemma 2), or None;
    sinks: the layer's learned sinks (gpt-oss, (Hq,)), or None."""
    t, n = q.shape[2], k.shape[2]
    rows = torch.arange(t, device=q.device)[:, None] + offset
    cols = torch.arange(n, device=q.device)[None, :]
    allowed = ((cols <= rows) & (cols > rows - window))[None] & valid[:, None, :]  # (B, T, N)
    allowed = allowed | (cols == rows)[None]
    if softcap or sinks is not None:
        return explicit_attention(q, k, v, allowed[:, None], scale, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def window_step(held: WindowLayer | None, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                window: int, softcap: float | None = None, sinks: Tensor | None = None,
                record: bool = False) -> tuple[Tensor, WindowLayer]:
    """One call of a local layer (a prompt, a prompt's chunk, or decode steps): the T new tokens attend to the
    held entries and themselves within the window; returns the output (B, Hq, T, d) and the layer's new held
    entries (the last window - 1 positions; with `record`, every position held and new, until a crop cuts
    them back: assisted decoding, as transformers' DynamicSlidingWindowLayer records its past).
    mask: (B, ≥ seen + T) padding mask (True = real) or None."""
    b, t = q.shape[0], q.shape[2]
    new_valid = torch.ones(b, t, dtype=torch.bool, device=q.device) if mask is None else mask[:, -t:].bool()
    if held is None:
        keys, values, valid, seen, offset = k, v, new_valid, t, 0
    else:
        keys = torch.cat([held.keys, k.to(held.keys.dtype)], dim=2)
        values = torch.cat([held.values, v.to(held.values.dtype)], dim=2)
        valid = torch.cat([held.valid, new_valid.to(held.valid.device)], dim=1)
        seen, offset = held.seen + t, held.keys.shape[2]
    out = window_attention(q, keys.to(q.dtype), values.to(q.dtype), valid, scale, window, offset, softcap, sinks)
    keep = keys.shape[2] if record else min(keys.shape[2], window - 1)
    start = keys.shape[2] - keep
    # copies: the positions that left the window are freed, not kept alive by a view
    return out, WindowLayer(window, keys[:, :, start:].clone(), values[:, :, start:].clone(),
                            valid[:, start:].clone(), seen)
