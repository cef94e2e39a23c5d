"""Attention written out, for what SDPA does not compute: soft-capped logits (Gemma 2's
`attn_logit_softcapping`: cap·tanh(s/cap) before the softmax) and learned sinks (gpt-oss's `self_attn.sinks`: one
logit per query head in the softmax's denominator), as transformers' eager attention computes them. The prompt's
attention, a local layer's window and a chunk's attention over the held entries (kernels.chunk_attention.
ExplicitChunkAttention) use it where the plan has either (`Plan.softcap`, `Plan.sinks`; the decode attention's is
`kernels.paged_attention.SoftcapPagedAttention`, over codes
`kernels.paged_attention_quant.SoftcapQuantPagedAttention`)."""
from __future__ import annotations

import torch
from torch import Tensor


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, softcap: float | None = None,
                       sinks: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """softmax(cap·tanh(q·kᵀ·scale / cap) + bias) · v over the `allowed` keys (broadcast to (B, Hq, T, N));
    `sinks` (Hq,): one more logit per query head in the denominator, whose value is dropped; `bias` (broadcast to the
    logits, or None): a merge rule's logit bias of each key (α·log w for a slot of w tokens), added after the cap,
    so that a slot weighs w^α·exp(capped logit) as its tokens would. GQA by repeating the KV heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if bias is not None:
        logits = logits + bias
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
