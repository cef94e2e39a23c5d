"""A prompt the policy compresses while it arrives in chunks (schedule.prefill: chunk): each chunk attends
over the entries held so far and itself, and the layer is compressed back to its budget before the next
chunk (reference.ChunkedPrefill is the specification)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.allocation import layer_totals
from kvcompile.engine.cascade import cascade
from kvcompile.engine.compress import merge_slots, store_layer
from kvcompile.store import Entries
from kvcompile.engine.prefill import prefill
from kvcompile.engine.state import ChunkedPrompt, Phase, PromptState
from kvcompile.policies.scoring import entropy
from kvcompile.selection import select_and_merge

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
        cache.enter(Phase.PROMPT, compressing=ChunkedPrompt(t))
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
        return prefill(cache, q, k, v, mask, layer, scale)
    outs = [compress_chunk(cache, q[:, :, a - start:b - start], k[:, :, a - start:b - start],
                           v[:, :, a - start:b - start], mask, layer, scale, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    if layer == plan.num_layers - 1 and end == length:  # the whole prompt is compressed
        cache.enter(Phase.COMPRESSED)
    return torch.cat(outs, dim=2)


def compress_chunk(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
                   scale: float, start: int, end: int) -> Tensor:
    """Chunk [start, end) of the prompt at one layer (reference.ChunkedPrefill.step): attention over the
    held entries and the chunk, scores of the held tokens and the chunk (per head: a batch of B·H
    single-head states, the held tokens right-aligned before the chunk), selection back to the budget of
    the tokens seen and merging, written into fresh pages; the cascade over the layers below."""
    policy = cache.policy
    b, hq, t, d = q.shape
    h = k.shape[1]
    g = hq // h
    real = start_chunk(cache, q, mask, layer, start, end)
    plan = cache.plan  # bound to the prompt's tensors by the first chunk
    held = held_entries(cache, layer, k, v)
    # the attention over the held entries and the chunk (and, for a column-sum scorer, its score: chunk_scores)
    weights = policy.scoring.column_weights(t) if plan.chunk_scores else None
    out, sums = plan.chunk_backend(layer, q.device)(q, k, v, held.attention(plan), real, scale, weights)
    cand = candidates(cache, held, k, v, real, start, end)
    rows = policy.scoring.query_rows(t)
    width = cand.keys.shape[2]
    state = plan.state(q[:, :, t - rows:].reshape(b * h, g, rows, d), cand.keys.reshape(b * h, 1, width, d),
                       cand.values.reshape(b * h, 1, width, cand.values.shape[-1]), cand.valid.reshape(b * h, width),
                       scale, layer, seen=end)
    if state.sinks is not None:  # the learned sinks of each single-head state's G query heads: (B·H, G)
        state.sinks = state.sinks.view(1, h, g).expand(b, h, g).reshape(b * h, g)
    carried = None if held.first else cand.scores.reshape(b * h, 1, width)
    if sums is None:
        scores = policy.scoring.score_chunk_prompt(state, carried)
    else:  # the kernel's column sums over [held entries, chunk] → the candidates' order, per query head
        sums = sums.view(b, h, g, -1)
        own = sums[..., held.keys.shape[2]:]
        m = cand.held
        if m:
            own = torch.cat([sums[..., :held.keys.shape[2]].gather(3, cand.src[:, :, None].expand(b, h, g, m)), own],
                            dim=3)
        scores = policy.scoring.score_chunk_from_column_sums(own.reshape(b * h, g, width), state, carried)
    select_chunk(cache, layer, held, cand, scores.reshape(b, h, width))
    if plan.prune_every:  # the latest query rows, for pruning while decoding
        ring = q if cache.rings[layer] is None else torch.cat([cache.rings[layer], q], dim=2)
        cache.hold_queries(layer, ring[:, :, ring.shape[2] - min(plan.ring_rows, ring.shape[2]):].clone())
    return out


def start_chunk(cache: KVCompileCache, like: Tensor, mask: Tensor | None, layer: int, start: int,
                end: int) -> Tensor:
    """The chunk's state at its first layer (the prompt's real tokens, lengths and pads so far, a fresh
    PromptState: a cascade's entropies start again in every chunk); returns the chunk's real tokens (B, T)."""
    plan = cache.plan
    b = like.shape[0]
    seen = torch.ones(b, end, dtype=torch.bool, device=like.device) if mask is None else mask[:, :end].bool()
    if layer == 0:
        lengths = seen.sum(-1)
        pad = end - lengths  # left pads so far: every pad comes before the real tokens
        if start == 0:
            cache.bind(plan.bound_to(like))
            plan = cache.plan
        totals = layer_totals(plan.policy, lengths, plan.num_layers, plan.num_heads) if plan.static_totals else None
        cache.enter(Phase.PROMPT, prompt=PromptState(seen, lengths, pad, end, totals, []))
    return seen[:, start:]


@dataclass
class Held:
    """What a layer holds before a chunk: its pages gathered (B, H, E): keys, values, scores, positions,
    merge counts, `stored` (the entry holds something), and the slots each head holds (B, H)."""

    keys: Tensor
    values: Tensor
    scores: Tensor
    positions: Tensor
    counts: Tensor
    stored: Tensor
    slot_count: Tensor
    first: bool  # the layer's first chunk: nothing held

    def attention(self, plan, keys: Tensor | None = None, values: Tensor | None = None):
        """The `held` argument of plan.chunk_attention: these entries (with the merge rule's logit bias),
        followed by `keys`, `values` (B, H, T', d) that every query sees with no bias (a reconstruction
        forward's view of the chunk it reconstructs)."""
        bias = plan.merge_bias(self.counts)
        if keys is None:
            return self.keys, self.values, bias, self.stored
        b, h, t = keys.shape[:3]
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(b, h, t)], dim=2)
        seen = torch.ones(b, h, t, dtype=torch.bool, device=keys.device)
        return (torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2), bias,
                torch.cat([self.stored, seen], dim=2))

    def tokens(self) -> Tensor:
        """(B, H, E) bool: the entries that are kept tokens (not merge slots)."""
        e = torch.arange(self.keys.shape[2], device=self.keys.device)
        return self.stored & (e >= self.slot_count[..., None])


def held_entries(cache: KVCompileCache, layer: int, k: Tensor, v: Tensor) -> Held:
    """The layer's pages gathered (`Held`), in the dtype of k and v (quantized pages dequantize)."""
    b, h, _, d = k.shape
    store = cache.stores[layer]
    if store is None:
        device = k.device
        return Held(k.new_zeros(b, h, 0, d), v.new_zeros(b, h, 0, v.shape[-1]), torch.zeros(b, h, 0, device=device),
                    torch.zeros(b, h, 0, dtype=torch.long, device=device), torch.zeros(b, h, 0, device=device),
                    torch.zeros(b, h, 0, dtype=torch.bool, device=device),
                    torch.zeros(b, h, dtype=torch.long, device=device), True)
    hk, hv, hs, hp, hc, stored = store.gather()
    return Held(hk.to(k.dtype), hv.to(v.dtype), hs, hp, hc, stored, store.slots, False)


@dataclass
class Candidates:
    """A chunk's candidates at one layer (B, H, M + T): the held tokens right-aligned in position order, then
    the chunk's tokens. `src` (B, H, M) the held entry of each held column, `held` = M."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    valid: Tensor
    src: Tensor
    held: int
    scores: Tensor  # (B, H, M + T) the held tokens' scores, 0 for the chunk's
    lengths: Tensor  # (B,) real tokens seen, this chunk's included


def candidates(cache: KVCompileCache, held: Held, k: Tensor, v: Tensor, real: Tensor, start: int,
               end: int) -> Candidates:
    """The candidates of the chunk [start, end) at a layer: the held tokens (right-aligned, position
    order) then the chunk's tokens, with their positions (index − pads) and validity."""
    b, h, t, _ = k.shape
    tokens = held.tokens().sum(-1)  # (B, H)
    m = int(tokens.max()) if tokens.numel() else 0
    cols = torch.arange(m, device=k.device)
    lead = (m - tokens)[..., None]
    held_valid = cols >= lead
    src = (held.slot_count[..., None] + cols - lead).clamp(0, max(held.keys.shape[2] - 1, 0))
    take = lambda x: x.gather(2, src[..., None].expand(*src.shape, x.shape[-1])) if x.dim() == 4 \
        else x.gather(2, src)  # noqa: E731
    pad = cache.prompt.pad
    positions = torch.arange(start, end, device=k.device)[None, :] - pad[:, None]  # (B, T) logical positions
    return Candidates(torch.cat([take(held.keys).to(k.dtype), k], dim=2),
                      torch.cat([take(held.values).to(v.dtype), v], dim=2),
                      torch.cat([take(held.positions), positions[:, None].expand(b, h, t)], dim=2),
                      torch.cat([held_valid, real[:, None].expand(b, h, t)], dim=2), src, m,
                      torch.cat([take(held.scores), torch.zeros(b, h, t, device=k.device)], dim=2),
                      cache.prompt.lengths)


def select_chunk(cache: KVCompileCache, layer: int, held: Held, cand: Candidates, scores: Tensor) -> None:
    """The selection of a chunk's candidates scored `scores` (B, H, M + T) back to the budget of the tokens
    seen, the evicted ones merged into the slots the head holds, written into fresh pages; inside a
    chunk's cascade (reference.ChunkedPrefill, steps 3–4), LAVa's re-selection of the layers below."""
    plan = cache.plan
    policy = plan.policy
    valid, lengths = cand.valid, cand.lengths
    b, h = valid.shape[:2]
    slots = None
    if policy.merges and not held.first:
        slots = merge_slots(held.keys, held.values, held.counts, held.stored, held.slot_count)
    prompt = cache.prompt
    if plan.cascade:  # LAVa Alg. 2 inside the chunk (reference.ChunkedPrefill, step 4)
        prompt.entropy.append(entropy(scores, valid))
        used = torch.zeros(b, h, dtype=torch.long, device=valid.device) if slots is None \
            else (slots.counts > 0).sum(-1)
        now = torch.stack(prompt.held + [valid.sum((1, 2)) + used.sum(-1)], dim=1)
        # the layers above still hold their previous chunk's entries: the layers seen share the rest
        above = sum((s.lengths.sum(-1).to(valid.device) for s in cache.stores[layer + 1:] if s is not None),
                    torch.zeros_like(lengths))
        totals = layer_totals(policy, lengths, plan.num_layers, plan.num_heads,
                              entropy=torch.stack(prompt.entropy, dim=1), capacity=now, reserved=above)
    elif policy.budget.threshold is None:
        totals = layer_totals(policy, lengths, plan.num_layers, plan.num_heads)
    else:
        totals = None
    kept, merged = select_and_merge(policy, cand.keys, cand.values, scores, cand.positions, valid, lengths,
                                    None if totals is None else totals[:, layer], layer, slots)
    cache.hold_store(layer, store_layer(cache, Entries(cand.keys, cand.values, scores, cand.positions,
                                                       torch.ones_like(scores), kept), merged))
    if plan.cascade:
        prompt.held.append(cache.stores[layer].lengths.sum(-1))
        cascade(cache, layer, totals)
