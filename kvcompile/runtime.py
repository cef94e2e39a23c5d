"""The one op: `torch.ops.kvcompile.attend(q, k, v, mask, layer, handle, scale)`.

Prefill (the layer's cache is empty): the model's attention over the prompt (SDPA),
then scoring, selection and merging for that layer, and only the kept rows are written
into pages — the layer's full K and V are dropped as soon as the op returns, so the
model never holds the whole prompt's KV for all layers. Layer-dynamic budgets (LAVa)
re-compress the lower layers as a cascade.

Decode: append the new entries to their heads' pages, then attention over the pages
with the per-entry bias α·log w (ZSMerge Eq. 8) when the policy merges.

The op is an opaque `torch.library.custom_op` with a fake implementation, so compiled
graphs treat it as one call and do not recompile as the cache grows.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile import reference
from kvcompile.cache import Entries, KVCompileCache, append, build_store, lookup_cache


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                     offset: int = 0) -> Tensor:
    """The model's causal attention (SDPA) with left padding: query i (at index offset + i)
    sees real keys j <= offset + i. A pad query attends to itself only, so no NaN appears."""
    b, hq, t, d = q.shape
    n = k.shape[2]
    gqa = hq != k.shape[1]
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

def _start_prompt(cache: KVCompileCache, mask: Tensor | None, b: int, n: int, device) -> None:
    valid = torch.ones(b, n, dtype=torch.bool, device=device) if mask is None else mask[:, -n:].bool()
    cache.valid = valid
    cache.prompt_lengths = valid.sum(-1)
    cache.pad = n - cache.prompt_lengths
    cache.prompt_width = n
    cache.entropy = []
    policy = cache.policy
    cache.totals = None
    if policy.budget.threshold is None and not cache.dynamic:
        cache.totals = reference.layer_totals(policy, cache.prompt_lengths, cache.num_layers, cache.num_heads)
    if cache.progress:
        from tqdm.auto import tqdm

        cache.bar = tqdm(total=cache.num_layers, desc="prompt: attention + compression", unit="layer")


def _reserve(cache: KVCompileCache, b: int, h: int) -> int:
    return b * h * math.ceil(cache.headroom / cache.page_size) if cache.headroom else b * h


def prefill(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
            layer: int, scale: float) -> Tensor:
    b, hq, n, d = q.shape
    h = k.shape[1]
    if layer == 0:
        _start_prompt(cache, mask, b, n, q.device)
    valid = cache.valid
    out = prompt_attention(q, k, v, None if bool(valid.all()) else valid, scale)

    policy = cache.policy
    rows = n if cache.record else policy.scoring.query_rows(n)
    state = reference.LayerState(q[:, :, n - rows:], k, v, None if bool(valid.all()) else valid, scale)
    if cache.record:
        cache.states[layer] = state
    scores = reference.score_layer(policy, state)
    positions = (torch.arange(n, device=q.device)[None, :] - cache.pad[:, None])[:, None, :].expand(b, h, n)
    valid_h = valid[:, None, :].expand(b, h, n)
    if cache.dynamic:
        cache.entropy.append(reference.layer_entropy(scores, valid_h))
        held = torch.stack([store.lengths.sum(-1) for store in cache.stores[:layer]]
                           + [valid.sum(-1) * h], dim=1)
        totals = reference.layer_totals(policy, cache.prompt_lengths, cache.num_layers, cache.num_heads,
                                        entropy=torch.stack(cache.entropy, dim=1), capacity=held)
    else:
        totals = cache.totals
    total = None if totals is None else totals[:, layer]
    kept, merged = reference.select_and_merge(policy, k, v, scores, positions, valid_h, cache.prompt_lengths,
                                              total, layer, None)
    cache.stores[layer] = _store(cache, Entries(k, v, scores, positions, torch.ones_like(scores), kept), merged)
    if cache.dynamic:
        for lower in range(layer):
            _recompress(cache, lower, totals[:, lower])
    if cache.progress:
        cache.bar.update(1)
        if layer == cache.num_layers - 1:
            cache.bar.close()
    return out


def _store(cache: KVCompileCache, tokens: Entries, merged: reference.Merged | None):
    """Pages for one layer: the occupied residual slots of each head first, then its kept tokens."""
    b, h = tokens.take.shape[:2]
    sources = [tokens]
    slots = torch.zeros(b, h, dtype=torch.long, device=tokens.take.device)
    if merged is not None:
        counts = merged.counts
        occupied = counts > 0
        slots = occupied.sum(-1)
        sources.insert(0, Entries(merged.keys, merged.values, torch.zeros_like(counts, dtype=torch.float32),
                                  torch.full_like(counts, -1), counts.float(), occupied))
    return build_store(sources, slots, cache.page_size, _reserve(cache, b, h))


def _recompress(cache: KVCompileCache, layer: int, total: Tensor) -> None:
    """Cascade step (LAVa Alg. 2): re-select a compressed layer with its new, smaller total."""
    policy = cache.policy
    store = cache.stores[layer]
    k, v, scores, pos, counts, stored = store.gather()
    e = torch.arange(k.shape[2], device=k.device)
    is_slot = stored & (e < store.slots[..., None])
    is_token = stored & ~is_slot
    slots = None
    if policy.merges:
        width = int(store.slots.max())
        slots = reference.Merged(k[:, :, :width], v[:, :, :width],
                                 torch.where(is_slot[:, :, :width], counts[:, :, :width], 0).long())
    kept, merged = reference.select_and_merge(policy, k, v, scores.masked_fill(~is_token, float("-inf")),
                                              pos, is_token, cache.prompt_lengths, total, layer, slots)
    cache.stores[layer] = _store(cache, Entries(k, v, scores, pos, counts, kept), merged)


# --- decode ----------------------------------------------------------------------------

def decode(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float) -> Tensor:
    """Append T new tokens and attend over the pages (new token t sees entries up to itself)."""
    store = cache.stores[layer]
    t = q.shape[2]
    outs = []
    for i in range(t):
        position = cache.seq_length + i - cache.pad  # logical position among real tokens
        append(store, k[:, :, i], v[:, :, i], position)
        outs.append(paged_attention(cache, store, q[:, :, i], scale))
    return torch.stack(outs, dim=2)


def paged_attention(cache: KVCompileCache, store, q: Tensor, scale: float) -> Tensor:
    """Attention of one query per head over that head's pages, with the merge bias."""
    bias = None
    if cache.policy.merges:
        alpha = cache.policy.merge.alpha
        counts = store.count_pages
        bias = torch.where(counts > 0, alpha * counts.clamp(min=1).log(), float("-inf"))
    try:
        from kvcompile.kernels.paged_attention import paged_attention as kernel
    except ImportError:  # kernels not built yet: gather, then the reference
        kernel = None
    if kernel is not None:
        return kernel(q, store.k_pages, store.v_pages, store.block_table.int(), store.lengths.int(),
                      bias, scale)
    flat, stored = store.entries()
    d = store.k_pages.shape[-1]
    keys = store.k_pages.reshape(-1, d)[flat]
    values = store.v_pages.reshape(-1, d)[flat]
    b_all = None if bias is None else bias.reshape(-1)[flat]
    return reference.attend(q[:, :, None], keys, values, b_all, store.lengths, scale)[:, :, 0]


# --- the op ----------------------------------------------------------------------------

@torch.library.custom_op("kvcompile::attend", mutates_args=())
def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int, handle: int,
           scale: float) -> Tensor:
    """Prefill attention + scoring + compression, or decode append + paged attention.

    q (B, Hq, T, d), k/v (B, H, T, d): the layer's new queries, keys, values after RoPE;
    mask (B, ≥T) bool padding mask (True = real token) or None. Returns (B, Hq, T, d).
    """
    cache = lookup_cache(handle)
    if cache.stores[layer] is None:
        out = prefill(cache, q, k, v, mask, layer, scale)
    else:
        out = decode(cache, q, k, v, layer, scale)
    if layer == cache.num_layers - 1:
        cache.seq_length += q.shape[2]
    return out.contiguous()


@attend.register_fake
def _(q, k, v, mask, layer, handle, scale):
    return q.new_empty(q.shape)


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
        out = torch.ops.kvcompile.attend(query, key, value, mask, module.layer_idx, cache.handle, scale)
    return out.transpose(1, 2).contiguous(), None


def kvcompile_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, **kwargs):
    """transformers AttentionMaskInterface entry: the op takes the 2-D padding mask as is
    (True = real token); None when nothing is padded."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.bool()
