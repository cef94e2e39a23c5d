"""A reconstruction scorer's forwards (KVzip; kvcompile.kvzip drives them): the prompt runs with its keys
and values held whole, then each reconstruction forward attends over them and its own keys and records the
chunk's scores, storing nothing."""
from __future__ import annotations

import torch
from torch import Tensor

from kvcompile.engine.prefill import prompt_attention, start_prompt


def reconstruction_step(cache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
                        scale: float) -> Tensor:
    """One layer's op while a reconstruction scorer's prompt runs: the prompt's causal attention,
    its keys and values held whole; or a reconstruction forward's attention over them and its own
    keys, and the chunk's scores recorded (nothing stored)."""
    rec = cache.reconstruction
    b, hq, t, d = q.shape
    if rec.span is None:
        if cache.stores[layer] is not None or rec.keys[layer] is not None:
            raise RuntimeError("kvcompile: scoring kvzip scores a prompt given in one call")
        if layer == 0:
            start_prompt(cache, mask, b, t, q)
        rec.keys[layer], rec.values[layer], rec.scales[layer], rec.query_heads = k, v, scale, hq
        return prompt_attention(q, k, v, None, scale)
    cached_k, cached_v = rec.keys[layer], rec.values[layer]
    start, end = rec.span
    keys, values = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)
    out = _attention_after(q, keys, values, scale)
    scores = cache.plan.policy.scoring.score_reconstruction(q, cached_k, k, start, end, scale)
    if rec.scores[layer] is None:
        rec.scores[layer] = torch.zeros(b, k.shape[1], cached_k.shape[2], dtype=torch.float32, device=k.device)
    rec.scores[layer][:, :, start:end] = scores
    return out


def _attention_after(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """The attention of the last T = q.shape[2] rows of a causal sequence of keys (the reconstruction input
    after the cached prompt): the C++ attention kernel where it runs (fp32 CPU), else SDPA with the mask."""
    from kvcompile.kernels.attention_column_sums import attention_column_sums, runs_here

    t, n = q.shape[2], keys.shape[2]
    if runs_here(q.device, q.dtype, q.shape[-1]):
        return attention_column_sums(q, keys, values, None, scale, q.new_zeros(t))[0].to(q.dtype)
    return prompt_attention(q, keys, values, None, scale, offset=n - t)

