"""LayerState: one layer's prefill state, what every scorer reads (shared by the part
library, the reference engine and the runtime; it depends on nothing of kvcompile)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class LayerState:
    """One layer's prefill state, as the model computed it."""

    queries: Tensor  # (B, Hq, R, d): the last R prompt queries, after RoPE
    keys: Tensor  # (B, H, N, d), after RoPE
    values: Tensor  # (B, H, N, d)
    mask: Tensor | None = None  # (B, N) bool, True = real token; None = no padding
    scale: float | None = None  # softmax scale; None = d ** -0.5
    rope: Tensor | None = None  # (d/2,) the model's rotary inverse frequencies (rotate-half layout), for scorers
    #   that move queries to other positions (Scorer.needs_rope: expected_attention); None = not given
    softcap: float | None = None  # the model's attention logit soft-cap (Gemma 2: cap·tanh(s/cap) before the
    #   softmax); None = none. A scorer's attention weights apply it, as the model's attention does
    sinks: Tensor | None = None  # (Hq,) the layer's learned sinks for the state's query heads (gpt-oss: one logit
    #   per query head in the softmax's denominator), or (B, Hq) where they differ by batch row (a chunked prompt's
    #   single-head states, one per KV head: engine.chunked); None = none. A scorer's attention weights count them
