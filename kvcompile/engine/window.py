"""A local layer of a hybrid model, left to its window: it attends as transformers' sliding-window (or chunked)
attention does and holds no more than transformers' own cache holds there.

A hybrid model gives each local layer a span of `window` positions, of one of two kinds:
- `sliding_attention` (Gemma 2 and 3, gpt-oss): the query at (padded) position i sees the real keys at positions j
  with i - window < j <= i. The layer keeps the keys and values of its last `window - 1` positions (pads included,
  masked), as transformers' DynamicSlidingWindowLayer does: those and a new token's own key are all a next query
  may see.
- `chunked_attention` (Llama 4, `window` = config.attention_chunk_size): the sequence is cut into chunks of
  `window` positions counted from the row's first real token (transformers' chunked mask: a row's left pads
  shift its chunks), and the query at position i sees the real keys j <= i of its own chunk,
  (j - pads) // window == (i - pads) // window. The layer keeps the positions of the chunk the next query falls
  in (in a batch, the longest such run over the rows; the other rows' older entries are masked): at most
  window - 1, and none once a chunk is full (transformers' cache keeps the last window - 1 positions there).
The window already bounds the layer's cache, so a policy leaves it alone (it compresses the kinds of layer it
applies to, `layers: {<part>: {kinds: [...]}}`, docs/SPECS.md). Older entries leave the layer's memory as each
step runs (the held tensors are copied, never views of a longer one).

Positions are the padded index of the sequence (transformers' cache positions), as the model's masks read them; a
left pad is held as a masked entry, as transformers holds it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile.engine.explicit import explicit_attention


@dataclass
class WindowLayer:
    """One local layer's held entries: the positions a next query may see (sliding: its last
    min(seen, window - 1); chunked: those of its chunk so far)."""

    window: int  # the layer's sliding window (transformers' `sliding_window`: keys less than it behind), or chunk
    keys: Tensor  # (B, H, n, d): the latest positions' keys, oldest first
    values: Tensor  # (B, H, n, d)
    valid: Tensor  # (B, n) bool: a real token (False: a left pad)
    seen: int  # positions the layer has run (pads included): the next query's position
    pads: tuple[int, ...] | None = None  # chunked attention: each row's left pads so far (its chunks start after
    #   them); None: a sliding window

    @property
    def chunked(self) -> bool:
        return self.pads is not None

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held (what transformers' cache holds for the layer, or less)."""
        return self.keys.nbytes + self.values.nbytes

    def needed(self, seen: int) -> int:
        """How many positions before `seen` a query at `seen` may see (the entries to hold then)."""
        return needed(self.window, seen, self.pads)

    def rows(self, index: Tensor) -> "WindowLayer":
        """The layer for the rows `index` (beam search, expanded inputs): each row its own copy."""
        index = index.to(self.keys.device)
        pads = None if self.pads is None else tuple(self.pads[i] for i in index.tolist())
        return WindowLayer(self.window, self.keys[index], self.values[index], self.valid[index], self.seen, pads)

    def can_crop(self, tokens: int) -> bool:
        """Whether the layer holds what it held before its last `tokens` positions: every position a query then
        could see (sliding: the last window - 1 before them; chunked: its chunk's), or all it had seen."""
        return self.keys.shape[2] - tokens >= self.needed(self.seen - tokens)

    def cropped(self, tokens: int) -> "WindowLayer":
        """The layer without its last `tokens` positions (assisted decoding's rejected candidates), back to the
        positions a next query may see (copies); `can_crop(tokens)` must hold."""
        end = self.keys.shape[2] - tokens
        start = max(0, end - self.needed(self.seen - tokens))
        return WindowLayer(self.window, self.keys[:, :, start:end].clone(), self.values[:, :, start:end].clone(),
                           self.valid[:, start:end].clone(), self.seen - tokens, self.pads)


def needed(window: int, seen: int, pads: tuple[int, ...] | None) -> int:
    """The positions before `seen` that a query at `seen` may see: the last window - 1 of a sliding window; of a
    chunked layer, those of the query's chunk in the row where it has most (none in a row still all pads)."""
    if pads is None:
        return min(seen, window - 1)
    return max(((seen - p) % window if seen >= p else 0) for p in pads)


def chunked_span(module) -> int | None:
    """The chunk of an attention module's layer where its model runs it chunked (config.layer_types), else None."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if layer is None or not types or types[layer] != "chunked_attention":
        return None
    return config.attention_chunk_size


def left_pads(valid: Tensor) -> Tensor:
    """(B,) each row's pads before its first real token (transformers' count for the chunked mask)."""
    return (valid.long().cumsum(-1) == 0).sum(-1)


def window_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float, window: int,
                     offset: int, softcap: float | None = None, sinks: Tensor | None = None,
                     start: Tensor | None = None) -> Tensor:
    """Sliding-window causal attention: query t (at position offset + t, against keys at positions 0..N-1 of
    `k`) sees the real keys j with offset + t - window < j <= offset + t. With `start` (B,), chunked attention
    instead: key j is row b's real position start[b] + j (its padded position less its left pads), and a query
    sees the real keys j <= offset + t of its own chunk of `window` real positions. A query that sees no real key
    (a left pad's) attends to its own key, so no NaN appears (its output is never read by a real token).
    q (B, Hq, T, d), k/v (B, H, N, d), valid (B, N) bool; softcap: the model's logit soft-cap (Gemma 2), or None;
    sinks: the layer's learned sinks (gpt-oss, (Hq,)), or None."""
    t, n = q.shape[2], k.shape[2]
    rows = torch.arange(t, device=q.device)[:, None] + offset
    cols = torch.arange(n, device=q.device)[None, :]
    if start is None:
        allowed = ((cols <= rows) & (cols > rows - window))[None] & valid[:, None, :]  # (B, T, N)
    else:
        first = start.to(q.device)[:, None, None]
        same = (first + cols[None]) // window == (first + rows[None]) // window  # (B, T, N)
        allowed = (cols <= rows)[None] & same & valid[:, None, :]
    allowed = allowed | (cols == rows)[None]
    if softcap or sinks is not None:
        return explicit_attention(q, k, v, allowed[:, None], scale, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def window_step(held: WindowLayer | None, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                window: int, softcap: float | None = None, sinks: Tensor | None = None,
                record: bool = False, chunked: bool = False) -> tuple[Tensor, WindowLayer]:
    """One call of a local layer (a prompt, a prompt's chunk, or decode steps): the T new tokens attend to the
    held entries and themselves within the window (`chunked`: within their chunk of `window` positions); returns
    the output (B, Hq, T, d) and the layer's new held entries (those a next query may see, WindowLayer.needed;
    with `record`, every position held and new, until a crop cuts them back: assisted decoding, as transformers'
    DynamicSlidingWindowLayer records its past).
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
    pads, start = None, None
    if chunked:  # a row's left pads grow while it has seen pads only (a prompt given in several calls)
        before = (0,) * b if held is None else held.pads
        new = left_pads(new_valid).tolist() if any(p == seen - t for p in before) else (0,) * b
        pads = tuple(p + (n if p == seen - t else 0) for p, n in zip(before, new))
        start = torch.tensor(pads, device=q.device).neg_() + (seen - keys.shape[2])
    out = window_attention(q, keys.to(q.dtype), values.to(q.dtype), valid, scale, window, offset, softcap, sinks,
                           start)
    keep = keys.shape[2] if record else min(keys.shape[2], needed(window, seen, pads))
    first = keys.shape[2] - keep
    # copies: the positions that left the window are freed, not kept alive by a view
    return out, WindowLayer(window, keys[:, :, first:].clone(), values[:, :, first:].clone(),
                            valid[:, first:].clone(), seen, pads)
