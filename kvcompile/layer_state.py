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
    rope: Tensor | None = None  # (d/2,) the layer's rotary inverse frequencies (zeros: none; the pairs
    #   `interleaved` names), for scorers that move queries to other positions (Scorer.needs_rope:
    #   expected_attention); None = not given
    softcap: float | None = None  # the model's attention logit soft-cap (Gemma 2: cap·tanh(s/cap) before the
    #   softmax); None = none. A scorer's attention weights apply it, as the model's attention does
    sinks: Tensor | None = None  # (Hq,) the layer's learned sinks for the state's query heads (gpt-oss: one logit
    #   per query head in the softmax's denominator), or (B, Hq) where they differ by batch row (a chunked prompt's
    #   single-head states, one per KV head: engine.chunked); None = none. A scorer's attention weights count them
    interleaved: bool = False  # the rotary pairs channels (2f, 2f + 1) (Llama 4's, complex on interleaved pairs)
    #   rather than (f, f + d/2) (transformers' rotate-half layout)
    temperature: tuple[float, float] | None = None  # (attn_scale, floor_scale) where the model scaled the query at
    #   position p by 1 + attn_scale·log(1 + ⌊(p + 1)/floor_scale⌋) (Llama 4's NoPE layers under
    #   attn_temperature_tuning, p the index in the padded sequence); None = no such scale
    seen: int | None = None  # the positions up to the last query row, inclusive (a chunk's end); None = the keys'
    #   count (a prompt's state: its last query row is its last key's position)

    @property
    def end(self) -> int:
        """The position after the last query row (the first position of the queries that follow)."""
        return self.keys.shape[2] if self.seen is None else self.seen
