"""The one op: `torch.ops.kvcompile.attend(q, k, v, mask, layer, cache, token, scale)`.

Prefill (the layer's cache is empty): the model's attention over the prompt (SDPA),
then scoring, selection and merging for that layer, and only the kept rows are written
into pages — the layer's full K and V are dropped as soon as the op returns, so the
model never holds the whole prompt's KV for all layers. Layer-dynamic budgets (LAVa)
re-compress the lower layers as a cascade.

Decode: append the new entries to their heads' pages, then attention over the pages
with the merge rule's per-entry bias (ZSMerge Eq. 8: α·log w) when the policy merges.

Every choice (which scorer, selection, merge and decode kernels, what decoding does, spare
pages) was made by the plan (kvcompile.plan) that the cache carries: this module reads it.

The op is an opaque `torch.library.custom_op` with a fake implementation, so compiled
graphs treat it as one call and do not recompile as the cache grows.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile.allocation import decode_budgets, head_budgets, head_budgets_of, head_split, latest, layer_totals
from kvcompile.cache import (ChunkedPrompt, DecodeState, Entries, KVCompileCache, LayerStore, PromptState, append,
                             build_store, writable)
from kvcompile.cache_ref import CacheRef
from kvcompile.layer_state import LayerState
from kvcompile.policies.scoring import entropy
from kvcompile.selection import HeadEntries, Merged, decode_prune, merge_evicted, select, select_and_merge


def _flash_attn():
    """flash-attn's function when it is installed (optional, GPU only), imported lazily."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                     offset: int = 0) -> Tensor:
    """The model's causal attention (SDPA) with left padding: query i (at index offset + i)
    sees real keys j <= offset + i. A pad query attends to itself only, so no NaN appears.
    On a GPU with flash-attn installed, an unpadded prompt runs through flash-attn."""
    b, hq, t, d = q.shape
    n = k.shape[2]
    gqa = hq != k.shape[1]
    if q.is_cuda and mask is None and offset == 0 and t == n and q.dtype in (torch.float16, torch.bfloat16):
        flash = _flash_attn()
        if flash is not None:  # flash-attn takes (B, T, H, d) and handles GQA itself
            out = flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=True)
            return out.transpose(1, 2)
    if mask is None and offset == 0 and t == n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    rows = torch.arange(t, device=q.device)[:, None] + offset
    cols = torch.arange(n, device=q.device)[None, :]
    allowed = (cols <= rows)[None]  # (1, T, N)
    if mask is not None:
        allowed = allowed & mask[:, None, :n]
        allowed = allowed | (cols == rows)[None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale,
                                          enable_gqa=gqa)


# --- prefill ---------------------------------------------------------------------------

def start_prompt(cache: KVCompileCache, mask: Tensor | None, b: int, n: int, like: Tensor) -> PromptState:
    """The prompt's state, read by every layer's compression (and a fresh decode state):
    real tokens, lengths, pads and, where they follow from the lengths alone, the layer totals.
    `like`: a tensor of the model's (device, dtype: the plan is checked against them, or bound to them)."""
    cache.plan = cache.plan.bound_to(like)
    plan = cache.plan
    valid = torch.ones(b, n, dtype=torch.bool, device=like.device) if mask is None else mask[:, -n:].bool()
    lengths = valid.sum(-1)
    totals = layer_totals(plan.policy, lengths, plan.num_layers, plan.num_heads) if plan.static_totals else None
    bar = None
    if cache.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.num_layers, desc="prompt: attention + compression", unit="layer")
    cache.prompt = PromptState(valid, lengths, n - lengths, n, totals, [], bar)
    cache.decoding = None
    cache.rings = [None] * plan.num_layers
    return cache.prompt


def prefill(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
            layer: int, scale: float, rows: Tensor | None = None) -> Tensor:
    """The prompt's attention and the layer's compression: k, v (B, H, N, d) the whole prompt,
    q its last T ≤ N queries (whose attention is returned), `rows` the last query rows the
    scorer reads (default q)."""
    b, hq, t, d = q.shape
    n = k.shape[2]
    if layer == 0:
        start_prompt(cache, mask, b, n, q)
    valid = cache.prompt.valid
    padding = None if bool(valid.all()) else valid
    if cache.plan.attention_scores and rows is None and t == n:  # one pass gives both (the plan's choice)
        out, scores = cache.plan.prompt_scores.attend(cache.plan.policy.scoring, q, k, v, padding, scale)
        compress_prompt_layer(cache, q, k, v, layer, scale, scores=scores)
        return out
    out = prompt_attention(q, k, v, padding, scale, offset=n - t)
    compress_prompt_layer(cache, q if rows is None else rows, k, v, layer, scale)
    return out


def prompt_chunk(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
                 scale: float) -> Tensor:
    """One chunk of a prompt given in several calls (KVCompileCache.expect_prompt): attention
    of the chunk's queries over the prompt so far (causal, as in one pass), the layer's keys,
    values and the query rows the scorer will read held; the chunk that ends the prompt
    compresses the layer over all of it, exactly as `prefill` does for the prompt in one call."""
    chunks = cache.chunks
    t = q.shape[2]
    # held across calls: copies (a compiled graph reuses the memory of its intermediate tensors)
    keys = k.clone() if chunks.keys[layer] is None else torch.cat([chunks.keys[layer], k], dim=2)
    values = v.clone() if chunks.values[layer] is None else torch.cat([chunks.values[layer], v], dim=2)
    seen = keys.shape[2]
    rows = seen if cache.record else cache.policy.scoring.query_rows(chunks.length)
    queries = q.clone() if chunks.queries[layer] is None else torch.cat([chunks.queries[layer], q], dim=2)
    queries = queries[:, :, queries.shape[2] - min(rows, queries.shape[2]):]
    if seen < chunks.length:
        chunks.keys[layer], chunks.values[layer], chunks.queries[layer] = keys, values, queries
        padding = None if mask is None or bool(mask[:, :seen].all()) else mask[:, :seen].bool()
        return prompt_attention(q, keys, values, padding, scale, offset=seen - t)
    chunks.keys[layer] = chunks.values[layer] = chunks.queries[layer] = None
    if layer == cache.plan.num_layers - 1:
        cache.chunks = None
    return prefill(cache, q, keys, values, mask, layer, scale, rows=queries)


# --- a prompt compressed while prefilling in chunks (schedule.prefill: chunk) ------------------

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
    cache.stores[layer] = _store(cache, Entries(keys, values, scores, cand_pos, torch.ones_like(scores), kept), merged)
    if plan.prune_every:  # the latest query rows, for pruning while decoding
        ring = q if cache.rings[layer] is None else torch.cat([cache.rings[layer], q], dim=2)
        cache.rings[layer] = ring[:, :, ring.shape[2] - min(plan.ring_rows, ring.shape[2]):].clone()
    if plan.cascade:
        prompt.held.append(cache.stores[layer].lengths.sum(-1))
        _cascade(cache, layer, totals)
    return out


def compress_prompt_layer(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float,
                          scores: Tensor | None = None) -> None:
    """Scoring, selection and merging of one layer's prompt entries, written into pages
    (and the cascade over the layers below). q holds the last R ≥ query_rows prompt queries;
    `scores` (B, H, N): the layer's scores when the prompt's attention computed them already."""
    b, hq, r, d = q.shape
    h, n = k.shape[1], k.shape[2]
    plan, prompt = cache.plan, cache.prompt
    valid = prompt.valid
    policy = plan.policy
    rows = r if cache.record else policy.scoring.query_rows(n)
    state = plan.state(q[:, :, r - rows:], k, v, None if bool(valid.all()) else valid, scale)
    if cache.record:  # copies: a compiled graph reuses the memory of its intermediate tensors
        cache.states[layer] = LayerState(state.queries.clone(), k.clone(), v.clone(), state.mask, scale, state.rope)
    scores = plan.score(state) if scores is None else scores
    positions = (torch.arange(n, device=q.device)[None, :] - prompt.pad[:, None])[:, None, :].expand(b, h, n)
    valid_h = valid[:, None, :].expand(b, h, n)
    every = None  # tensor parallelism: the candidates of every head, where the selection reads them
    if plan.heads_exchange == "scores":  # positions and validity are the same for every head of a prompt
        heads = plan.num_heads
        every = (plan.shard.gather_heads(scores), positions[:, :1].expand(b, heads, n),
                 valid[:, None, :].expand(b, heads, n), torch.zeros(b, heads, dtype=torch.long, device=q.device))
    if plan.cascade:
        # LAVa Eq. 7-8 over every head's scores (with a heads rule that reads its own head only, the
        # layers rule reads no entropy: plan.heads_exchange)
        prompt.entropy.append(entropy(scores, valid_h) if every is None else entropy(every[0], every[2]))
        held = torch.stack(prompt.held + [valid.sum(-1) * plan.num_heads], dim=1)
        totals = layer_totals(policy, prompt.lengths, plan.num_layers, plan.num_heads,
                              entropy=torch.stack(prompt.entropy, dim=1), capacity=held)
    else:
        totals = prompt.totals
    total = None if totals is None else totals[:, layer]
    kept, merged = _select_and_merge(cache, k, v, scores, positions, valid_h, total, layer, every)
    cache.stores[layer] = _store(cache, Entries(k, v, scores, positions, torch.ones_like(scores), kept), merged)
    if plan.prune_every:  # the latest query rows the scorer reads, for pruning while decoding (maybe none)
        cache.rings[layer] = q[:, :, r - min(plan.ring_rows, n):].clone()
    if plan.cascade:
        prompt.held.append(_over_heads(plan, cache.stores[layer].lengths.sum(-1)))
        if prompt.protected is None:  # the same in every head of a prompt
            protected = policy.ranking.protected(positions[:, :1], prompt.lengths.view(-1, 1, 1)) & valid_h[:, :1]
            prompt.protected = protected.sum((1, 2)) * plan.num_heads
        _cascade(cache, layer, totals)
    if prompt.progress is not None:
        prompt.progress.update(1)
        if layer == plan.num_layers - 1:
            prompt.progress.close()


def _cascade(cache: KVCompileCache, layer: int, totals: Tensor) -> None:
    """LAVa Alg. 2 after `layer`: every lower layer is re-selected among what it holds with its
    new total. A lazy cascade (a nested heads rule: Plan.lazy_cascade) only counts what each
    layer would hold, max(protected, min(total, held)), and re-selects its pages when they hold
    more than twice that, and once more after the last layer: what it keeps is the same, in
    O(L log L) re-selections instead of L(L − 1)/2 (pages up to twice the budget meanwhile)."""
    plan, prompt = cache.plan, cache.prompt
    last = layer == plan.num_layers - 1
    if not plan.lazy_cascade:
        for lower in range(layer):
            _recompress(cache, lower, totals[:, lower])
        if layer:  # what the layers below hold now, over all heads
            held = _over_heads(plan, _layer_sums(cache, range(layer), totals.device))
            prompt.held[:layer] = list(held.unbind(1))
        return
    if layer:  # what the pages of the layers below hold, over all heads (B, layer)
        hold = _over_heads(plan, _layer_sums(cache, range(layer), totals.device))
    for lower in range(layer):
        prompt.held[lower] = torch.maximum(prompt.protected, torch.minimum(totals[:, lower], prompt.held[lower]))
        pages_hold = hold[:, lower]
        if bool((pages_hold > prompt.held[lower]).any()) and (last or bool((pages_hold > 2 * prompt.held[lower]).any())):
            _recompress(cache, lower, totals[:, lower])


def _layer_sums(cache: KVCompileCache, layers, device: torch.device) -> Tensor:
    """(B, len(layers)) entries each of these layers' pages hold over this process's heads, on `device`
    (the layers' pages may live on several devices)."""
    return torch.stack([cache.stores[i].lengths.sum(-1).to(device) for i in layers], 1)


def _select_and_merge(cache: KVCompileCache, k, v, scores, positions, valid, total, layer, every=None):
    """A layer's first compression: the selection kernels (kvcompile.kernels.select: equal to
    selection.select), then the evicted tokens merged into the merge slots: by the merge
    kernel the plan names (kvcompile.kernels.merge: the same sequential rule, bit for bit),
    else by the merge rule itself, head by head (selection.merge_evicted). `every`: every
    head's candidates when a tensor-parallel rank has gathered them (see _choose); in a prompt every
    head has the same candidates."""
    plan = cache.plan
    policy = plan.policy
    kept, budgets = _choose(cache, scores, positions, valid, cache.prompt.lengths, total, layer, kernels=True,
                            every=every, same_heads=True)
    if not policy.merges:
        return kept, None
    b, h, _, d = k.shape
    if total is None:  # a threshold gives no slots: the evicted tokens are dropped
        return kept, Merged(k.new_zeros(b, h, 0, d), v.new_zeros(b, h, 0, v.shape[-1]),
                            torch.zeros(b, h, 0, dtype=torch.long, device=k.device))
    num_slots = budgets.slots
    if plan.prompt_merge is None:
        return kept, merge_evicted(policy, k, v, scores, valid & ~kept, None, num_slots, positions)
    from kvcompile.kernels.merge import merge_order

    keys, values, num = merge_order(k, v, scores, valid & ~kept, positions)
    size = int(num_slots.max())
    sk, sv, counts = plan.prompt_merge(k.new_zeros(b, h, size, d), v.new_zeros(b, h, size, v.shape[-1]),
                                       torch.zeros(b, h, size, dtype=torch.long, device=k.device), keys, values,
                                       num, num_slots)
    return kept, Merged(sk, sv, counts)


def _store(cache: KVCompileCache, tokens: Entries, merged: Merged | None):
    """Pages for one layer: the occupied residual slots of each head first, then its kept tokens,
    written by the gather kernel (kvcompile.kernels.select.build_pages, build_store's layout)."""
    b, h = tokens.take.shape[:2]
    sources = [tokens]
    slots = torch.zeros(b, h, dtype=torch.long, device=tokens.take.device)
    if merged is not None:
        counts = merged.counts
        occupied = counts > 0
        slots = occupied.sum(-1)
        sources.insert(0, Entries(merged.keys, merged.values, torch.zeros_like(counts, dtype=torch.float32),
                                  -1 - torch.arange(counts.shape[-1], device=counts.device).expand_as(counts),  # slot r at -1 - r
                                  counts.float(), occupied))
    pages = cache.plan.selection.build_pages(sources, cache.page_size, cache.plan.spare_pages)
    return LayerStore(**pages._asdict(), slots=slots)


def _over_heads(plan, x: Tensor) -> Tensor:
    """A count over this process's heads → over all heads (tensor parallelism: a sum over ranks)."""
    return x if plan.shard is None else plan.shard.total(x)


def _choose(cache: KVCompileCache, scores: Tensor, positions: Tensor, valid: Tensor, lengths: Tensor,
            total: Tensor | None, layer: int, used: Tensor | None = None, *, kernels: bool, every=None,
            same_heads: bool = False):
    """The selection of this process's heads and their HeadBudgets (None under a threshold):
    kept (B, H', M) bool; lengths (B,) the sequences' real lengths. With one process, `select` over its heads (the kernels', or
    kvcompile.selection's where a layer is re-selected). Under tensor parallelism, exactly what
    one process selects over all heads (Plan.heads_exchange): "counts": every head's candidate
    and slot counts (B, H, 2) are gathered for the head budgets and each head selects from its
    own scores (`same_heads`: a prompt, where every head has the same candidates and no slots:
    nothing to gather); "scores": every head's candidates (`every`: scores, positions, valid, used,
    when the caller has them; else gathered) and the selection over all heads, of which this rank
    keeps its heads' part."""
    plan = cache.plan
    policy, shard = plan.policy, plan.shard
    run = plan.selection.select if kernels else select
    if used is None:
        used = torch.zeros(valid.shape[:2], dtype=torch.long, device=valid.device)
    if plan.heads_exchange != "scores":
        budgets = None
        if total is not None:
            counts = torch.stack([valid.sum(-1), used], dim=-1)
            if same_heads:
                counts = counts[:, :1].expand(-1, plan.num_heads, -1)
            elif shard is not None:  # (B, H/P, 2) candidates and used slots of each head → (B, H, 2)
                counts = shard.gather_heads(counts)
            budgets = head_budgets_of(policy, counts[..., 0], total, counts[..., 1]).heads(plan.heads)
        return run(policy, scores, positions, valid, lengths, total, layer, used, budgets=budgets), budgets
    s, p, v, u = shard.gather_entries(scores, positions, valid, used) if every is None else every
    budgets = None if total is None else head_budgets(policy, v, total, u)
    kept = shard.local(run(policy, s, p, v, lengths, total, layer, u, budgets=budgets))[..., :valid.shape[-1]]
    return kept, None if budgets is None else budgets.heads(plan.heads)


def _recompress(cache: KVCompileCache, layer: int, total: Tensor) -> None:
    """Cascade step (LAVa Alg. 2): re-select a compressed layer with its new, smaller total. A total that
    covers every entry the layer holds (tokens and slots, in every sequence) keeps them all, evicting and
    merging nothing (the head budgets water-fill to what each head holds): that re-selection is skipped
    (most of a chunked prompt's cascade steps). Under tensor parallelism the store holds this rank's heads
    only, so every step runs."""
    policy = cache.policy
    store = cache.stores[layer]
    total = total.to(store.lengths.device)  # a later layer's step: it may run on another device
    if cache.plan.shard is None and bool((total >= store.lengths.sum(-1)).all()):
        return
    k, v, scores, pos, counts, stored = store.gather()
    e = torch.arange(k.shape[2], device=k.device)
    is_slot = stored & (e < store.slots[..., None])
    is_token = stored & ~is_slot
    slots = None
    if policy.merges:
        width = int(store.slots.max())
        slots = Merged(k[:, :, :width], v[:, :, :width],
                       torch.where(is_slot[:, :, :width], counts[:, :, :width], 0).long())
    choose = None if cache.plan.shard is None else functools.partial(_choose, cache, kernels=False)
    kept, merged = select_and_merge(policy, k, v, scores.masked_fill(~is_token, float("-inf")),
                                    pos, is_token, cache.prompt.lengths.to(k.device), total, layer, slots, choose)
    cache.stores[layer] = _store(cache, Entries(k, v, scores, pos, counts, kept), merged)


# --- decode ----------------------------------------------------------------------------

def decode(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float,
           start: int | None = None) -> Tensor:
    """Append T new tokens and attend over the pages (new token t sees entries up to itself);
    then the decode schedule: running scores, ZSMerge online eviction, periodic pruning.
    `start`: the sequence index of the first new token (default: what the cache holds)."""
    plan = cache.plan
    start = cache.seq_length if start is None else start
    store = cache.stores[layer]
    running, online, every = plan.running_scores, plan.online_eviction, plan.prune_every
    if cache.decoding is None:
        if all(s is not None for s in cache.stores):
            cache.decoding = start_decode(cache)
        elif online or every:  # tokens after a prompt that ends inside this call: later layers are not compressed yet
            raise RuntimeError("kvcompile: the decode schedule needs every layer compressed before tokens follow "
                               "the prompt in the same call")
    pad, width = cache.prompt.pad if cache.decoding is None else cache.decoding.pad, cache.prompt.width
    outs = []
    for i in range(q.shape[2]):
        position = start + i - pad  # logical position among real tokens
        out = None
        if plan.online_step is not None and plan.online_step.runs(store, q.shape[1]):
            # append, attention, running scores, online eviction: one fused step
            split = cache.decoding.split[:, layer] if online else None
            out = plan.online_step(store, q[:, :, i], k[:, :, i], v[:, :, i], position, split, scale)
        if out is not None:
            out = out.to(q.dtype)
            store.room -= 1  # the fused step appended into the pages the head owns
        else:  # no fused step, or not its common case (a head taking a fresh page, several to evict)
            append(store, k[:, :, i], v[:, :, i], position, step=plan.spare_pages)
            if running or online:
                out, probs = _attend_with_probs(cache, store, q[:, :, i], scale)
                if running:
                    _update_scores(cache, store, probs)
                if online:
                    _evict_online(cache, store, layer)
            else:
                out = paged_attention(cache, store, q[:, :, i], scale)
        outs.append(out)
        if every:
            if plan.ring_rows:  # the ring keeps the latest `ring_rows` queries
                cache.rings[layer] = torch.cat([cache.rings[layer], q[:, :, i, None]], dim=2)[:, :, -plan.ring_rows:]
            generated = start - width + i + 1
            if generated % every == 0:
                _prune(cache, layer, position + 1, scale)
                store = cache.stores[layer]
    return torch.stack(outs, dim=2)


def start_decode(cache: KVCompileCache) -> DecodeState:
    """Per-head decode budgets (and the ZSMerge split of each), fixed after the prompt."""
    plan = cache.plan
    policy = plan.policy
    lengths = cache.prompt.lengths
    budgets = decode_budgets(policy, lengths, plan.num_layers, plan.num_heads, cache.kept(lengths.device), plan.heads)
    totals = None
    if plan.shard is not None and plan.prune_every and policy.budget.threshold is None:
        totals = _over_heads(plan, budgets.sum(-1))  # (B, L): what pruning keeps per layer, over all heads
    split = None
    if policy.budget.split is not None:
        split = torch.tensor([[[head_split(policy, int(n)) for n in row] for row in per_b]
                              for per_b in budgets.tolist()], dtype=torch.long, device=budgets.device)  # (B, L, H, 3)
    return DecodeState(budgets, split, cache.prompt.pad, totals)


def _gather(store):
    flat, stored = store.entries()
    d = store.k_pages.shape[-1]
    return flat, stored, store.k_pages.reshape(-1, d)[flat], store.v_pages.reshape(-1, d)[flat]


def _attend_with_probs(cache: KVCompileCache, store, q: Tensor, scale: float):
    """Decode attention over the gathered entries, also returning the attention of every entry
    reduced over each GQA group as the scorer reduces it (B, H, E): the running scores need it."""
    plan = cache.plan
    flat, stored, keys, values = _gather(store)
    b, hq, d = q.shape
    h = keys.shape[1]
    g = hq // h
    logits = torch.einsum("bhgd,bhed->bhge", q.float().view(b, h, g, d), keys.float()) * scale
    bias = plan.merge_bias(store.count_pages.reshape(-1)[flat])
    if bias is not None:
        logits = logits + bias[:, :, None, :]
    logits = logits.masked_fill(~stored[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhge,bhed->bhgd", probs, values.float()).reshape(b, hq, d).to(q.dtype)
    return out, plan.policy.scoring.reduce_group(probs, 2)


def _update_scores(cache: KVCompileCache, store, probs: Tensor) -> None:
    """Each token entry's running score ← scoring.running_update(score, attention), written with no host
    read: entries past a head's pages share page 0 in `store.entries()`, so the new scores are written
    by two scatter-adds that are exact whatever the order (s − s = 0, then 0 + new; the others add 0)."""
    flat, stored = store.entries()
    pos = store.pos_pages.reshape(-1)[flat]
    scores = store.score_pages.view(-1)
    old = scores[flat]
    new = cache.policy.scoring.running_update(old, probs)
    tokens = stored & (pos >= 0)
    flat = flat.reshape(-1)
    scores.scatter_add_(0, flat, torch.where(tokens, -old, 0.0).reshape(-1))
    scores.scatter_add_(0, flat, torch.where(tokens, new, 0.0).to(scores.dtype).reshape(-1))


def _evict_online(cache: KVCompileCache, store, layer: int) -> None:
    """ZSMerge Alg. 1, every (sequence, head) at once: while a head holds more tokens than
    proximity + context, its lowest running score outside the latest B_p tokens (ties: the
    earliest position, as reference.decode_step) leaves into the residual slots. Each round
    takes one victim from every head over its budget; a decode step appends one token per
    head, so one round is the rule once every head is within its budget (`store.settled`: no host
    read then); right after a prompt that filled the cache, the rounds are counted on the host."""
    prox, context, slots = cache.decoding.split[:, layer].unbind(-1)  # (B, H) each
    flat, stored = store.entries()
    pos = store.pos_pages.reshape(-1)[flat]
    tokens = stored & (pos >= 0)
    excess = tokens.sum(-1) - prox - context  # (B, H) tokens to evict: at most 1 after a full step
    rounds = 1 if store.settled else int(excess.max())
    for done in range(rounds):
        if done:  # entries moved: look again
            flat, stored = store.entries()
            pos = store.pos_pages.reshape(-1)[flat]
            tokens = stored & (pos >= 0)
        candidates = tokens & ~latest(pos, tokens, prox)
        scores = store.score_pages.reshape(-1)[flat].masked_fill(~candidates, float("inf"))
        lowest = candidates & (scores == scores.amin(-1, keepdim=True))
        victim = pos.masked_fill(~lowest, torch.iinfo(pos.dtype).max).argmin(-1)  # (B, H) entry index
        _merge_victims(cache, store, excess > done, victim, slots, flat, pos, stored, check=not store.settled)
    if not store.settled:  # every head within its budget from now on: its length stays at most budget + 1
        store.settled = True
        if bool((store.owned * store.page_size > prox + context + slots).all()):
            store.room = ONLINE_ROOM  # its appends never need a page


ONLINE_ROOM = 1 << 62  # LayerStore.room of a settled online-eviction store whose pages hold every head's budget


def _merge_victims(cache: KVCompileCache, store, leaving: Tensor, victim: Tensor, slots: Tensor, flat: Tensor,
                   pos: Tensor, stored: Tensor, check: bool = True) -> None:
    """Entry victim[b, h] of every head with leaving[b, h] leaves (reference._merge_one, ZSMerge
    Alg. 1 lines 11–15), all heads at once: with no slot it is dropped; with a free slot it
    becomes that slot in place (its key and value are the slot's mean, count 1); else it folds
    into the slot r of largest k_r·k (ties: lowest r), k_r ← (w·k_r + k)/(w + 1), the same for
    v, w ← w + 1 (Eq. 6–7, computed as Residual.merge does), and is removed. (The plan admits
    online eviction only for the merge rules this implements: Residual, and Drop with no slots.) slots (B, H) is each
    head's B_r; slot r of a head is its entry at position −1 − r. Branch-free, with fixed shapes and no
    host read: every head computes all three cases, and a head writes only its own (its victim and
    its slot lie in its own pages, so the writes of different heads never meet); `check` reads the
    slot invariant back to the host (the host-counted rounds after the prompt)."""
    from kvcompile.cache import remove_where

    is_slot = stored & (pos < 0)
    held = is_slot.sum(-1)  # (B, H) occupied slots
    if check and bool((leaving & (held > slots)).any()):
        raise RuntimeError("kvcompile: a head holds more residual slots than its ZSMerge split allows")
    entry = flat.gather(-1, victim[..., None]).squeeze(-1)  # (B, H) page·S + slot of each victim
    fresh = leaving & (slots > 0) & (held < slots)
    pf, sf = store.pos_pages.view(-1), store.score_pages.view(-1)
    pf[entry] = torch.where(fresh, -1 - held, pf[entry])
    sf[entry] = torch.where(fresh, 0.0, sf[entry])
    store.slots += fresh
    fold = leaving & (slots > 0) & (held == slots)
    d = store.k_pages.shape[-1]
    kf, vf, cf = store.k_pages.view(-1, d), store.v_pages.view(-1, d), store.count_pages.view(-1)
    compute = torch.promote_types(kf.dtype, torch.float32)
    key = kf[entry].to(compute)  # (B, H, d)
    dots = torch.matmul(kf[flat].to(compute), key[..., None]).squeeze(-1).masked_fill(~is_slot, float("-inf"))
    closest = is_slot & (dots == dots.amax(-1, keepdim=True))
    target = pos.masked_fill(~closest, torch.iinfo(pos.dtype).min).argmax(-1)  # highest −1 − r: lowest r
    slot = flat.gather(-1, target[..., None]).squeeze(-1)  # (B, H)
    w = cf[slot][..., None]  # the slot's count, exact in float32
    on = fold[..., None]
    kf[slot] = torch.where(on, ((w * kf[slot].to(compute) + key) / (w + 1)).to(kf.dtype), kf[slot])
    vf[slot] = torch.where(on, ((w * vf[slot].to(compute) + vf[entry].to(compute)) / (w + 1)).to(vf.dtype),
                           vf[slot])
    cf[slot] = torch.where(fold, w.squeeze(-1) + 1, cf[slot])
    remove_where(store, leaving & ~fresh, victim)  # dropped (no slot) or folded into a slot


def _prune(cache: KVCompileCache, layer: int, lengths: Tensor, scale: float) -> None:
    """`decode: every n`: re-score the layer with the ring of latest queries and prune it back
    to its budget (selection.decode_prune), then write it into fresh pages."""
    heads = store_heads(cache.stores[layer])
    totals, choose = cache.decoding.totals, None
    if cache.plan.shard is not None:
        choose = functools.partial(_choose, cache, kernels=False)
    decode_prune(cache.policy, heads, cache.rings[layer], lengths, cache.decoding.budgets[:, layer], layer, scale,
                 total=None if totals is None else totals[:, layer], choose=choose)
    cache.stores[layer] = heads_store(cache, heads)


def store_heads(store) -> list[list[HeadEntries]]:
    """A layer's pages as HeadEntries (entry order kept)."""
    k, v, scores, pos, counts, stored = store.gather()
    return [[HeadEntries(k[b, h, :n], v[b, h, :n], pos[b, h, :n], scores[b, h, :n], counts[b, h, :n])
             for h, n in enumerate(row)] for b, row in enumerate(store.lengths.tolist())]


def heads_store(cache: KVCompileCache, heads) -> LayerStore:
    b, h = len(heads), len(heads[0])
    width = max(1, max(len(x.positions) for row in heads for x in row))
    first = heads[0][0]
    d = first.keys.shape[-1]
    keys = first.keys.new_zeros(b, h, width, d)
    values = first.values.new_zeros(b, h, width, d)
    dev = first.keys.device
    scores = torch.zeros(b, h, width, device=dev)
    pos = torch.full((b, h, width), -1, dtype=torch.long, device=dev)
    counts = torch.zeros(b, h, width, device=dev)
    take = torch.zeros(b, h, width, dtype=torch.bool, device=dev)
    for i, row in enumerate(heads):
        for j, x in enumerate(row):
            n = len(x.positions)
            keys[i, j, :n], values[i, j, :n], scores[i, j, :n] = x.keys, x.values, x.scores
            pos[i, j, :n], counts[i, j, :n], take[i, j, :n] = x.positions, x.counts, True
    return build_store([Entries(keys, values, scores, pos, counts, take)], (take & (pos < 0)).sum(-1),
                       cache.page_size, cache.plan.spare_pages)


def paged_attention(cache: KVCompileCache, store, q: Tensor, scale: float) -> Tensor:
    """Attention of one query per head over that head's pages, with the merge rule's bias, by the
    plan's decode attention backend."""
    bias = cache.plan.merge_bias(store.count_pages)
    return cache.plan.decode_attention(q, store.k_pages, store.v_pages, store.block_table, store.lengths, bias,
                                       scale)


# --- the op ----------------------------------------------------------------------------

@torch.library.custom_op("kvcompile::attend", mutates_args=("token",))
def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int, cache: CacheRef, token: Tensor,
           scale: float) -> Tensor:
    """Prefill attention + scoring + compression, or decode append + paged attention.

    q (B, Hq, T, d), k/v (B, H, T, d): the layer's new queries, keys, values after RoPE;
    mask (B, ≥T) bool padding mask (True = real token) or None; `cache` and `token`: the
    KVCompileCache's `ref` and `token` (kvcompile.cache_ref). Returns (B, Hq, T, d).
    """
    cache = cache.cache
    token.add_(1)  # the declared write (see below the op)
    if k.shape[1] != len(cache.plan.kv_heads):
        if cache.plan.shard is None and k.shape[1] > len(cache.plan.kv_heads):
            cause = "the cache was made for a model with fewer KV heads (make it from this model)"
        else:
            cause = ("the cache was made for another model, or for another tensor-parallel split (a sharded model "
                     "needs its cache from kvcompile.compile(model, ...), or a plan built with "
                     "shard=kvcompile.sharding.model_shard(model))")
        raise RuntimeError(f"kvcompile: layer {layer} computes {k.shape[1]} KV heads but the cache's plan holds "
                           f"{len(cache.plan.kv_heads)}: {cause}")
    expected = cache.plan.layer_device(layer)
    if (layer or cache.stores[0] is not None) and expected is not None and q.device != expected:
        raise RuntimeError(  # compile() (or layer 0's first prompt) fixed where each layer runs: kvcompile.devices
            f"kvcompile: layer {layer} runs on {q.device} but its pages live on {expected}: the cache's plan puts "
            "every layer where it was told (kvcompile.compile() reads each layer's device off the model; a cache "
            "built from a policy and a config alone puts them all where layer 0's first prompt runs). Compile the "
            "model again after moving it, and give a model whose layers run on several devices the cache its "
            "generate() makes, or KVCompileCache.from_plan(model.kvcompile_plan)")
    if cache.plan.layer_devices is not None:  # layers on several devices: the state every layer reads, here
        cache.state_to(q.device)
    dtype = q.dtype
    autocast = torch.is_autocast_enabled(q.device.type)
    if autocast:  # as the model's SDPA under autocast: q, k, v in the autocast dtype (module doc of _attend)
        low = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(low), k.to(low), v.to(low)
    # Triton launches on the current CUDA device: the layer's (a pipeline's layers run on several GPUs)
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext(), \
            torch.autocast(q.device.type, enabled=False) if autocast else contextlib.nullcontext():
        out = _attend(cache, q, k, v, mask, layer, scale)
    if layer == cache.num_layers - 1 and not (cache.reconstruction is not None and cache.reconstruction.scoring):
        cache.seq_length += q.shape[2]  # (a reconstruction forward adds nothing to the cache)
    return out.to(dtype).contiguous()


def _attend(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
            scale: float) -> Tensor:
    """attend()'s step on the layer's device: the prompt (in one call, in calls, or in chunks the policy
    compresses after each) or decode.

    Under torch.autocast, attend() gets q and k in float32 (RoPE's float32 cos and sin promote them)
    and v in the autocast dtype; the model's own SDPA would cast all three to the autocast dtype,
    and so does attend(): q, k, v in that dtype, then this step with autocast off (the plan's
    caches compile()'s entry makes are planned for that dtype, `Plan.with_dtype`, and the pages hold
    it), and the output back in q's dtype (the o_proj that follows casts it to the autocast dtype
    again, without loss)."""
    if cache.reconstruction is not None:  # a reconstruction scorer's prompt or reconstruction pass (kvcompile.kvzip)
        return reconstruction_step(cache, q, k, v, mask, layer, scale)
    if cache.plan.prefill_chunk and (cache.stores[layer] is None or cache.compressing is not None):
        out = chunked_prefill(cache, q, k, v, mask, layer, scale)
    elif cache.stores[layer] is None:
        chunks = cache.chunks
        if chunks is None:
            out = prefill(cache, q, k, v, mask, layer, scale)
        elif cache.seq_length + q.shape[2] <= chunks.length:
            out = prompt_chunk(cache, q, k, v, mask, layer, scale)
        else:  # the prompt ends inside this call (assisted decoding sends it with candidate tokens)
            end = chunks.length
            cut = end - cache.seq_length
            head = prompt_chunk(cache, q[:, :, :cut], k[:, :, :cut], v[:, :, :cut],
                                None if mask is None else mask[:, :end], layer, scale)
            tail = decode(cache, q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], layer, scale, start=end)
            out = torch.cat([head, tail], dim=2)
    else:
        if not torch.is_inference_mode_enabled():
            writable(cache.stores[layer])  # a cache made under inference_mode, used outside it
        out = decode(cache, q, k, v, layer, scale)
    return out


# --- a reconstruction scorer's prompt and reconstruction forwards (kvcompile.kvzip drives them) -------

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


@attend.register_fake
def _(q, k, v, mask, layer, cache, token, scale):
    return q.new_empty(q.shape)


def _plain_prompt(cache: KVCompileCache, q: Tensor, k: Tensor, layer: int) -> bool:
    """attend() just ran the plain prompt path at `layer`: a fresh cache's prompt in one call, whose
    output is the model's causal attention over the prompt (`prefill`; the first chunk of a prompt
    compressed chunk by chunk is the same attention). Read after the call, from the cache's state."""
    prompt, n = cache.prompt, k.shape[2]
    last = layer == cache.plan.num_layers - 1
    return (prompt is not None and cache.decoding is None and cache.chunks is None and prompt.width == n
            and q.shape[2] == n and cache.seq_length == (n if last else 0))


def _setup_backward(ctx, inputs, output):
    q, k, v, mask, layer, ref, token, scale = inputs
    cache = ref.cache
    ctx.plain = _plain_prompt(cache, q, k, layer)
    ctx.scale = scale
    valid = cache.prompt.valid if ctx.plain else None
    ctx.save_for_backward(q, k, v, None if valid is None or bool(valid.all()) else valid)


def _backward(ctx, grad):
    """Backward through a prompt's attention (saliency maps, gradients of the prompt's logits): the
    prompt path's output is the model's causal attention over the prompt (`prompt_attention`), so its
    gradient is that attention's, recomputed here. The compression does not change the prompt's
    outputs, and nothing else is differentiable: a decode step or a prompt continued in later calls
    attends to what the policy kept (selection is not differentiable), refused with the reason."""
    if not ctx.plain:
        raise RuntimeError("kvcompile: backward through kvcompile.attend is defined for a prompt's attention only "
                           "(a fresh cache, the prompt in one forward call); this call decoded or continued a "
                           "cache, whose attention reads the entries the policy selected (not differentiable): "
                           "run it under torch.no_grad(), or differentiate the prompt's forward call")
    q, k, v, valid = ctx.saved_tensors
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = prompt_attention(*inputs, valid, ctx.scale)
        grads = torch.autograd.grad(out, inputs, grad.to(out.dtype), allow_unused=True)
    return (*(None if g is None else g.to(x.dtype) for g, x in zip(grads, (q, k, v))), None, None, None, None, None)


class _Attend(torch.autograd.Function):
    """The op with the gradient of a prompt's attention (`_setup_backward`, `_backward`), which the eager
    entry calls where grad mode is on. torch.library refuses an autograd formula on an op whose schema
    declares a write (`attend.register_autograd`: "non-functional operator"), so the formula sits in this
    Function around the op; the write is the token's (never differentiable), and the op runs below it as
    in any call."""

    @staticmethod
    def forward(q, k, v, mask, layer, cache, token, scale):
        return torch.ops.kvcompile.attend(q, k, v, mask, layer, cache, token, scale)

    setup_context = staticmethod(_setup_backward)
    backward = staticmethod(_backward)


# What the op mutates: the cache its `cache` argument names (pages, lengths, scores; a CacheRef, opaque to
# torch), which no schema can name. The schema declares it as a write of that cache's `token` ((1,) int64,
# `mutates_args=("token",)`; the op bumps it): functionalization and Inductor see every call as a write
# of its cache's state, and all calls of a graph write the same token, so none is reordered, merged or
# dropped, whatever data flows between them (tests/test_isolation.py). q, k, v, mask: not written. No
# effect token: an ordered effect (`attend.register_effect`) would thread one through the graph, and torch
# 2.13's Inductor does not cache graphs holding its `with_effects` operator, so every process would compile
# the model again; the token is an ordinary graph input, which the FX graph cache takes (tests/
# test_compiled.py's warm start; docs/INTERNALS.md "The op and its two entries").


# --- transformers' attention and mask interfaces ------------------------------------------

def kvcompile_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface entry: routes to `torch.ops.kvcompile.attend`."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = kwargs.get("kvcompile_cache")
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    if cache is None:  # no KVCompileCache (use_cache=False or another cache): plain attention
        offset = key.shape[2] - query.shape[2]
        out = prompt_attention(query, key, value, mask, scale, offset)
    else:
        args = (query, key, value, mask, module.layer_idx, cache.ref, cache.token, scale)
        out = _Attend.apply(*args) if torch.is_grad_enabled() else torch.ops.kvcompile.attend(*args)
    return out.transpose(1, 2).contiguous(), None


def kvcompile_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, **kwargs):
    """transformers AttentionMaskInterface entry: the op takes the 2-D padding mask as is
    (True = real token); None when nothing is padded."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.bool()
