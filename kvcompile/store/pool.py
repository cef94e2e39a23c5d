"""One page pool per layer and page layout, shared by every request of a serving engine, and the stores that live
in it (docs/INTERNALS.md "Paged cache layout": the pool).

`PagePool`: one layer's page tensors of one layout (a store class's `pool_fields`: `k_pages`, `v_pages`,
`score_pages`, `pos_pages`, `count_pages` of `kvcompile.store.pages`; for codes also the scales and zero points of
`kvcompile.store.codes`) and one allocator over them: a free map of pages, `take(n)` the lowest n free pages (so a
request's run of pages stays consecutive where the pool allows, as the decode kernel streams them),
`give_back(ids)`, and the byte counts. When too few pages are free the pool grows by a quarter at least, and
every store living in it is pointed at the grown tensors (the pool's `_stores`).

`Pooled`: what a store class becomes in a pool (one mixin, `POOLED`: `PooledStore(Pooled, LayerStore)`,
`PooledCodeStore`, `PooledChannelCodeStore`): a request's layer with its own block table (ids of pool pages),
lengths, slots and owned counts, the pool's page tensors. Everything its store class does it does the same way
(the layout, append, removal, codes, byte counts of what it holds); its new page runs come from the pool
(`_new_runs`), and the pages it took are its lease, given back when the store is released (`release`) or dropped
(a finalizer). A deep copy, or `detached()`, is a store of its class with pages of its own (a cache that leaves the
engine). A `TieredStore` lives in the pools tier by tier: each tier a pooled store in the pool of its layout (the
float tier's, the codes'), the tiered store itself unchanged around them.

`PagePools`: the pools of an engine, per layer one per page layout (made on first use from the first store
adopted there), `adopt` (a store built by the engine moved into the pools: `LayerStore`, `CodeStore`,
`TieredStore`), `release` and `detached` (a request's store, whatever its kind), and `batch`: a batched decode
step's requests as one store of their class over their pool (`Batch`: `BatchStore`, `BatchCodeStore`; two tiers a
`BatchTieredStore` of each tier's), what a decode step runs on once for all of them (kvcompile.engine.batch).
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.store.codes import ChannelCodeStore, CodeStore
from kvcompile.store.pages import LayerStore
from kvcompile.store.tiers import TieredStore

_FILL = {"pos_pages": -1}  # what a free page holds (the rest: 0), as a fresh store's pages


class PagePool:
    """One layer's pages of one layout for every request of an engine, and their allocator."""

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], kv_fields: tuple[str, ...], device,
                 pages: int = 0):
        """`layout`: each page tensor's name, shape of one page and dtype (`like`); kv_fields: the tensors a decode
        attention backend reads, in its order (the store class's `kv_fields`)."""
        self.fields = tuple(layout)
        self.kv_fields = kv_fields
        for name, (shape, dtype) in layout.items():
            setattr(self, name, torch.full((pages, *shape), _FILL.get(name, 0), dtype=dtype, device=device))
        self.free = torch.ones(pages, dtype=torch.bool)  # the free map (on the host)
        self.free_pages = pages  # its count
        self._lock = threading.Lock()  # a dropped store's pages may come back from another thread
        self._stores: weakref.WeakValueDictionary[int, Pooled] = weakref.WeakValueDictionary()

    @staticmethod
    def layout(store: LayerStore) -> tuple:
        """The page layout of `store` (its class's page tensors, each one page's shape and dtype, and the device):
        the stores whose layouts are equal share a pool."""
        return (type(store).__name__, store.device,
                *((name, tuple(getattr(store, name).shape[1:]), getattr(store, name).dtype)
                  for name in store.pool_fields))

    @classmethod
    def like(cls, store: LayerStore) -> "PagePool":
        """An empty pool for pages like `store`'s (its layout: page size, widths, dtypes, device)."""
        return cls({name: (tuple(getattr(store, name).shape[1:]), getattr(store, name).dtype)
                    for name in store.pool_fields}, store.kv_fields, store.device)

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    # --- the allocator --------------------------------------------------------------------------------------
    @property
    def pages(self) -> int:
        return self.k_pages.shape[0]

    def take(self, n: int) -> Tensor:
        """The lowest `n` free pages (n,) long on the pool's device, now taken; the pool grows when fewer are
        free."""
        with self._lock:
            if n > self.free_pages:
                self._grow(max(n - self.free_pages, self.pages // 4, 16))
            ids = self.free.nonzero().squeeze(1)[:n]
            self.free[ids] = False
            self.free_pages -= n
        return ids.to(self.k_pages.device)

    def reserve(self, n: int) -> None:
        """At least `n` pages free: the pool grows once where fewer are (many stores adopted one after another would
        grow it by a quarter at a time, copying it each time)."""
        with self._lock:
            if n > self.free_pages:
                self._grow(n - self.free_pages)

    def give_back(self, ids: Tensor) -> None:
        """Pages `ids` are free again, emptied (positions −1, counts 0, keys and values 0)."""
        if not ids.numel():
            return
        with self._lock:
            host = ids.cpu()
            if not bool(self.free[host].logical_not().all()):
                raise RuntimeError("kvcompile: a page given back to the pool twice")
            for name in self.fields:
                getattr(self, name).index_fill_(0, ids, _FILL.get(name, 0))
            self.free[host] = True
            self.free_pages += len(host)

    def _grow(self, extra: int) -> None:
        for name in self.fields:
            t = getattr(self, name)
            setattr(self, name, torch.cat([t, t.new_full((extra, *t.shape[1:]), _FILL.get(name, 0))]))
        self.free = torch.cat([self.free, torch.ones(extra, dtype=torch.bool)])
        self.free_pages += extra
        for store in list(self._stores.values()):
            store._use_pool_tensors()

    def writable(self) -> None:
        """Make pages made under torch.inference_mode() writable outside it (copied once; every store follows)."""
        if self.k_pages.is_inference():
            for name in self.fields:
                setattr(self, name, getattr(self, name).clone())
            for store in list(self._stores.values()):
                store._use_pool_tensors()

    # --- bytes ----------------------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page: its entries' keys, values (codes, scales, zero points), scores, positions and counts."""
        return sum(_empty_page_bytes(getattr(self, name)) for name in self.fields)

    @property
    def kv_page_bytes(self) -> int:
        return sum(_empty_page_bytes(t) for t in self.kv())

    def kv(self) -> tuple[Tensor, ...]:
        """What a decode attention backend reads besides the block table and lengths (a store's `kv()`)."""
        return tuple(getattr(self, name) for name in self.kv_fields)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (pages taken or free)."""
        return self.pages * self.page_bytes

    @property
    def bytes_taken(self) -> int:
        return (self.pages - self.free_pages) * self.page_bytes

    # --- stores ---------------------------------------------------------------------------------------------
    def adopt(self, store: LayerStore) -> "Pooled":
        """`store`'s entries and layout in pages of this pool (each page a head owns copied into a pool page, the
        block table renumbered): the store of its class's pooled class (`POOLED`) that replaces it."""
        pooled_class = POOLED.get(type(store))
        if pooled_class is None:
            raise TypeError(f"kvcompile: a page pool holds the pages of {', '.join(c.__name__ for c in POOLED)}, "
                            f"not {type(store).__name__}")
        if store.pool_fields != self.fields:
            raise TypeError(f"kvcompile: a {type(store).__name__} does not have this pool's page layout")
        cols = torch.arange(store.block_table.shape[-1], device=store.block_table.device)
        owned = cols < store.owned[..., None]
        mine = store.block_table[owned]  # the pages the heads own, distinct
        ids = self.take(int(mine.numel()))
        for name in self.fields:
            getattr(self, name)[ids] = getattr(store, name)[mine]
        remap = torch.zeros(store.k_pages.shape[0], dtype=torch.long, device=ids.device)
        remap[mine] = ids
        table = torch.where(owned, remap[store.block_table], 0)
        pooled = pooled_class(**{f.name: getattr(self, f.name) if f.name in self.fields else getattr(store, f.name)
                                 for f in dataclasses.fields(type(store))} | dict(block_table=table, next_page=0),
                              pool=self)
        pooled.lengths, pooled.slots, pooled.owned = store.lengths.clone(), store.slots.clone(), store.owned.clone()
        pooled._lease(ids)
        return pooled


def _empty_page_bytes(t: Tensor) -> int:
    """Bytes of one page of tensor t (P, S, ...), whatever P."""
    n = 1
    for size in t.shape[1:]:
        n *= size
    return n * t.element_size()


@dataclass(eq=False)
class Pooled:
    """A request's layer in a shared `PagePool`: the layout of its store class (`own`) over the pool's page tensors.
    Mixed in before the store class (`POOLED`)."""

    own: ClassVar[type]  # the store class it pools (`detached` gives one)
    pool: PagePool | None = None
    leased: int = 0  # pages taken from the pool (on the host)
    lease: list = field(default_factory=list)  # their ids, tensors (n,) long; given back with the store
    version: int = 0  # on the host: bumped by every change of the block table or lengths (a batched step's
    #                   block table and lengths of a layer stay valid while no store of the batch changed)
    _release: object = None  # the finalizer that gives them back (once)

    def __post_init__(self):
        self.lease = []
        self._release = weakref.finalize(self, _give_back, self.pool, self.lease)
        self.pool._stores[id(self)] = self

    def _lease(self, ids: Tensor) -> None:
        self.lease.append(ids)
        self.leased += int(ids.numel())

    def _use_pool_tensors(self) -> None:
        for name in self.pool.fields:
            setattr(self, name, getattr(self.pool, name))

    # every method that changes the block table or the lengths counts it (`version`)
    def append(self, *args, **kwargs) -> None:
        self.version += 1
        super().append(*args, **kwargs)

    def remove_where(self, leaving: Tensor, e: Tensor) -> None:
        self.version += 1
        super().remove_where(leaving, e)

    def step(self, *args, **kwargs):
        self.version += 1
        return super().step(*args, **kwargs)

    def rotate_out(self, leaving: Tensor, pages: int) -> None:
        self.version += 1
        super().rotate_out(leaving, pages)

    def crop(self, cutoff: Tensor) -> None:
        self.version += 1
        super().crop(cutoff)

    def _new_runs(self, fresh: int, step: int, heads: int) -> Tensor:
        self.version += 1
        ids = self.pool.take(fresh * step)
        self._use_pool_tensors()  # the pool may have grown
        self._lease(ids)
        return ids.view(fresh, step)

    def release(self) -> None:
        """Give the store's pages back to the pool (a finished request); the store holds nothing after."""
        self._release()
        self.version += 1
        self.leased = 0
        self.lengths = torch.zeros_like(self.lengths)
        self.owned = torch.zeros_like(self.owned)
        self.room = 0

    @property
    def released(self) -> bool:
        return not self._release.alive

    def detached(self) -> LayerStore:
        """The same entries and layout in pages of its own (a store of its class, `own`): a cache that leaves the
        engine."""
        mine = torch.cat(self.lease) if self.lease else torch.zeros(0, dtype=torch.long, device=self.device)
        remap = torch.zeros(self.pool.pages, dtype=torch.long, device=mine.device)
        remap[mine] = torch.arange(mine.numel(), device=mine.device)
        cols = torch.arange(self.block_table.shape[-1], device=self.block_table.device)
        table = torch.where(cols < self.owned[..., None], remap[self.block_table], 0)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self.own)}
        fields.update({name: getattr(self.pool, name)[mine].clone() for name in self.pool.fields})
        fields.update(block_table=table, lengths=self.lengths.clone(), slots=self.slots.clone(),
                      owned=self.owned.clone(), next_page=int(mine.numel()))
        return self.own(**fields)

    def __deepcopy__(self, memo):
        return self.detached()

    def rows(self, index: Tensor, spare_pages: int) -> LayerStore:
        return self.detached().rows(index, spare_pages)

    def refill(self, other: LayerStore) -> bool:
        return False  # a pool's pages are not one store's: the caller takes `other` as it is

    def writable(self) -> None:
        self.pool.writable()
        for name in ("block_table", "lengths", "slots", "owned"):
            value = getattr(self, name)
            if value.is_inference():
                setattr(self, name, value.clone())

    def _grow(self, extra: int) -> None:
        raise RuntimeError("kvcompile: a pooled store takes its pages from its pool (_new_runs)")

    # --- bytes: what the store holds of the pool ------------------------------------------------------------
    @property
    def own_tensors_bytes(self) -> int:
        return sum(t.nbytes for t in (self.block_table, self.lengths, self.slots, self.owned))

    @property
    def nbytes(self) -> int:
        return self.leased * self.pool.page_bytes + self.own_tensors_bytes

    @property
    def page_bytes(self) -> int:
        return self.pool.page_bytes

    @property
    def kv_page_bytes(self) -> int:
        return self.pool.kv_page_bytes

    @property
    def kv_bytes_allocated(self) -> int:
        return self.leased * self.pool.kv_page_bytes

    @property
    def metadata_bytes(self) -> int:
        return self.leased * (self.pool.page_bytes - self.pool.kv_page_bytes) + self.block_table.nbytes

    def growth_bytes(self, step: int) -> int:
        """Bytes the store grows by when every head appends one entry: a head on a full last page without spares
        takes a run of `step` pool pages (the pool's own growth is the engine's, not the request's)."""
        fresh, table = self._next_append(step)
        return fresh * step * self.pool.page_bytes + table


@dataclass(eq=False)
class Batch:
    """One layer of a batched decode step's requests as one store of their class (`BATCH`: `BatchStore`,
    `BatchCodeStore`, `BatchChannelCodeStore`; two tiers: `BatchTieredStore`): the pool's page tensors, the step's
    block table (R, H, M), and the members' lengths, slots and owned counts (R, H), a row a request (`held`). A
    decode step (the plan's, `Plan.decode_step`; or the append and the decode attention backend,
    `engine.online.TorchStep`) runs on it once for all of them, through the methods every store of the class has;
    a head's step reads and writes its own pages only, so each row's result is what its store's own step gives.
    `finish()` then hands every member its row back. It takes no page: the members made room before the step
    (`make_room`). Mixed in before the store class."""

    counters: ClassVar[tuple[str, ...]] = ("room",)  # host counters: the members' least, what the step spends of
    #                                                   it each member spends (`finish`)
    members: list = field(default_factory=list)  # the requests' pooled stores, in row order
    budgets: Tensor | None = None  # what the step settled the heads to (`settle`), handed to the members by finish
    rotated: bool = False  # the step rotated block table rows (KIVI's flush: `rotate_out`)

    def __post_init__(self):
        self.start = {name: getattr(self, name) for name in self.counters}

    @property
    def held(self) -> tuple[Tensor, ...]:
        """The step's block table, lengths, slots and owned counts (what the next step takes again while no member
        changed: kvcompile.engine.batch)."""
        return self.block_table, self.lengths, self.slots, self.owned

    def settle(self, budget: Tensor) -> None:
        """The step settled the heads to budget (R, H) (online eviction's first step): the members take it at
        `finish`, after their append's count, as their own step orders the two."""
        self.settled = True
        self.budgets = budget

    def rotate_out(self, leaving: Tensor, pages: int) -> None:
        super().rotate_out(leaving, pages)
        self.rotated = True

    def _new_runs(self, fresh: int, step: int, heads: int) -> Tensor:
        raise RuntimeError("kvcompile: a batched decode step takes no page (its members make room before it)")

    def finish(self, evicted: bool) -> None:
        """Every member takes its row of the step (its lengths are that row already, `PagePools.batch`): where its
        rows changed otherwise than by one append a head (`evicted`: tokens left online; a flush; a rotation), its
        row of the step's slots (and block table, where rotated); what the step spent of the host counters (`room`,
        KIVI's `flush_room`) and, where the step settled it (online eviction's first step), its budget, in the
        order its own step does these."""
        members = self.members  # (their lengths are rows of the step's: `PagePools.batch`)
        if evicted or self.rotated:
            torch._foreach_copy_([m.slots for m in members], list(self.slots.split(1)))
        if self.rotated:
            rows = self.block_table.split(1)
            torch._foreach_copy_([m.block_table for m in members],
                                 [row[..., :m.block_table.shape[-1]] for m, row in zip(members, rows)])
        spent = [(name, start - getattr(self, name)) for name, start in self.start.items()]
        for i, member in enumerate(members):
            for name, count in spent:
                setattr(member, name, getattr(member, name) - count)
            member.version += 1
            if self.budgets is not None and not member.settled:
                member.settle(self.budgets[i:i + 1])


@dataclass(eq=False)
class BatchStore(Batch, LayerStore):
    """A batched step's full-precision layers (`Batch`)."""


@dataclass(eq=False)
class BatchCodeStore(Batch, CodeStore):
    """A batched step's layers of codes per entry (int8, int4; `Batch`)."""


@dataclass(eq=False)
class BatchChannelCodeStore(Batch, ChannelCodeStore):
    """A batched step's tiers of KIVI's codes (`Batch`): their flush is one op for all their heads."""

    counters: ClassVar[tuple[str, ...]] = ("room", "flush_room")


@dataclass(eq=False)
class BatchTieredStore(TieredStore):
    """A batched step's layers of two tiers: each tier the batch of the members' tier (`Batch`), so the step's
    append (into the appending tier's pool), the low tier's flush (one op) and the attention over both pools run
    on it as on one TieredStore."""

    held = property(lambda self: self.high.held + self.low.held)

    def finish(self, evicted: bool) -> None:
        for tier in (self.high, self.low):  # each member's rows of both tiers (an append, a flush)
            tier.finish(evicted=True)


def _give_back(pool: PagePool, lease: list) -> None:
    if lease:
        pool.give_back(torch.cat(lease))
        lease.clear()


@dataclass(eq=False)
class PooledStore(Pooled, LayerStore):
    """A request's full-precision layer in a pool."""

    own: ClassVar[type] = LayerStore


@dataclass(eq=False)
class PooledCodeStore(Pooled, CodeStore):
    """A request's layer of codes (int8, int4; a tiered store's low tier) in a pool."""

    own: ClassVar[type] = CodeStore


@dataclass(eq=False)
class PooledChannelCodeStore(Pooled, ChannelCodeStore):
    """KIVI's tier of codes (keys per channel) in a pool; a flush changes its lengths (`version`)."""

    own: ClassVar[type] = ChannelCodeStore

    def flush(self, high: LayerStore, step: int) -> None:
        self.version += 1
        super().flush(high, step)


POOLED = {LayerStore: PooledStore, CodeStore: PooledCodeStore, ChannelCodeStore: PooledChannelCodeStore}
# a batched step's store of a store class
BATCH = {LayerStore: BatchStore, CodeStore: BatchCodeStore, ChannelCodeStore: BatchChannelCodeStore,
         TieredStore: BatchTieredStore}


def tiers(store) -> tuple:
    """The page stores of a layer's store: a TieredStore's two tiers, else the store itself."""
    return (store.high, store.low) if isinstance(store, TieredStore) else (store,)


class PagePools:
    """An engine's page pools, per layer one per page layout (made on first use), and the batched decode step's write
    and attention."""

    def __init__(self, layers: int):
        self.by_layout: list[dict[tuple, PagePool]] = [{} for _ in range(layers)]

    @property
    def layers(self) -> list[PagePool | None]:
        """Each layer's first pool (its only one unless its stores have two tiers: `by_layout`), or None."""
        return [next(iter(pools.values()), None) for pools in self.by_layout]

    def pool(self, layer: int, store: LayerStore) -> PagePool:
        """The layer's pool of `store`'s page layout (made on first use)."""
        key = PagePool.layout(store)
        pool = self.by_layout[layer].get(key)
        if pool is None:
            pool = self.by_layout[layer][key] = PagePool.like(store)
        return pool

    def reserve(self, layer: int, stores: list) -> None:
        """The layer's pools grown once to adopt every store of `stores` (each tier of a TieredStore; the pages its
        heads own)."""
        need: dict[int, list] = {}
        for store in stores:
            for tier in tiers(store):
                if not isinstance(tier, Pooled):
                    pool = self.pool(layer, tier)
                    need.setdefault(id(pool), [pool, 0])[1] += int(tier.owned.sum())
        for pool, pages in need.values():
            pool.reserve(pages)

    def adopt(self, layer: int, store):
        """`store` (a layer's pages built by the engine: a LayerStore, a store of codes, or each tier of a
        TieredStore) moved into the layer's pool of its layout."""
        if isinstance(store, TieredStore):
            return dataclasses.replace(store, high=self.adopt(layer, store.high), low=self.adopt(layer, store.low))
        if isinstance(store, Pooled):
            return store
        return self.pool(layer, store).adopt(store)

    @staticmethod
    def release(store) -> None:
        """A request's layer gives its pages back to the pools (each tier's)."""
        for tier in tiers(store):
            if isinstance(tier, Pooled):
                tier.release()

    @staticmethod
    def detached(store):
        """A request's layer with pages of its own (each tier's), the pools' pages given back."""
        if isinstance(store, TieredStore):
            return dataclasses.replace(store, high=PagePools.detached(store.high), low=PagePools.detached(store.low))
        if not isinstance(store, Pooled):
            return store
        own = store.detached()
        store.release()
        return own

    @staticmethod
    def pooled(store) -> bool:
        """Every tier of `store` lives in a pool."""
        return all(isinstance(tier, Pooled) for tier in tiers(store))

    @staticmethod
    def batch(stores: list, held: tuple[Tensor, ...] | None = None) -> Batch | BatchTieredStore:
        """The requests' layers `stores` (made room in) of a batched decode step as one store of their class over
        their pool, for a decode step to run on once (`Batch`; two tiers: each tier's). `held`: the step's block
        table (R, H, M), lengths, slots and owned counts (R, H) (a tier's after the other: `Batch.held`); default:
        the stores' own, block tables padded over the batch. Each store's lengths become its row of the step's (a
        view), so the step's count of every head's entries is each store's with no copy back (`Batch.finish`)."""
        if isinstance(stores[0], TieredStore):
            high, low = (None, None) if held is None else (held[:4], held[4:])
            return BatchTieredStore(PagePools.batch([s.high for s in stores], high),
                                    PagePools.batch([s.low for s in stores], low), stores[0].storage)
        if held is None:
            table = torch.nn.utils.rnn.pad_sequence([store.block_table[0].T for store in stores], batch_first=True)
            held = (table.transpose(1, 2).contiguous(),
                    *(torch.cat([getattr(store, name) for store in stores]) for name in ("lengths", "slots", "owned")))
        lengths = held[1]
        for i, store in enumerate(stores):  # each member's lengths the step's row: the step counts them in place
            if store.lengths._base is not lengths:
                store.lengths = lengths[i:i + 1]
        pool, cls = stores[0].pool, BATCH[stores[0].own]
        return cls(**{name: getattr(pool, name) for name in pool.fields}, **dict(zip(("block_table", "lengths",
                   "slots", "owned"), held)), next_page=pool.pages, settled=all(s.settled for s in stores),
                   storage=stores[0].storage, members=stores,
                   **{name: min(getattr(s, name) for s in stores) for name in cls.counters})

    def report(self) -> dict:
        """Pages and bytes of every pool: all, free, and taken."""
        pools = [p for layer in self.by_layout for p in layer.values()]
        return {"pages": sum(p.pages for p in pools), "free_pages": sum(p.free_pages for p in pools),
                "bytes": sum(p.nbytes for p in pools), "bytes_taken": sum(p.bytes_taken for p in pools)}
