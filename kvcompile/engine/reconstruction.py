"""A reconstruction scorer's forwards (KVzip; kvcompile.kvzip drives them): the prompt runs with its keys
and values held whole, then each reconstruction forward attends over them and its own keys and records the
chunk's scores, storing nothing. Under a chunked prefill (schedule.prefill: chunk) the same, chunk by chunk:
a chunk attends over the entries each head holds and itself, its keys and values are held until its
reconstruction forwards (which attend over the held entries, the chunk and their own keys) have scored them,
and each layer then selects among its held entries and the chunk (reference.ChunkedKVzip)."""
from __future__ import annotations

import torch
from torch import Tensor

from kvcompile.engine.chunked import Held, candidates, held_entries, select_chunk, start_chunk
from kvcompile.engine.prefill import prompt_attention, start_prompt


def reconstruction_step(cache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
                        scale: float) -> Tensor:
    """One layer's op while a reconstruction scorer's prompt runs: the prompt's causal attention,
    its keys and values held whole; or a reconstruction forward's attention over them and its own
    keys, and the chunk's scores recorded (nothing stored)."""
    rec = cache.reconstruction
    if rec.chunk is not None:
        if rec.span is None:
            return _chunk_attention(cache, q, k, v, mask, layer, scale)
        return _chunk_reconstruction(cache, q, k, v, layer, scale)
    b, hq, t, d = q.shape
    softcap, sinks = cache.plan.softcap, cache.plan.layer_sinks(layer, q.device)  # (Gemma 2, gpt-oss)
    if rec.span is None:
        if cache.stores[layer] is not None or rec.keys[layer] is not None:
            raise RuntimeError("kvcompile: scoring kvzip scores a prompt given in one call")
        if layer == 0:
            start_prompt(cache, mask, b, t, q)
        rec.keys[layer], rec.values[layer], rec.scales[layer], rec.query_heads = k, v, scale, hq
        return prompt_attention(q, k, v, None, scale, softcap=softcap, sinks=sinks)
    cached_k, cached_v = rec.keys[layer], rec.values[layer]
    start, end = rec.span
    keys, values = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)
    out, scores = _attention_and_scores(cache.plan.policy.scoring, q, keys, values, k, start, end, scale, softcap,
                                        sinks)
    if rec.scores[layer] is None:
        rec.scores[layer] = torch.zeros(b, k.shape[1], cached_k.shape[2], dtype=torch.float32, device=k.device)
    rec.scores[layer][:, :, start:end] = scores
    return out


def _chunk_attention(cache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
                     scale: float) -> Tensor:
    """A chunk [start, end) of a prompt compressed chunk by chunk, at one layer: its queries attend over the
    entries the layer holds and the chunk itself (causal), as any chunked prompt's (engine.chunked); the
    chunk's keys and values are held until it has been reconstructed and the layer selects."""
    rec = cache.reconstruction
    start, end = rec.chunk
    if rec.keys[layer] is not None or k.shape[2] != end - start:
        raise RuntimeError(f"kvcompile: scoring kvzip reconstructs the prompt chunk [{start}, {end}) once it has "
                           "run whole through every layer, in one forward call")
    real = start_chunk(cache, q, mask, layer, start, end)
    held = held_entries(cache, layer, k, v)
    out, _ = cache.plan.chunk_backend(layer, q.device)(q, k, v, held.attention(cache.plan), real, scale)
    rec.keys[layer], rec.values[layer], rec.scales[layer], rec.query_heads = k, v, scale, q.shape[1]
    return out


def _chunk_reconstruction(cache, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float) -> Tensor:
    """A reconstruction forward of the span [s, e) of the chunk [start, end), at one layer: its queries
    attend over the held entries, the chunk's entries and their own keys (causal); the span's entries get
    KVzip's score, the softmax over the sink entries (positions < min(sinks, s), among the held tokens and
    the chunk's), the span's entries and the own keys (`KVzip.score_keys`). Nothing is stored."""
    rec = cache.reconstruction
    plan = cache.plan
    scorer = plan.policy.scoring
    start, end = rec.chunk
    s, e = rec.span
    chunk_k, chunk_v = rec.keys[layer], rec.values[layer]
    held = held_entries(cache, layer, chunk_k, chunk_v)
    real = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
    out, _ = plan.chunk_backend(layer, q.device)(q, k, v, held.attention(plan, chunk_k, chunk_v), real, scale)
    sink_k, sink_valid = _sinks(held, chunk_k, start, min(scorer.sinks, s))
    scores = scorer.score_keys(q, sink_k, chunk_k[:, :, s - start:e - start], k, scale, sink_valid,
                               softcap=plan.softcap, learned=plan.layer_sinks(layer, q.device))  # (Gemma 2, gpt-oss)
    if rec.scores[layer] is None:
        rec.scores[layer] = torch.zeros(*chunk_k.shape[:3], dtype=torch.float32, device=k.device)
    rec.scores[layer][:, :, s - start:e - start] = scores
    return out


def _sinks(held: Held, chunk_k: Tensor, start: int, sink: int) -> tuple[Tensor, Tensor | None]:
    """The keys (B, H, sink, d) at positions 0 … sink − 1, in position order, among the tokens each head
    holds and the chunk's entries (the chunk starts at position `start`), and which of them a head has
    (None: every head has all of them)."""
    b, h, _, d = chunk_k.shape
    keys = chunk_k.new_zeros(b, h, sink, d)
    have = torch.zeros(b, h, sink, dtype=torch.bool, device=chunk_k.device)
    if sink == 0:
        return keys, None
    bi, hi, ei = (held.tokens() & (held.positions < sink)).nonzero(as_tuple=True)
    p = held.positions[bi, hi, ei]
    keys[bi, hi, p], have[bi, hi, p] = held.keys[bi, hi, ei].to(keys.dtype), True
    if start < sink:
        keys[:, :, start:sink], have[:, :, start:sink] = chunk_k[:, :, :sink - start], True
    return keys, None if bool(have.all()) else have


def select_reconstructed(cache, layer: int) -> None:
    """After a chunk's reconstruction forwards: the layer selects among its held entries (the scores they
    got when their own chunk was reconstructed) and the chunk's entries (the scores just recorded), back to
    the budget of the tokens seen, as a chunked prompt selects (engine.chunked.select_chunk); the chunk's
    keys, values and scores are dropped."""
    rec = cache.reconstruction
    start, end = rec.chunk
    chunk_k, chunk_v = rec.keys[layer], rec.values[layer]
    held = held_entries(cache, layer, chunk_k, chunk_v)
    real = torch.ones(chunk_k.shape[0], end - start, dtype=torch.bool, device=chunk_k.device)
    cand = candidates(cache, held, chunk_k, chunk_v, real, start, end)
    scores = torch.cat([cand.scores[:, :, :cand.held], rec.scores[layer]], dim=2)
    select_chunk(cache, layer, held, cand, scores)
    rec.keys[layer] = rec.values[layer] = rec.scores[layer] = None


def _attention_and_scores(scorer, q: Tensor, keys: Tensor, values: Tensor, own_k: Tensor, start: int, end: int,
                          scale: float, softcap: float | None, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """A reconstruction forward's attention at one layer (the last T = q.shape[2] rows of the causal sequence
    `keys`, `values`: the cached prompt, then the input's own `own_k`) and the scores of the cached entries
    [start, end) (`scorer.score_reconstruction`). Where the C++ attention kernel runs (fp32 CPU, no soft-cap, no
    sinks) one pass computes both from the same logits (`kernels.attention_column_sums.reconstruction_attention`);
    elsewhere the attention, then the scorer's own pass."""
    from kvcompile.kernels.attention_column_sums import reconstruction_attention, runs_here

    n = keys.shape[2] - q.shape[2]
    if not softcap and sinks is None and runs_here(q.device, q.dtype, q.shape[-1]):
        out, scores = reconstruction_attention(q, keys, values, scale, min(scorer.sinks, start), start, end)
        return out.to(q.dtype), scores
    out = _attention_after(q, keys, values, scale, softcap, sinks)
    return out, scorer.score_reconstruction(q, keys[:, :, :n], own_k, start, end, scale, softcap=softcap,
                                            sinks=sinks)


def _attention_after(q: Tensor, keys: Tensor, values: Tensor, scale: float, softcap: float | None = None,
                     sinks: Tensor | None = None) -> Tensor:
    """The attention of the last T = q.shape[2] rows of a causal sequence of keys (the reconstruction input
    after the cached prompt): the C++ attention kernel where it runs (fp32 CPU) and the model has no soft-cap
    and no sinks, else the prompt's attention (SDPA with the mask, or written out with the cap and the sinks)."""
    from kvcompile.kernels.attention_column_sums import attention_column_sums, runs_here

    t, n = q.shape[2], keys.shape[2]
    if not softcap and sinks is None and runs_here(q.device, q.dtype, q.shape[-1]):
        return attention_column_sums(q, keys, values, None, scale, q.new_zeros(t))[0].to(q.dtype)
    return prompt_attention(q, keys, values, None, scale, offset=n - t, softcap=softcap, sinks=sinks)
