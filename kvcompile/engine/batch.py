"""A serving step's decode tokens as one batch: plan once per step, then per layer one call for every request of the
step (FlashInfer's plan()/run(); docs/INTERNALS.md "Continuous batching": the batched decode step).

A serving engine (kvcompile.integrations.batching) packs many requests into one forward, each request with its own
`KVCompileCache` (one sequence). Its pages live in the engine's page pools (kvcompile.store.pool: per layer one
per page layout), so every request's heads are rows of one block table over the same page tensors, what the paged
kernels (kvcompile.kernels.paged_attention) and the plan's decode steps (kvcompile.kernels.online_step) take for
a batch.

- `decode_path(plan)`, chosen once per engine from the plan (no `decode: every` pruning, not a hybrid model's
  windows, one rank and device): `BatchedDecode` with `TorchStep` for a policy whose decode step is an append and
  an attention over the pools (full-precision pages, codes: int8 / int4; two tiers, mixed and KIVI, and codes or a
  tier beside merge slots, whose bias the tiers' attention adds); `BatchedStepDecode` with the plan's own decode
  step (`Plan.decode_step`: a fused C++ step, or the torch step) for one whose step does more over full-precision
  pages (running scores: h2o; online eviction into merge slots: zsmerge; a merge bias per entry) or over codes
  (running scores: h2o); else `PerRequestDecode`, the op once per request, with the reason; every store kind's
  pages in the pools either way.
- `path.plan(requests)` once per forward, requests (cache, tokens) in the order of the packed tokens: a
  `StepPlan`, which requests run alone (a prompt or a part of it, any step of a policy decoded per request) and
  the batch of the others (one token each, pages in the pools): their caches, their tokens' places in the packed
  forward, their positions. A request's first decode step is in the batch: its cache enters decoding here
  (`engine.decode.begin_decoding`: its decode state, as the op's first decode step sets it up). The batch is made
  once for every layer (`DecodeBatch.make`): each request's stores make room where a head's pages are full (the
  append's host read, counted as the op counts it; a request whose stores cannot fails alone, `StepPlan.failed`,
  and the batch runs without it), then per layer one block table padded over the batch (the last step's while no
  store changed) and the requests as one store of their class over the pool (`PagePools.batch`:
  `store.pool.BatchStore`, `BatchCodeStore`; two tiers a `BatchTieredStore`, each tier's over its pool).
- `batch.run(layer, q, k, v, scale)` per layer: one call of the path's decode step (`DecodeBatch.step`) on that
  layer's batch store (a head's step reads and writes its own pages only), each request then taking its rows back
  (`finish`). `TorchStep` there is the store's own append (one write of every new entry: one C++ call where the
  plan's fused step is `CppAppendStep`, `store.pages.CppAppend`, else torch ops; codes quantized as the store
  writes them; two tiers: into the appending tier's pool, then the low tier's flush, one op for all: KIVI) and
  one call of the plan's decode attention backend (the quantized kernel over codes; two tiers: one kernel call per
  tier's pool, merged). After the last layer each cache counts its token (`seq_length`, the decode state's
  length).
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.engine.decode import begin_decoding
from kvcompile.engine.online import TorchStep
from kvcompile.engine.state import Phase
from kvcompile.store.pages import CppAppend
from kvcompile.store.pool import BATCH, PagePools, tiers
from kvcompile.store.tiers import TieredStore

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache
    from kvcompile.plan import Plan


@dataclass
class DecodeBatch:
    """The requests of a step that decode one token each, together: per layer one call of `step` on them.

    A request's own work (its stores making room, its cache counting the token) is attributed to it: making room
    runs for every layer before the forward (`make`), and a request whose stores cannot leaves the batch there;
    counting the token is recorded in `faults` while the others count theirs; the kernel call, which covers every
    request of the batch, is not anyone's alone."""

    caches: list  # KVCompileCache of each request, in the order of `index`
    index: Tensor  # (R,) long: each request's token in the packed forward
    positions: Tensor  # (R,) long: each new token's logical position
    counts: Counter  # the path's counters (`BatchedDecode.counts`)
    tables: list  # per layer: (stores, their versions, the batch's `held` tensors) of the last batch
    #               (`BatchedDecode.tables`)
    whole: bool  # the batch is the whole forward, in order
    step: object = None  # the decode step run on the batch (`BatchedDecode.step`, kvcompile.kernels.online_step)
    split: Tensor | None = None  # (R, L, H, 3) every request's ZSMerge split, where tokens leave online
    faults: list = field(default_factory=list)  # (cache, error) of the requests whose count of the token raised
    stores: list = field(default_factory=list)  # per layer: the requests' stores, in row order
    batches: list = field(default_factory=list)  # per layer: the requests' stores as one (`PagePools.batch`)

    @classmethod
    def make(cls, caches: list, index: list[int], counts: Counter, tables: list, alone: bool,
             step) -> "tuple[DecodeBatch | None, list[tuple]]":
        """The batch of `caches` (their tokens at `index` in the packed forward; `alone`: other requests run in the
        forward too), made once per step for every layer: each request's stores make room where a head's pages
        are full (the append's host read, counted as the op counts it; a request whose stores cannot leaves the
        batch: its (cache, error) returned), then per layer the requests' stores as one store over their pool
        with its block table and counters (the last step's while no store changed: `_held`)."""
        kept, dropped = [], []
        for cache, at in zip(caches, index):
            try:
                for store in cache.stores:
                    # a head's pages are full: it takes its next run, of its own plan's size (a continued
                    # request's plan reserves another headroom than the fresh requests' beside it)
                    if store.make_room(cache.plan.spare_pages):
                        cache.count_host_sync("append")
            except Exception as error:  # noqa: BLE001 - this request's own: the others decode without it
                dropped.append((cache, error))
                continue
            kept.append((cache, at))
        if not kept:
            return None, dropped
        caches = [cache for cache, _ in kept]
        positions = torch.tensor([c.seq_length for c in caches]) - torch.cat([c.decoding.pad.cpu() for c in caches])
        device = caches[0].stores[0].device
        batch = cls(caches, torch.tensor([at for _, at in kept], device=device), positions.to(device), counts,
                    tables, not alone and not dropped, step)
        for layer in range(len(caches[0].stores)):
            stores = [cache.stores[layer] for cache in caches]
            batch.stores.append(stores)
            batch.batches.append(PagePools.batch(stores, batch._held(layer, stores)))
        return batch, dropped

    def __post_init__(self):
        if self.caches[0].plan.online_eviction:
            self.split = torch.cat([cache.decoding.split for cache in self.caches])

    def run(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """Layer `layer` of the step for every request: q (1, Hq, T, d), k, v (1, H, T, d) the packed forward's;
        returns the outputs (R, Hq, d) of the requests' tokens."""
        plan = self.caches[0].plan
        if self.whole:
            q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        else:
            q = query[0, :, self.index].transpose(0, 1)
            k = key[0, :, self.index].transpose(0, 1)
            v = value[0, :, self.index].transpose(0, 1)
        batch = self.batches[layer]  # the requests as one store over their pool
        split = None if self.split is None else self.split[:, layer]
        out = self.step(plan, batch, layer, q.contiguous(), k, v, self.positions, split, scale)
        batch.finish(evicted=split is not None)  # each request takes its rows back
        stores = self.stores[layer]
        self.tables[layer] = (stores, [store.version for store in stores], batch.held)
        if layer == plan.num_layers - 1:  # the step's last layer: every cache counts its token
            for cache in self.caches:
                try:
                    cache.advance(1)
                except Exception as error:  # noqa: BLE001 - this request's own: the others count theirs
                    self.faults.append((cache, error))
            self.counts.update(steps=1, tokens=len(self.caches), attention_calls=plan.num_layers)
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def _held(self, layer: int, stores: list) -> tuple[Tensor, ...] | None:
        """The last step's block table and counters of `layer`, cut to the rows of `stores`, where every store was
        in that step and has not changed since (its `version`); else None (built again)."""
        if self.tables[layer] is None:
            self.counts["tables_built"] += 1
            return None
        last, versions, held = self.tables[layer]
        if len(last) == len(stores) and all(a is b for a, b in zip(last, stores)) \
                and versions == [store.version for store in stores]:
            return held
        row = {id(store): i for i, store in enumerate(last)}
        rows = [row.get(id(store)) for store in stores]
        if any(i is None or last[i] is not store or versions[i] != store.version for i, store in zip(rows, stores)):
            self.counts["tables_built"] += 1
            return None
        self.counts["tables_cut"] += 1
        index = torch.tensor(rows, device=held[0].device)
        return tuple(t[index] for t in held)


@dataclass
class StepPlan:
    """One forward's plan: the requests that run alone (their index among the step's requests), the batch, and the
    requests that failed alone while it was made (their index: their error; `DecodeBatch.make`)."""

    alone: list[int]
    batch: DecodeBatch | None  # None: no request of this step decodes in the batch
    failed: dict = field(default_factory=dict)


@dataclass
class PooledPages:
    """Where a serving engine's requests keep their pages: the engine's pools (`pools`: every store kind, a
    TieredStore tier by tier), or, where None, pages of each cache's own."""

    pools: PagePools | None
    counts: Counter = field(default_factory=Counter)

    def adopt(self, cache: KVCompileCache) -> None:
        """Move a request's compressed layers into the pools (once, after the forward that compressed them)."""
        if self.pools is not None:
            pooled = []
            try:
                for layer, store in enumerate(cache.stores):
                    pooled.append(self.pools.adopt(layer, store))
                cache.hold_stores(pooled)
            except BaseException:  # the pools' pages back: the cache keeps its own, and the request fails
                for store, own in zip(pooled, cache.stores):
                    _release_new(store, own)
                raise

    def adopt_all(self, caches: list) -> None:
        """`adopt` each of `caches`, every layer's pools grown once for all of them first (`PagePools.reserve`)."""
        if self.pools is not None:
            for layer in range(len(self.pools.by_layout)):
                self.pools.reserve(layer, [cache.stores[layer] for cache in caches])
        for cache in caches:
            self.adopt(cache)

    def release(self, cache: KVCompileCache) -> None:
        """A request ended: its pages go back to the pools."""
        for store in cache.stores:
            PagePools.release(store)

    def detach(self, cache: KVCompileCache) -> None:
        """A request's cache leaves the engine (kept for a continuation): pages of its own, the pool's back."""
        stores = [PagePools.detached(store) for store in cache.stores]
        cache.hold_stores(stores)

    def copy_in(self, cache: KVCompileCache) -> KVCompileCache:
        """A copy of `cache` (kept outside the engine, left as it is) with its pages copied into the pools: a request
        that continues a kept sequence (kvcompile serve --reuse-context)."""
        adopted = []
        try:
            for layer, store in enumerate(cache.stores if self.pools is not None else ()):
                adopted.append((store, self.pools.adopt(layer, store)))
            return copy.deepcopy(cache, {id(store): copied for store, copied in adopted})
        except BaseException:  # the copy's pages back to the pools: the request fails without them
            for store, copied in adopted:
                _release_new(copied, store)
            raise

    def report(self) -> dict:
        return {**self.counts, "pool": None if self.pools is None else self.pools.report()}


def _release_new(adopted, original) -> None:
    """The pool pages `PagePools.adopt` took for `adopted` (the tiers not already `original`'s) given back."""
    mine = {id(tier) for tier in tiers(original)}
    for tier in tiers(adopted):
        if id(tier) not in mine:
            PagePools.release(tier)


@dataclass
class PerRequestDecode(PooledPages):
    """Every request's decode step through its own op call (`decode: every` pruning, a hybrid model's windows,
    layers over several ranks or devices), its pages in the pools all the same."""

    reason: str = ""
    batched = False

    def plan(self, requests: list[tuple[KVCompileCache, int]]) -> StepPlan:
        return StepPlan(list(range(len(requests))), None)


@dataclass
class BatchedDecode(PooledPages):
    """A step's decode tokens in one batch (`DecodeBatch`) over the pools."""

    batched = True
    tables: list = None  # per layer, the last batch's block table and lengths (reused while its stores are unchanged)
    step: object = None  # the decode step the batch runs (`decode_path`)

    def plan(self, requests: list[tuple[KVCompileCache | None, int]]) -> StepPlan:
        """The step's plan: which requests decode in the batch (one token after the compressed prompt, pages in the
        pools; a first decode step enters decoding here), in the order of the packed tokens (a cache None: a request
        that failed before the forward, alone)."""
        alone, batched, index, offset = [], [], [], 0
        for i, (cache, tokens) in enumerate(requests):
            if cache is not None and tokens == 1 and cache.phase in (Phase.COMPRESSED, Phase.DECODING) \
                    and all(PagePools.pooled(s) for s in cache.stores):
                begin_decoding(cache)  # a first decode step: the request enters decoding here, its attention batched
                batched.append(cache)
                index.append(offset)
            else:
                alone.append(i)
            offset += tokens
        if not batched:
            return StepPlan(alone, None)
        if self.tables is None:
            self.tables = [None] * len(batched[0].stores)
        batch, dropped = DecodeBatch.make(batched, index, self.counts, self.tables, bool(alone), self.step)
        where = {id(cache): i for i, (cache, _) in enumerate(requests) if cache is not None}
        return StepPlan(alone, batch, {where[id(cache)]: error for cache, error in dropped})


@dataclass
class BatchedStepDecode(BatchedDecode):
    """A step's decode tokens in one batch through the plan's own decode step (`Plan.decode_step`): running
    scores, online eviction, a merge bias per entry."""


def decode_path(plan: Plan) -> BatchedDecode | PerRequestDecode:
    """How a serving engine runs `plan`'s decode steps, chosen once: batched over the pools' pages, one call a
    layer for every request (a store class of `store.pool.BATCH`): where a step is an append and an attention
    (full precision, codes: int8 / int4; two tiers: mixed precision and KIVI, and codes or a tier beside merge
    slots, whose bias the tiers' attention adds), `TorchStep` on the batch, the store's append and the plan's
    decode attention backend, one kernel call (a tier's pool each); where it does more over full-precision pages or
    codes (running scores, online eviction, a merge bias per entry), the plan's own decode step on the batch; else
    per request (with the reason). Every store kind's pages live in the engine's pools either way."""
    why = _per_request(plan)
    pools = PagePools(plan.num_layers)
    if why is not None:
        return PerRequestDecode(pools, reason=why)
    if _steps_more(plan):
        return BatchedStepDecode(pools, step=plan.decode_step)  # the plan's decode step does more, on the batch
    append = CppAppend.of(plan.decode_step)  # the plan's fused step's append alone (C++), where it has one
    if append is not None:
        append.build(plan.head_dim)  # (built now: a cold build would land inside the first batched step)
    return BatchedDecode(pools, step=TorchStep(append=append))


def _per_request(plan: Plan) -> str | None:
    """Why `plan`'s decode steps run per request (decode_path), or None: they batch."""
    if plan.store not in BATCH:
        return f"pages of {plan.store.__name__}"
    if plan.prune_every:
        return f"pruning every {plan.prune_every} tokens"
    if plan.layer_kinds is not None:
        return "a hybrid model's window layers"
    if plan.shard is not None or plan.layer_devices is not None:
        return "layers split over ranks or devices"
    return None


def _steps_more(plan: Plan) -> bool:
    """The plan's decode step does more than an append and an attention (BatchedStepDecode)."""
    return plan.online_eviction or plan.running_scores or (plan.policy.merges and plan.store is not TieredStore)


def batch_key(plan: Plan) -> tuple | None:
    """What a batched step reads of a plan, or None where `plan` decodes per request (decode_path). A batch runs
    every request's step with its first request's plan (`DecodeBatch.run`), so requests of different plans
    (policies, budgets) decode in one batch exactly as each alone where their keys are equal: the same store
    kind and storage (one pool per page layout), the same decode attention and step backends, the model's
    soft-cap and sinks, and, where the step does more, the parts it runs (the scorer's running update, the merge
    rule; each request's own ZSMerge split travels with it). A head's budgets, kept entries and spare pages are
    its own request's."""
    if _per_request(plan) is not None:
        return None
    policy = plan.policy
    more = _steps_more(plan)
    return (plan.store, policy.storage, plan.decode_impl, plan.online_impl, plan.page_size, plan.head_dim,
            plan.softcap, plan.sinks, plan.device, plan.dtype, more, plan.running_scores, plan.online_eviction,
            policy.merge if policy.merges else None, policy.scoring if more else None)
