"""The prompt's attention and the weighted column sums of its probabilities, in one pass.

    out, sums = attention_column_sums(q, k, v, valid, scale, weights)

q (B, Hq, N, d) the prompt's queries, k, v (B, H, N, d) its keys and values (Hq = H·G,
query head h·G + g belongs to KV head h), valid (B, N) bool or None (every token real),
weights (N,) float32 the row weights w_j. Returns
- out (B, Hq, N, d): the model's causal attention, `engine.prefill.prompt_attention(q, k, v,
  valid, scale)`: query j sees the real keys i ≤ j, and a pad query sees itself only;
- sums (B, Hq, N) float32: Σ over the real queries j of w_j · A[j, i], with A the causal
  softmax attention of the scorers (`policies.scoring.attention_rows`: a pad query's row
  is 0).

A chunk of a chunked prompt (engine.chunked.compress_chunk): q holds the queries of the last T ≤ N keys
(query t is key N − T + t, it sees the keys up to itself), weights (T,) weigh its rows, and the
first E ≤ N − T keys are the entries the layer holds, with `bias` (B, H, E) added to their
logits (the merge rule's α·log w; −inf where a head holds nothing); a pad query sees none of
them (as `kernels.chunk_attention.SdpaChunkAttention`). sums (B, Hq, N) then cover every key.

This is what the scorers whose prompt score is a weighted column sum of the attention need
(`Scorer.column_weights`: H2O's accumulated attention, w = 1; ZSMerge's decayed one,
w_j = λ^(N−1−j)). Computed apart, the score is a second attention pass over the prompt
(`policies.scoring.decayed_scores_chunked`: the logits and the softmax again) and costs
1.4–1.5× the attention itself; here the logits are computed once and the score adds one
multiply-add per probability (attention_column_sums.cpp: each block of QB queries keeps
its G·QB rows of logits in a stripe, where each row's softmax is exact).

Impl "cpp" only (the plan's `prompt_scores`, `ColumnSumScores`, named "column_sums:cpp"): fp32 on the CPU, head dim a
multiple of the vector width, a C++ compiler (Inductor's toolchain, as paged_attention_cpp);
elsewhere the plan keeps the model's attention and the scorer's own chunked pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels.paged_attention_cpp import load_cpp, supports
from kvcompile.layer_state import LayerState

_ARGTYPES = ("const float*", "const float*", "const float*", "const int64_t*", "const float*", "const float*",
             "float*", "float*", "float*", "float*", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const float", "const int64_t",
             "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t")
QUERY_BLOCK = 16  # queries per work item: G·16 rows of logits stay in a core's L2 up to ~8k keys (G = 3)
LANES = 16  # the widest vector (AVX-512 fp32): keys are padded to a multiple of it


def _kernel(d: int):
    return load_cpp(_ARGTYPES, "attention_column_sums.cpp", D=d, QB=QUERY_BLOCK)


def runs_here(device: torch.device, dtype: torch.dtype | None, head_dim: int) -> bool:
    """The kernel runs on tensors of this device, dtype and head dim."""
    return dtype is not None and supports(device, dtype, head_dim)


def attention_column_sums(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, scale: float,
                          weights: Tensor, *, bias: Tensor | None = None,
                          threads: int | None = None) -> tuple[Tensor, Tensor]:
    """(out, sums): the module docstring. threads: OpenMP threads (default: torch's)."""
    b, hq, t, d = q.shape
    h, n = k.shape[1], k.shape[2]
    if not (runs_here(q.device, q.dtype, d) and k.dtype == v.dtype == q.dtype):
        raise ValueError("attention_column_sums: fp32 CPU tensors with head dim a multiple of 16")
    e = 0 if bias is None else bias.shape[-1]
    if hq % h or t > n or tuple(v.shape[:3]) != (b, h, n) or weights.shape != (t,) or \
            (bias is not None and (tuple(bias.shape) != (b, h, e) or e > n - t)):
        raise ValueError(f"attention_column_sums: q (B, H·G, T, d), k and v (B, H, N, d) with T <= N, weights (T,), "
                         f"bias (B, H, E) with E <= N - T; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(weights.shape)}, {None if bias is None else tuple(bias.shape)}")
    out, partial, _ = _run(q, k, v, valid, scale, weights, bias, threads, None)
    return out, partial.sum(0)


def reconstruction_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, sink: int, start: int, end: int, *,
                             threads: int | None = None) -> tuple[Tensor, Tensor]:
    """(out, scores) of a KVzip reconstruction forward at one layer, in one pass: q (B, Hq, T, d) the
    reconstruction input's queries, k, v (B, H, N, d) the cached keys and values followed by the input's own
    (the last T); out (B, Hq, T, d) the model's attention of those T rows (as `attention_column_sums` gives it);
    scores (B, H, end − start) float32 the largest attention any query of a KV head's group gives the cached
    keys [start, end), the softmax over the first `sink` keys, [start, end) and the own keys up to the query:
    `policies.scoring.KVzip.score_keys`, from the logits the model's attention computes (not a second time)."""
    b, hq, t, d = q.shape
    if not 0 <= sink <= start <= end <= k.shape[2] - t:
        raise ValueError(f"reconstruction_attention: need 0 <= sink <= start <= end <= N - T; got sink {sink}, "
                         f"[{start}, {end}), N {k.shape[2]}, T {t}")
    out, _, best = _run(q, k, v, None, scale, q.new_zeros(t), None, threads, (sink, start, end))
    return out, best.amax(0).exp_()


def _run(q, k, v, valid, scale, weights, bias, threads, kvzip):
    b, hq, t, d = q.shape
    h, n = k.shape[1], k.shape[2]
    e = 0 if bias is None else bias.shape[-1]
    threads = torch.get_num_threads() if threads is None else threads
    g = hq // h
    padded = -(-n // LANES) * LANES
    kt = k.new_zeros(b, h, d, padded)
    kt[..., :n] = k.transpose(2, 3)
    mask = torch.ones(1, dtype=torch.long) if valid is None else valid.to(torch.long).contiguous()
    held = torch.zeros(1) if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty(b, hq, t, d)
    partial = torch.zeros(threads, b, hq, n)
    stripe = torch.empty(threads, g * QUERY_BLOCK, padded)
    sink, start, end = kvzip or (0, 0, 0)
    best = torch.full((threads, b, h, end - start) if kvzip else (1,), float("-inf"))
    _kernel(d)(q.contiguous(), kt, v.contiguous(), mask, held, weights.to(torch.float32).contiguous(), out,
               partial, stripe, best, b, h, g, n, t, e, padded, float(scale), int(valid is not None),
               int(kvzip is not None), sink, start, end, threads)
    return out, partial, best


@dataclass(frozen=True)
class ColumnSumScores:
    """The prompt scores of a scorer whose score is a weighted column sum of the attention
    (`Scorer.column_weights`), computed by the prompt's attention in the same pass (`attention_and_scores`), where the
    whole prompt comes in one call; otherwise (`score`) the scorer's own pass. What `Plan.prompt_scores`
    holds then (named "column_sums:cpp")."""

    name: ClassVar[str] = "column_sums:cpp"
    label: ClassVar[str] = "column_sums:cpp"  # Plan.score_impl
    in_attention: ClassVar[bool] = True  # the prompt's attention computes the scores

    def attention_and_scores(self, scorer, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, scale: float
               ) -> tuple[Tensor, Tensor]:
        """(the prompt's attention in q's dtype, the layer's scores (B, H, N))."""
        out, sums = attention_column_sums(q, k, v, valid, scale, scorer.column_weights(k.shape[2]))
        return out.to(q.dtype), scorer.score_from_column_sums(sums, LayerState(q, k, v, valid, scale))

    def score(self, scorer, state: LayerState) -> Tensor:
        return scorer.score_prompt(state)

    def build(self, group: int, head_dim: int) -> None:
        _kernel(head_dim)

    def describe(self) -> str:
        return f"{self.name} (attention and score in one pass, torch's threads)"
