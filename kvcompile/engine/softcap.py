"""Attention with soft-capped logits (Gemma 2's `attn_logit_softcapping`), as transformers' eager attention
computes it: the prompt's attention and a local layer's window use it where the plan has a cap
(`Plan.softcap`; the decode attention's is `kernels.paged_attention.SoftcapPagedAttention`)."""
from __future__ import annotations

import torch
from torch import Tensor


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, softcap: float) -> Tensor:
    """softmax(cap·tanh(q·kᵀ·scale / cap)) · v over the `allowed` keys (broadcast to (B, Hq, T, N)), as
    transformers' eager attention computes a soft-capped model's (Gemma 2); GQA by repeating the KV heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype), v)
