"""A decode step: the plan's decode step backend (`Plan.decode_step`, chosen once: append the new entries to
their heads' pages, attention with the merge rule's per-entry bias, running scores and online eviction where
the policy has them; kvcompile.kernels.online_step), then `decode: every` pruning."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.allocation import decode_budgets, head_split
from kvcompile.engine.compress import choose, over_heads
from kvcompile.engine.state import Phase
from kvcompile.selection import decode_prune

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache


@dataclass
class DecodeState:
    """What decoding reads; made by `engine.decode.start_decode` at the first generated token."""

    budgets: Tensor  # (B, L, H) entries each head may hold while decoding
    split: Tensor | None  # (B, L, H, 3) ZSMerge proximity, context, residual per head (None: no split)
    pad: Tensor  # (B,) the prompt's left pads: all a decode step reads of the prompt's state (with its width)
    totals: Tensor | None = None  # (B, L) Σ of the budgets over all heads, for `decode: every` pruning on a
    #   tensor-parallel rank (its `budgets` are its own heads'); None: the sum of `budgets`
    length: Tensor | None = None  # () int64 on the device: the cache's length (`seq_length`, pads included),
    #   bumped in place after each call's last layer; a decode step's positions are read from it, not from the
    #   host's count, so a replayed (captured) step writes the right ones

    def advance(self, tokens: int) -> None:
        """The cache grew by `tokens` (after a call's last layer): its length on the device too, in place (a
        copy first where it is an inference tensor and inference_mode is off)."""
        if self.length.is_inference() and not torch.is_inference_mode_enabled():
            self.length = self.length.clone()
        self.length.add_(tokens)

    def cut(self, length: int) -> None:
        """The cache was cut back to `length` tokens (KVCompileCache.crop)."""
        self.length = self.length.new_tensor(length)


def decode(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float,
           start: int | None = None) -> Tensor:
    """Append T new tokens and attend over the pages (new token t sees entries up to itself);
    then the decode schedule: running scores, ZSMerge online eviction, periodic pruning.
    `start`: the sequence index of the first new token (default: what the cache holds)."""
    plan = cache.plan
    given, start = start is not None, cache.seq_length if start is None else start
    store = cache.stores[layer]
    online, every = plan.online_eviction, plan.prune_every
    if cache.phase is Phase.COMPRESSED:
        begin_decoding(cache)
    elif cache.phase is Phase.EMPTY:
        raise RuntimeError("kvcompile: a decode step on an empty cache: its prompt runs first")
    elif cache.phase is Phase.PROMPT and (online or every):  # tokens after a prompt that ends inside this call
        raise RuntimeError("kvcompile: the decode schedule needs every layer compressed before tokens follow "
                           "the prompt in the same call")
    pad, width = cache.prompt.pad if cache.decoding is None else cache.decoding.pad, cache.prompt.width
    # the first new token's logical position among real tokens (B,): from the device's count of the cache's
    # length once decoding (a step replayed from a captured graph reads it), else from the host's
    first = (start if given or cache.decoding is None else cache.decoding.length) - pad
    split = cache.decoding.split[:, layer] if online else None
    outs = []
    for i in range(q.shape[2]):
        position = first + i
        if store.room <= 0:  # a head's pages are full: it takes its next run (Plan.host_syncs), counted
            cache.count_host_sync("append")
            store.make_room(plan.spare_pages)
        outs.append(plan.decode_step(plan, store, layer, q[:, :, i], k[:, :, i], v[:, :, i], position, split,
                                     scale).to(q.dtype))
        if every:
            if plan.ring_rows:  # the ring keeps the latest `ring_rows` queries
                cache.push_query(layer, q[:, :, i, None])
            generated = start - width + i + 1  # the host's count: pruning is a named exception (Plan.host_syncs)
            if generated % every == 0:
                cache.count_host_sync("_prune")
                _prune(cache, layer, position + 1, scale)
                store = cache.stores[layer]
    return torch.stack(outs, dim=2)


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
