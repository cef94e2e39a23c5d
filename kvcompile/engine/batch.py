"""A serving step's decode tokens as one batch: plan once per step, then per layer one append and one paged
attention call for every request of the step (FlashInfer's plan()/run(); docs/INTERNALS.md "Continuous
batching": the batched decode step).

A serving engine (kvcompile.integrations.batching) packs many requests into one forward, each request with its own
`KVCompileCache` (one sequence). Its pages live in the engine's page pools (kvcompile.store.pool: one per
layer), so every request's heads are rows of one block table over the same page tensors, what the paged
kernels (kvcompile.kernels.paged_attention) take for a batch.

- `decode_path(plan, pools)`, chosen once per engine from the plan: `BatchedDecode` for a policy whose decode
  step is an append and attention (full-precision pages; no running scores, online eviction, `decode: every`
  pruning or merge bias; not a hybrid model's windows), else `PerRequestDecode`, the op once per request.
- `path.plan(requests)` once per forward, requests (cache, tokens) in the order of the packed tokens: a
  `StepPlan`, which requests run alone (a prompt or a part of it, a first decode step, any step of a policy
  decoded per request) and the `DecodeBatch` of the others: their caches, their tokens' places in the packed
  forward, their positions.
- `DecodeBatch.run(layer, q, k, v, scale)` per layer: the stores make room where a head's pages are full (the
  append's host read, counted as the op counts it), one block table padded over the batch, one write of every
  new entry into the pool (`PagePools.append`), one attention call (`PagePools.attend`, the plan's decode
  backend); after the last layer each cache counts its token (`seq_length`, the decode state's length).
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from kvcompile.store.pages import LayerStore
from kvcompile.store.pool import PagePools, PooledStore

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache
    from kvcompile.plan import Plan


@dataclass
class DecodeBatch:
    """The requests of a step that decode one token each, together."""

    pools: PagePools
    caches: list  # KVCompileCache of each request, in the order of `index`
    index: Tensor  # (R,) long: each request's token in the packed forward
    positions: Tensor  # (R,) long: each new token's logical position
    counts: Counter  # the path's counters (`BatchedDecode.counts`)
    tables: list  # per layer: (stores and versions, block table, lengths) of the last batch (`BatchedDecode.tables`)
    whole: bool  # the batch is the whole forward, in order

    def run(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """Layer `layer` of the step for every request: q (1, Hq, T, d), k, v (1, H, T, d) the packed forward's;
        returns the outputs (R, Hq, d) of the requests' tokens."""
        caches = self.caches
        stores = [cache.stores[layer] for cache in caches]
        for cache, store in zip(caches, stores):
            if store.make_room(cache.plan.spare_pages):  # a head's pages are full: it takes its next run
                cache.count_host_sync("append")
        rows = self._last_rows(layer, stores)
        if rows is not None:  # the last step's stores, unchanged since its append (some may have left)
            last = self.tables[layer]
            table, lengths = last[1], last[2]
            if rows != list(range(len(last[0]))):
                index = torch.tensor(rows, device=table.device)
                table, lengths = table[index], lengths[index]
                self.counts["tables_cut"] += 1
        else:
            self.counts["tables_built"] += 1
            table = pad_sequence([store.block_table[0].T for store in stores], batch_first=True)
            table = table.transpose(1, 2).contiguous()
            lengths = torch.cat([store.lengths for store in stores])
        if self.whole:
            q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        else:
            q = query[0, :, self.index].transpose(0, 1)
            k = key[0, :, self.index].transpose(0, 1)
            v = value[0, :, self.index].transpose(0, 1)
        lengths = self.pools.append(layer, stores, table, lengths, k, v, self.positions)
        self.tables[layer] = ({id(store): (i, store, store.version) for i, store in enumerate(stores)}, table, lengths)
        backend = caches[0].plan.decode_backend(layer, q.device)
        out = self.pools.attend(layer, backend, q.contiguous(), table, lengths, scale)
        self.counts["attention_calls"] += 1
        if layer == caches[0].plan.num_layers - 1:  # the step's last layer: every cache counts its token
            for cache in caches:
                cache.advance(1)
            self.counts["steps"] += 1
            self.counts["tokens"] += len(caches)
        return out.to(query.dtype)

    def _last_rows(self, layer: int, stores: list) -> list[int] | None:
        """Each store's row in the last step's block table and lengths of `layer`, where every store was in that
        step and has not changed since (its `version`); else None."""
        last = self.tables[layer]
        if last is None:
            return None
        rows = []
        for store in stores:
            hit = last[0].get(id(store))
            if hit is None or hit[1] is not store or hit[2] != store.version:
                return None
            rows.append(hit[0])
        return rows


@dataclass
class StepPlan:
    """One forward's plan: the requests that run alone (their index among the step's requests) and the batch."""

    alone: list[int]
    batch: DecodeBatch | None  # None: no request of this step decodes in the batch


@dataclass
class PooledPages:
    """Where a serving engine's requests keep their pages: the engine's pools (`pools`), or, where None (pages
    of codes or of two tiers), pages of each cache's own."""

    pools: PagePools | None
    counts: Counter = field(default_factory=Counter)

    def adopt(self, cache: KVCompileCache) -> None:
        """Move a request's compressed layers into the pools (once, after the forward that compressed them)."""
        if self.pools is not None:
            cache.hold_stores([self.pools.adopt(layer, store) for layer, store in enumerate(cache.stores)])

    def release(self, cache: KVCompileCache) -> None:
        """A request ended: its pages go back to the pools."""
        for store in cache.stores:
            if isinstance(store, PooledStore):
                store.release()

    def detach(self, cache: KVCompileCache) -> None:
        """A request's cache leaves the engine (kept for a continuation): pages of its own, the pool's back."""
        stores = []
        for store in cache.stores:
            if isinstance(store, PooledStore):
                own = store.detached()
                store.release()
                store = own
            stores.append(store)
        cache.hold_stores(stores)

    def copy_in(self, cache: KVCompileCache) -> KVCompileCache:
        """A copy of `cache` (kept outside the engine, left as it is) with its pages copied into the pools: a request
        that continues a kept sequence (kvcompile serve --reuse-context)."""
        memo = {}
        if self.pools is not None:
            memo = {id(store): self.pools.adopt(layer, store) for layer, store in enumerate(cache.stores)}
        return copy.deepcopy(cache, memo)

    def report(self) -> dict:
        return {**self.counts, "pool": None if self.pools is None else self.pools.report()}


@dataclass
class PerRequestDecode(PooledPages):
    """Every request's decode step through its own op call (a policy whose decode step is more than an append
    and an attention: running scores, online eviction, pruning, merge slots, pages of codes, a hybrid model)."""

    reason: str = ""
    batched = False

    def plan(self, requests: list[tuple[KVCompileCache, int]]) -> StepPlan:
        return StepPlan(list(range(len(requests))), None)


@dataclass
class BatchedDecode(PooledPages):
    """A step's decode tokens in one batch (`DecodeBatch`) over the pools."""

    batched = True
    tables: list = None  # per layer, the last batch's block table and lengths (reused while its stores are unchanged)

    def plan(self, requests: list[tuple[KVCompileCache, int]]) -> StepPlan:
        """The step's plan: which requests decode in the batch (one token after a first decode step, pages in the
        pools), in the order of the packed tokens."""
        alone, batched, index, offset = [], [], [], 0
        for i, (cache, tokens) in enumerate(requests):
            if tokens == 1 and cache.decoding is not None and all(isinstance(s, PooledStore) for s in cache.stores):
                batched.append(cache)
                index.append(offset)
            else:
                alone.append(i)
            offset += tokens
        if not batched:
            return StepPlan(alone, None)
        positions = torch.tensor([c.seq_length for c in batched]) - torch.cat([c.decoding.pad.cpu() for c in batched])
        device = batched[0].stores[0].device
        if self.tables is None:
            self.tables = [None] * len(batched[0].stores)
        return StepPlan(alone, DecodeBatch(self.pools, batched, torch.tensor(index, device=device),
                                           positions.to(device), self.counts, self.tables, not alone))


def decode_path(plan: Plan) -> BatchedDecode | PerRequestDecode:
    """How a serving engine runs `plan`'s decode steps, chosen once: batched where a step is an append and an
    attention over full-precision pages, else per request (with the reason)."""
    why = None
    if plan.store is not LayerStore:
        why = f"pages of {plan.store.__name__}"
    elif plan.running_scores or plan.online_eviction:
        why = "scores run while decoding" if not plan.online_eviction else "online eviction"
    elif plan.prune_every:
        why = f"pruning every {plan.prune_every} tokens"
    elif plan.policy.merges:
        why = "merge slots (a bias per entry)"
    elif plan.layer_kinds is not None:
        why = "a hybrid model's window layers"
    elif plan.shard is not None or plan.layer_devices is not None:
        why = "layers split over ranks or devices"
    pools = PagePools(plan.num_layers) if plan.store is LayerStore else None
    return PerRequestDecode(pools, reason=why) if why is not None else BatchedDecode(pools)
