"""A decode step: append the new entries to their heads' pages, then attention over the pages with the
merge rule's per-entry bias (ZSMerge Eq. 8: α·log w) when the policy merges; then the decode schedule:
running scores (H2O, ZSMerge), online eviction (engine.online) and `decode: every` pruning."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.allocation import decode_budgets, head_split
from kvcompile.engine.compress import choose, over_heads
from kvcompile.engine.online import evict_online
from kvcompile.engine.state import DecodeState, Phase
from kvcompile.policies.scoring import capped, model_softmax
from kvcompile.selection import decode_prune

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache


def decode(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float,
           start: int | None = None) -> Tensor:
    """Append T new tokens and attend over the pages (new token t sees entries up to itself);
    then the decode schedule: running scores, ZSMerge online eviction, periodic pruning.
    `start`: the sequence index of the first new token (default: what the cache holds)."""
    plan = cache.plan
    given, start = start is not None, cache.seq_length if start is None else start
    store = cache.stores[layer]
    running, online, every = plan.running_scores, plan.online_eviction, plan.prune_every
    if cache.phase is Phase.COMPRESSED:
        cache.enter(Phase.DECODING, decoding=start_decode(cache))
    elif cache.phase is Phase.EMPTY:
        raise RuntimeError("kvcompile: a decode step on an empty cache: its prompt runs first")
    elif cache.phase is Phase.PROMPT and (online or every):  # tokens after a prompt that ends inside this call
        raise RuntimeError("kvcompile: the decode schedule needs every layer compressed before tokens follow "
                           "the prompt in the same call")
    pad, width = cache.prompt.pad if cache.decoding is None else cache.decoding.pad, cache.prompt.width
    # the first new token's logical position among real tokens (B,): from the device's count of the cache's
    # length once decoding (a step replayed from a captured graph reads it), else from the host's
    first = (start if given or cache.decoding is None else cache.decoding.length) - pad
    outs = []
    for i in range(q.shape[2]):
        position = first + i
        out = None
        if plan.online_step is not None:  # append, attention, running scores, online eviction: one fused step
            split = cache.decoding.split[:, layer] if online else None
            out = store.step(plan.online_step, q[:, :, i], k[:, :, i], v[:, :, i], position, split, scale)
        if out is not None:
            out = out.to(q.dtype)
        else:  # no fused step, or not its common case (a head taking a fresh page, several to evict)
            if store.room <= 0:  # the append reads the heads that need a page (Plan.host_syncs), counted
                cache.count_host_sync("append")
            store.append(k[:, :, i], v[:, :, i], position, step=plan.spare_pages)
            if running or online:
                out, probs = _attend_with_probs(cache, store, q[:, :, i], scale, layer)
                if running:
                    _update_scores(cache, store, probs)
                if online:
                    evict_online(cache, store, layer)
            else:
                out = paged_attention(cache, store, q[:, :, i], scale, layer)
        outs.append(out)
        if every:
            if plan.ring_rows:  # the ring keeps the latest `ring_rows` queries
                _ring_push(cache, layer, q[:, :, i, None])
            generated = start - width + i + 1  # the host's count: pruning is a named exception (Plan.host_syncs)
            if generated % every == 0:
                cache.count_host_sync("_prune")
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
        totals = over_heads(plan, budgets.sum(-1))  # (B, L): what pruning keeps per layer, over all heads
    split = None
    if policy.budget.split is not None:
        split = torch.tensor([[[head_split(policy, int(n)) for n in row] for row in per_b]
                              for per_b in budgets.tolist()], dtype=torch.long, device=budgets.device)  # (B, L, H, 3)
    pad = cache.prompt.pad
    return DecodeState(budgets, split, pad, totals, torch.tensor(cache.seq_length, device=pad.device))


def _ring_push(cache: KVCompileCache, layer: int, row: Tensor) -> None:
    """The ring of latest queries (B, Hq, ≤R, d) takes `row` (B, Hq, 1, d), dropping its oldest row once it holds
    `plan.ring_rows`: in place then (its storage kept, what a captured step replays into)."""
    ring, rows = cache.rings[layer], cache.plan.ring_rows
    if ring.shape[2] == rows and not (ring.is_inference() and not torch.is_inference_mode_enabled()):
        ring.copy_(torch.cat([ring[:, :, 1:], row], dim=2))
    else:
        cache.rings[layer] = torch.cat([ring, row], dim=2)[:, :, -rows:]


def _attend_with_probs(cache: KVCompileCache, store, q: Tensor, scale: float, layer: int):
    """Decode attention over the gathered entries, also returning the attention of every entry
    reduced over each GQA group as the scorer reduces it (B, H, E): the running scores need it. The model's
    soft-cap and the layer's learned sinks apply (the same weights as the model's attention)."""
    plan = cache.plan
    flat, stored = store.entries()
    keys, values = store.kv_rows(flat)
    b, hq, d = q.shape
    h = keys.shape[1]
    g = hq // h
    logits = capped(torch.einsum("bhgd,bhed->bhge", q.float().view(b, h, g, d), keys.float()) * scale, plan.softcap)
    bias = plan.merge_bias(store.count_pages.reshape(-1)[flat])
    if bias is not None:
        logits = logits + bias[:, :, None, :]
    logits = logits.masked_fill(~stored[:, :, None, :], float("-inf"))
    sinks = plan.layer_sinks(layer, q.device)
    probs = model_softmax(logits, None if sinks is None else sinks.view(1, h, g, 1))
    out = torch.einsum("bhge,bhed->bhgd", probs, values.float()).reshape(b, hq, d).to(q.dtype)
    return out, plan.policy.scoring.reduce_group(probs, 2)


def _update_scores(cache: KVCompileCache, store, probs: Tensor) -> None:
    """Each token entry's running score ← scoring.running_update(score, attention), written with no host
    read (`LayerStore.rescore`)."""
    flat, stored = store.entries()
    pos = store.pos_pages.reshape(-1)[flat]
    new = cache.policy.scoring.running_update(store.score_pages.reshape(-1)[flat], probs)
    store.rescore(flat, stored & (pos >= 0), new)


def _prune(cache: KVCompileCache, layer: int, lengths: Tensor, scale: float) -> None:
    """`decode: every n`: re-score the layer with the ring of latest queries and prune it back
    to its budget (selection.decode_prune), then write it into fresh pages, copied into the layer's own
    tensors where they fit (LayerStore.refill: a graph recorded from the steps before replays after it)."""
    heads = cache.stores[layer].to_heads()
    totals, ranks = cache.decoding.totals, None
    if cache.plan.shard is not None:
        ranks = functools.partial(choose, cache, kernels=False)
    decode_prune(cache.policy, heads, cache.rings[layer], lengths, cache.decoding.budgets[:, layer], layer, scale,
                 total=None if totals is None else totals[:, layer], choose=ranks, softcap=cache.plan.softcap,
                 sinks=cache.plan.layer_sinks(layer, cache.rings[layer].device))
    store = cache.plan.store.from_heads(heads, cache.page_size, cache.plan.spare_pages,
                                        storage=cache.policy.storage, dtype=cache.plan.dtype)
    if not cache.stores[layer].refill(store):  # into the layer's own tensors where it fits (a captured step's)
        cache.stores[layer] = store


def paged_attention(cache: KVCompileCache, store, q: Tensor, scale: float, layer: int | None = None) -> Tensor:
    """Attention of one query per head over that head's pages, with the merge rule's bias, by the
    plan's decode attention backend (a model with learned sinks: the layer's, `Plan.decode_backend`)."""
    backend = cache.plan.decode_attention if layer is None else cache.plan.decode_backend(layer, q.device)
    return store.attend(backend, q, cache.plan.merge_bias, scale)

