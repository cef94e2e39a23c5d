"""A prompt the policy compresses while it arrives in chunks (schedule.prefill: chunk): each chunk attends
over the entries held so far and itself, and the layer is compressed back to its budget before the next
chunk (reference.ChunkedPrefill is the specification)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.allocation import layer_totals
from kvcompile.engine.cascade import cascade
from kvcompile.engine.compress import store_layer
from kvcompile.engine.pages import Entries
from kvcompile.engine.prefill import prefill
from kvcompile.engine.state import ChunkedPrompt, PromptState
from kvcompile.policies.scoring import entropy
from kvcompile.selection import Merged, select_and_merge

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache


def chunked_prefill(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
                    scale: float) -> Tensor:
    """A call of a prompt that the policy compresses chunk by chunk (reference.ChunkedPrefill): the call's
    tokens are cut at the multiples of c = plan.prefill_chunk and each piece runs `compress_chunk`. compile()'s
    forward and generate() bring one chunk per call (every layer of chunk k before chunk k + 1, what the
    cascade of layer-dynamic budgets needs); a call with several chunks runs them layer after layer (exact
    when layers do not interact: refused for a cascade). A prompt that is one chunk runs `prefill` (one pass).
    A cache not told the prompt's length (`expect_prompt`) takes the first call as the whole prompt."""
    plan = cache.plan
    c = plan.prefill_chunk
    start, t = cache.seq_length, q.shape[2]
    if cache.compressing is None:
        if start or layer:
            raise RuntimeError("kvcompile: a chunked prompt's state is missing (its first call must reach layer 0)")
        cache.compressing = ChunkedPrompt(t)
    length = cache.compressing.length
    end = start + t
    if end > length:
        raise RuntimeError(f"kvcompile: {plan.policy.name} compresses its prompt chunk by chunk; tokens after the "
                           f"prompt ({length} tokens) must come in later calls")
    if end != length and end % c:
        raise RuntimeError(f"kvcompile: {plan.policy.name} compresses its prompt every {c} tokens; a call of the "
                           f"prompt must end at a multiple of {c} tokens or at the prompt's end (this one ends at "
                           f"{end} of {length}): give the prompt in one call, or generate(prefill_chunk_size={c})")
    cuts = [start] + list(range((start // c + 1) * c, end, c)) + [end]
    if plan.cascade and len(cuts) > 2:
        raise RuntimeError(f"kvcompile: {plan.policy.name}'s layer budgets move with every layer of a chunk (a "
                           f"cascade): its prompt must come {c} tokens per forward call (compile()'s forward and "
                           f"generate() do this), not {t} in one")
    if start == 0 and end == length and length <= c:  # one chunk: one-pass compression
        out = prefill(cache, q, k, v, mask, layer, scale)
    else:
        outs = [compress_chunk(cache, q[:, :, a - start:b - start], k[:, :, a - start:b - start],
                               v[:, :, a - start:b - start], mask, layer, scale, a, b)
                for a, b in zip(cuts[:-1], cuts[1:])]
        out = torch.cat(outs, dim=2)
    if layer == plan.num_layers - 1 and end == length:
        cache.compressing = None
    return out


def compress_chunk(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
                   scale: float, start: int, end: int) -> Tensor:
    """Chunk [start, end) of the prompt at one layer (reference.ChunkedPrefill.step): attention over the
    held entries and the chunk, scores of the held tokens and the chunk (per head: a batch of B·H
    single-head states, the held tokens right-aligned before the chunk), selection back to the budget of
    the tokens seen and merging, written into fresh pages; the cascade over the layers below."""
    plan = cache.plan
    policy = plan.policy
    b, hq, t, d = q.shape
    h = k.shape[1]
    g = hq // h
    seen = torch.ones(b, end, dtype=torch.bool, device=q.device) if mask is None else mask[:, :end].bool()
    real = seen[:, start:]
    lengths = seen.sum(-1)
    pad = end - lengths  # left pads so far: every pad comes before the real tokens
    if layer == 0:
        if start == 0:
            cache.plan = plan = plan.bound_to(q)
            cache.rings = [None] * plan.num_layers
        totals = layer_totals(policy, lengths, plan.num_layers, plan.num_heads) if plan.static_totals else None
        cache.prompt = PromptState(seen, lengths, pad, end, totals, [])
        cache.decoding = None
    store = cache.stores[layer]
    first = store is None
    if first:
        hk, hv = k.new_zeros(b, h, 0, d), v.new_zeros(b, h, 0, v.shape[-1])
        hs, hc = torch.zeros(b, h, 0, device=q.device), torch.zeros(b, h, 0, device=q.device)
        hp = torch.zeros(b, h, 0, dtype=torch.long, device=q.device)
        stored = torch.zeros(b, h, 0, dtype=torch.bool, device=q.device)
        slot_count = torch.zeros(b, h, dtype=torch.long, device=q.device)
    else:
        hk, hv, hs, hp, hc, stored = store.gather()
        hk, hv = hk.to(k.dtype), hv.to(v.dtype)  # quantized pages dequantize to float32
        slot_count = store.slots
    # the attention over the held entries and the chunk (and, for a column-sum scorer, its score: chunk_scores)
    weights = policy.scoring.column_weights(t) if plan.chunk_scores else None
    out, sums = plan.chunk_attention(q, k, v, (hk, hv, plan.merge_bias(hc), stored), real, scale, weights)

    # the candidates: held tokens (right-aligned, position order) then the chunk's tokens
    e = torch.arange(hk.shape[2], device=q.device)
    is_slot = stored & (e < slot_count[..., None])
    tokens = (stored & ~is_slot).sum(-1)  # (B, H)
    m = int(tokens.max()) if tokens.numel() else 0
    cols = torch.arange(m, device=q.device)
    lead = (m - tokens)[..., None]
    held_valid = cols >= lead
    src = (slot_count[..., None] + cols - lead).clamp(0, max(hk.shape[2] - 1, 0))
    take = lambda x: x.gather(2, src[..., None].expand(*src.shape, x.shape[-1])) if x.dim() == 4 \
        else x.gather(2, src)  # noqa: E731
    positions = torch.arange(start, end, device=q.device)[None, :] - pad[:, None]  # (B, T) logical positions
    keys = torch.cat([take(hk).to(k.dtype), k], dim=2)
    values = torch.cat([take(hv).to(v.dtype), v], dim=2)
    cand_pos = torch.cat([take(hp), positions[:, None].expand(b, h, t)], dim=2)
    valid = torch.cat([held_valid, real[:, None].expand(b, h, t)], dim=2)
    width = m + t
    carried = None if first else torch.cat([take(hs), torch.zeros(b, h, t, device=q.device)], dim=2)
    rows = policy.scoring.query_rows(t)
    state = plan.state(q[:, :, t - rows:].reshape(b * h, g, rows, d), keys.reshape(b * h, 1, width, d),
                       values.reshape(b * h, 1, width, values.shape[-1]), valid.reshape(b * h, width), scale)
    carried = None if carried is None else carried.reshape(b * h, 1, width)
    if sums is None:
        scores = policy.scoring.score_chunk_prompt(state, carried)
    else:  # the kernel's column sums over [held entries, chunk] → the candidates' order, per query head
        sums = sums.view(b, h, g, -1)
        own = sums[..., hk.shape[2]:]
        if m:
            own = torch.cat([sums[..., :hk.shape[2]].gather(3, src[:, :, None].expand(b, h, g, m)), own], dim=3)
        scores = policy.scoring.score_chunk_from_column_sums(own.reshape(b * h, g, width), state, carried)
    scores = scores.reshape(b, h, width)
    slots = None
    if policy.merges and not first:
        size = int(slot_count.max())
        slots = Merged(hk[:, :, :size], hv[:, :, :size], torch.where(is_slot[:, :, :size], hc[:, :, :size], 0).long())

    prompt = cache.prompt
    if plan.cascade:  # LAVa Alg. 2 inside the chunk (reference.ChunkedPrefill, step 4)
        prompt.entropy.append(entropy(scores, valid))
        used = torch.zeros_like(tokens) if slots is None else (slots.counts > 0).sum(-1)
        held = torch.stack(prompt.held + [valid.sum((1, 2)) + used.sum(-1)], dim=1)
        # the layers above still hold their previous chunk's entries: the layers seen share the rest
        above = sum((s.lengths.sum(-1).to(q.device) for s in cache.stores[layer + 1:] if s is not None),
                    torch.zeros_like(lengths))
        totals = layer_totals(policy, lengths, plan.num_layers, plan.num_heads,
                              entropy=torch.stack(prompt.entropy, dim=1), capacity=held, reserved=above)
    elif policy.budget.threshold is None:
        totals = layer_totals(policy, lengths, plan.num_layers, plan.num_heads)
    else:
        totals = None
    kept, merged = select_and_merge(policy, keys, values, scores, cand_pos, valid, lengths,
                                    None if totals is None else totals[:, layer], layer, slots)
    cache.stores[layer] = store_layer(cache, Entries(keys, values, scores, cand_pos, torch.ones_like(scores), kept), merged)
    if plan.prune_every:  # the latest query rows, for pruning while decoding
        ring = q if cache.rings[layer] is None else torch.cat([cache.rings[layer], q], dim=2)
        cache.rings[layer] = ring[:, :, ring.shape[2] - min(plan.ring_rows, ring.shape[2]):].clone()
    if plan.cascade:
        prompt.held.append(cache.stores[layer].lengths.sum(-1))
        cascade(cache, layer, totals)
    return out

