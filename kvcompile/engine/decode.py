"""Entering decoding and the decode schedule's pruning: the decode state a generation reads (`start_decode`: the
per-head budgets, ZSMerge's split, the pads; `cache.DecodeState`), made at the first generated token, and `decode:
every` (the ring of latest queries, re-scoring and pruning back to the budget). A decode step itself is the op's
(kvcompile.engine.op `decode`: the plan's decode step backend, `Plan.decode_step`, chosen once)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.allocation import decode_budgets, head_split
from kvcompile.cache import DecodeState
from kvcompile.engine.compress import choose, over_heads
from kvcompile.engine.state import Phase
from kvcompile.selection import decode_prune

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache


def after_token(cache: KVCompileCache, layer: int, q: Tensor, i: int, generated: int, lengths: Tensor,
                scale: float) -> None:
    """`decode: every n` after new token i of a decode call (q (B, Hq, T, d) the call's queries; `generated`: the
    host's count of generated tokens, a named exception, Plan.host_syncs): the ring keeps the latest `ring_rows`
    queries, and every n tokens the layer is re-scored and pruned (`_prune`, its entries up to `lengths`)."""
    if cache.plan.ring_rows:
        cache.push_query(layer, q[:, :, i, None])
    if generated % cache.plan.prune_every == 0:
        cache.count_host_sync("_prune")
        _prune(cache, layer, lengths, scale)


def begin_decoding(cache: KVCompileCache) -> None:
    """The first token after a compressed prompt: the cache enters decoding with its decode state (`start_decode`),
    at the first layer of the step (the op's `decode`, or a batched step's plan for each of its requests, before
    its forward: kvcompile.engine.batch). A cache already decoding is left as it is."""
    if cache.phase is Phase.COMPRESSED:
        cache.enter(Phase.DECODING, decoding=start_decode(cache))


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
    store = cache.plan.store.from_heads(heads, cache.page_size, storage=cache.policy.storage, dtype=cache.plan.dtype,
                                        reserve=cache.plan.spare_entries)
    if not cache.stores[layer].refill(store):  # into the layer's own tensors where it fits (a captured step's)
        cache.hold_store(layer, store)
