"""The prompt, in one call or in several (a prompt the cache was told to expect): the model's causal
attention over it and, per layer, scoring, selection and merging; only the kept rows are written into
pages, so the layer's full K and V are dropped as soon as its op returns and the model never holds the
whole prompt's KV for all layers. Layer-dynamic budgets (LAVa) re-compress the lower layers as a cascade
(engine.cascade)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile.allocation import global_totals, layer_pool, layer_totals
from kvcompile.engine.cascade import cascade
from kvcompile.engine.compress import over_heads, select_and_merge_kernels, store_layer
from kvcompile.store import Entries
from kvcompile.engine.explicit import explicit_attention
from kvcompile.engine.state import Phase, PromptState
from kvcompile.policies.scoring import entropy

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache


def _flash_attn():
    """flash-attn's function when it is installed (optional, GPU only), imported lazily."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                     offset: int = 0, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """The model's causal attention (SDPA) with left padding: query i (at index offset + i)
    sees real keys j <= offset + i. A pad query attends to itself only, so no NaN appears.
    On a GPU with flash-attn installed, an unpadded prompt runs through flash-attn.
    softcap: the model's logit soft-cap (Gemma 2: cap·tanh(s/cap) before the softmax), else None; sinks: the layer's
    learned sinks (gpt-oss: (Hq,), one logit per query head in the denominator), else None."""
    b, hq, t, d = q.shape
    n = k.shape[2]
    gqa = hq != k.shape[1]
    explicit = softcap or sinks is not None  # attention written out (engine.explicit)
    if not explicit and q.is_cuda and mask is None and offset == 0 and t == n \
            and q.dtype in (torch.float16, torch.bfloat16):
        flash = _flash_attn()
        if flash is not None:  # flash-attn takes (B, T, H, d) and handles GQA itself
            out = flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=True)
            return out.transpose(1, 2)
    if not explicit and mask is None and offset == 0 and t == n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    rows = torch.arange(t, device=q.device)[:, None] + offset
    cols = torch.arange(n, device=q.device)[None, :]
    allowed = (cols <= rows)[None]  # (1, T, N)
    if mask is not None:
        allowed = (allowed & mask[:, None, :n]) | (cols == rows)[None]
    if explicit:
        return explicit_attention(q, k, v, allowed[:, None], scale, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=gqa)


def start_prompt(cache: KVCompileCache, mask: Tensor | None, b: int, n: int, like: Tensor) -> PromptState:
    """The prompt's state, read by every layer's compression (and a fresh decode state):
    real tokens, lengths, pads and, where they follow from the lengths alone, the layer totals.
    `like`: a tensor of the model's (device, dtype: the plan is checked against them, or bound to them)."""
    cache.bind(cache.plan.bound_to(like))
    plan = cache.plan
    valid = torch.ones(b, n, dtype=torch.bool, device=like.device) if mask is None else mask[:, -n:].bool()
    lengths = valid.sum(-1)
    totals = layer_totals(plan.policy, lengths, plan.num_layers, plan.num_heads) if plan.static_totals else None
    bar = None
    if cache.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.num_layers, desc="prompt: attention + compression", unit="layer")
    cache.enter(Phase.PROMPT, prompt=PromptState(valid, lengths, n - lengths, n, totals, [], bar))
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
        out, scores = cache.plan.prompt_scores.attention_and_scores(cache.plan.policy.scoring, q, k, v, padding, scale)
        compress_prompt_layer(cache, q, k, v, layer, scale, scores=scores)
        return out
    out = prompt_attention(q, k, v, padding, scale, offset=n - t, softcap=cache.plan.softcap,
                           sinks=cache.plan.layer_sinks(layer, q.device))
    compress_prompt_layer(cache, q if rows is None else rows, k, v, layer, scale)
    return out


def compress_prompt_layer(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float,
                          scores: Tensor | None = None) -> Tensor:
    """Scoring, selection and merging of one layer's prompt entries, written into pages
    (and the cascade over the layers below). q holds the last R ≥ query_rows prompt queries;
    `scores` (B, H, N): the layer's scores when the prompt's attention computed them already.
    Returns the scores the layer was selected by."""
    b, hq, r, d = q.shape
    h, n = k.shape[1], k.shape[2]
    plan, prompt = cache.plan, cache.prompt
    valid = prompt.valid
    policy = plan.policy
    rows = r if cache.record else policy.scoring.query_rows(n)
    state = plan.state(q[:, :, r - rows:], k, v, None if bool(valid.all()) else valid, scale, layer)
    if cache.record:  # copies: a compiled graph reuses the memory of its intermediate tensors
        cache.record_state(layer, dataclasses.replace(state, queries=state.queries.clone(), keys=k.clone(),
                                                      values=v.clone(), scale=scale))
    scores = plan.score(state) if scores is None else scores
    positions = (torch.arange(n, device=q.device)[None, :] - prompt.pad[:, None])[:, None, :].expand(b, h, n)
    valid_h = valid[:, None, :].expand(b, h, n)
    every = None  # tensor parallelism: the candidates of every head, where the selection reads them
    if plan.heads_exchange == "scores":  # positions and validity are the same for every head of a prompt
        heads = plan.num_heads
        every = (plan.shard.gather_heads(scores), positions[:, :1].expand(b, heads, n),
                 valid[:, None, :].expand(b, heads, n), torch.zeros(b, heads, dtype=torch.long, device=q.device))
    if plan.cascade and policy.budget.layers.ranks_entries:
        # layers: global: this layer's entries join one ranking with the best of the layers below
        reserved, pool = layer_pool(policy, *((scores, positions, valid_h) if every is None else every[:3]),
                                    prompt.lengths)
        prompt.reserved.append(reserved)
        prompt.pools.append(pool)
        totals, prompt.pools = global_totals(policy, prompt.reserved, prompt.pools, prompt.lengths,
                                             plan.num_layers, plan.num_heads)
    elif plan.cascade:
        # LAVa Eq. 7-8 over every head's scores (with a heads rule that reads its own head only, the
        # layers rule reads no entropy: plan.heads_exchange)
        prompt.entropy.append(entropy(scores, valid_h) if every is None else entropy(every[0], every[2]))
        held = torch.stack(prompt.held + [valid.sum(-1) * plan.num_heads], dim=1)
        totals = layer_totals(policy, prompt.lengths, plan.num_layers, plan.num_heads,
                              entropy=torch.stack(prompt.entropy, dim=1), capacity=held)
    else:
        totals = prompt.totals
    total = None if totals is None else totals[:, layer]
    kept, merged = select_and_merge_kernels(cache, k, v, scores, positions, valid_h, total, layer, every)
    cache.hold_store(layer, store_layer(cache, Entries(k, v, scores, positions, torch.ones_like(scores), kept),
                                        merged))
    if plan.prune_every:  # the latest query rows the scorer reads, for pruning while decoding (maybe none)
        cache.hold_queries(layer, q[:, :, r - min(plan.ring_rows, n):].clone())
    if plan.cascade:
        prompt.held.append(over_heads(plan, cache.stores[layer].lengths.sum(-1)))
        if prompt.protected is None:  # the same in every head of a prompt
            protected = policy.ranking.protected(positions[:, :1], prompt.lengths.view(-1, 1, 1)) & valid_h[:, :1]
            prompt.protected = protected.sum((1, 2)) * plan.num_heads
        cascade(cache, layer, totals)
    if prompt.progress is not None:
        prompt.progress.update(1)
        if layer == plan.num_layers - 1:
            prompt.progress.close()
    if layer == plan.num_layers - 1:  # the whole prompt is compressed
        cache.enter(Phase.COMPRESSED)
    return scores


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
        return prompt_attention(q, keys, values, padding, scale, offset=seen - t, softcap=cache.plan.softcap,
                                sinks=cache.plan.layer_sinks(layer, q.device))
    chunks.keys[layer] = chunks.values[layer] = chunks.queries[layer] = None
    return prefill(cache, q, keys, values, mask, layer, scale, rows=queries)

