"""One page pool per layer, shared by every request of a serving engine, and the stores that live in it
(docs/INTERNALS.md "Paged cache layout": the pool).

`PagePool`: one layer's page tensors (`k_pages`, `v_pages`, `score_pages`, `pos_pages`, `count_pages`, the
layout of `kvcompile.store.pages`) and one allocator over them: a free map of pages, `take(n)` the lowest n free
pages (so a request's run of pages stays consecutive where the pool allows, as the decode kernel streams them),
`give_back(ids)`, and the byte counts. When too few pages are free the pool grows by a quarter at least, and
every store living in it is pointed at the grown tensors (the pool's `_stores`).

`PooledStore(LayerStore)`: a request's layer in a pool: its own block table (ids of pool pages), lengths,
slots and owned counts, the pool's page tensors. Everything a `LayerStore` does it does the same way (the layout,
append, removal, byte counts of what it holds); its new page runs come from the pool (`_new_runs`), and the
pages it took are its lease, given back when the store is released (`release`) or dropped (a finalizer). A
deep copy, or `detached()`, is a plain `LayerStore` with pages of its own (a cache that leaves the engine).

`PagePools`: the pools of an engine, one per layer, made on first use from the first store adopted there
(`adopt`: a `LayerStore` built by the engine moved into the pool), `append`, the batched decode step's one
write of every request's new entry, and `batch`, a batched step's requests as one store over the pool
(`BatchStore`, what the plan's decode step runs on once for all of them; kvcompile.engine.batch).

Full-precision stores only (`LayerStore`); the stores of codes and of two tiers keep pages of their own.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvcompile.store.pages import PAGE_FIELDS, LayerStore

_FILL = {"pos_pages": -1}  # what a free page holds (the rest: 0), as a fresh store's pages


class PagePool:
    """One layer's pages for every request of an engine, and their allocator."""

    def __init__(self, page_size: int, k_dim: int, v_dim: int, dtype: torch.dtype, device, pages: int = 0):
        self.page_size = page_size
        self.k_pages = torch.zeros(pages, page_size, k_dim, dtype=dtype, device=device)
        self.v_pages = torch.zeros(pages, page_size, v_dim, dtype=dtype, device=device)
        self.score_pages = torch.zeros(pages, page_size, dtype=torch.float32, device=device)
        self.pos_pages = torch.full((pages, page_size), -1, dtype=torch.long, device=device)
        self.count_pages = torch.zeros(pages, page_size, dtype=torch.float32, device=device)
        self.free = torch.ones(pages, dtype=torch.bool)  # the free map (on the host)
        self.free_pages = pages  # its count
        self._lock = threading.Lock()  # a dropped store's pages may come back from another thread
        self._stores: weakref.WeakValueDictionary[int, PooledStore] = weakref.WeakValueDictionary()

    @classmethod
    def like(cls, store: LayerStore) -> "PagePool":
        """An empty pool for pages like `store`'s (page size, head dims, dtype, device)."""
        return cls(store.page_size, store.k_pages.shape[-1], store.v_pages.shape[-1], store.k_pages.dtype,
                   store.device)

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

    def give_back(self, ids: Tensor) -> None:
        """Pages `ids` are free again, emptied (positions −1, counts 0, keys and values 0)."""
        if not ids.numel():
            return
        with self._lock:
            host = ids.cpu()
            if not bool(self.free[host].logical_not().all()):
                raise RuntimeError("kvcompile: a page given back to the pool twice")
            for name in PAGE_FIELDS:
                getattr(self, name).index_fill_(0, ids, _FILL.get(name, 0))
            self.free[host] = True
            self.free_pages += len(host)

    def _grow(self, extra: int) -> None:
        for name in PAGE_FIELDS:
            t = getattr(self, name)
            setattr(self, name, torch.cat([t, t.new_full((extra, *t.shape[1:]), _FILL.get(name, 0))]))
        self.free = torch.cat([self.free, torch.ones(extra, dtype=torch.bool)])
        self.free_pages += extra
        for store in list(self._stores.values()):
            store._use_pool_tensors()

    def writable(self) -> None:
        """Make pages made under torch.inference_mode() writable outside it (copied once; every store follows)."""
        if self.k_pages.is_inference():
            for name in PAGE_FIELDS:
                setattr(self, name, getattr(self, name).clone())
            for store in list(self._stores.values()):
                store._use_pool_tensors()

    # --- bytes ----------------------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page: its entries' keys, values, scores, positions and counts."""
        return sum(_empty_page_bytes(getattr(self, name)) for name in PAGE_FIELDS)

    @property
    def kv_page_bytes(self) -> int:
        return sum(_empty_page_bytes(t) for t in (self.k_pages, self.v_pages))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (pages taken or free)."""
        return self.pages * self.page_bytes

    @property
    def bytes_taken(self) -> int:
        return (self.pages - self.free_pages) * self.page_bytes

    # --- stores ---------------------------------------------------------------------------------------------
    def adopt(self, store: LayerStore) -> "PooledStore":
        """`store`'s entries and layout in pages of this pool (each page a head owns copied into a pool page, the
        block table renumbered): the store that replaces it."""
        if type(store) is not LayerStore:
            raise TypeError(f"kvcompile: a page pool holds full-precision pages (LayerStore), not {type(store).__name__}")
        cols = torch.arange(store.block_table.shape[-1], device=store.block_table.device)
        owned = cols < store.owned[..., None]
        mine = store.block_table[owned]  # the pages the heads own, distinct
        ids = self.take(int(mine.numel()))
        for name in PAGE_FIELDS:
            getattr(self, name)[ids] = getattr(store, name)[mine]
        remap = torch.zeros(store.k_pages.shape[0], dtype=torch.long, device=ids.device)
        remap[mine] = ids
        table = torch.where(owned, remap[store.block_table], 0)
        pooled = PooledStore(**{f.name: getattr(self, f.name) if f.name in PAGE_FIELDS else getattr(store, f.name)
                                for f in dataclasses.fields(LayerStore)} | dict(block_table=table, next_page=0),
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
class PooledStore(LayerStore):
    """A request's layer in a shared `PagePool`: the layout of LayerStore over the pool's page tensors."""

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
        for name in PAGE_FIELDS:
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
        """The same entries and layout in pages of its own (a plain LayerStore): a cache that leaves the engine."""
        mine = torch.cat(self.lease) if self.lease else torch.zeros(0, dtype=torch.long, device=self.device)
        remap = torch.zeros(self.pool.pages, dtype=torch.long, device=mine.device)
        remap[mine] = torch.arange(mine.numel(), device=mine.device)
        cols = torch.arange(self.block_table.shape[-1], device=self.block_table.device)
        table = torch.where(cols < self.owned[..., None], remap[self.block_table], 0)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(LayerStore)}
        fields.update({name: getattr(self.pool, name)[mine].clone() for name in PAGE_FIELDS})
        fields.update(block_table=table, lengths=self.lengths.clone(), slots=self.slots.clone(),
                      owned=self.owned.clone(), next_page=int(mine.numel()))
        return LayerStore(**fields)

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
class BatchStore(LayerStore):
    """One layer of a batched decode step's requests as one store: the pool's page tensors, the step's block
    table (R, H, M), and the members' lengths, slots and owned counts (R, H), a row a request. The plan's decode
    step (`Plan.online_step`: the append, the attention with the merge bias, running scores, online eviction) runs
    on it once for all of them, through the methods every store has; a head's step reads and writes its own pages
    only, so each row's result is what its store's own step gives. `finish()` then hands every member its row back.
    It takes no page: the members made room before the step (`make_room`)."""

    members: list = field(default_factory=list)  # the requests' PooledStores, in row order
    budgets: Tensor | None = None  # what the step settled the heads to (`settle`), handed to the members by finish

    def settle(self, budget: Tensor) -> None:
        """The step settled the heads to budget (R, H) (online eviction's first step): the members take it at
        `finish`, after their append's count, as their own step orders the two."""
        self.settled = True
        self.budgets = budget

    def _new_runs(self, fresh: int, step: int, heads: int) -> Tensor:
        raise RuntimeError("kvcompile: a batched decode step takes no page (its members make room before it)")

    def finish(self) -> None:
        """Every member takes its row of the step's lengths and slots, counts its append (`room`) and, where the
        step settled it (online eviction's first step), its budget, in the order its own step does these."""
        members = self.members
        torch._foreach_copy_([m.lengths for m in members], list(self.lengths.split(1)))
        torch._foreach_copy_([m.slots for m in members], list(self.slots.split(1)))
        for i, member in enumerate(members):
            member.room -= 1
            member.version += 1
            if self.budgets is not None and not member.settled:
                member.settle(self.budgets[i:i + 1])


def _give_back(pool: PagePool, lease: list) -> None:
    if lease:
        pool.give_back(torch.cat(lease))
        lease.clear()


class PagePools:
    """An engine's page pools, one per layer (made on first use), and the batched decode step's write."""

    def __init__(self, layers: int):
        self.layers: list[PagePool | None] = [None] * layers

    def adopt(self, layer: int, store: LayerStore) -> PooledStore:
        """`store` (a layer's pages built by the engine) moved into the layer's pool."""
        if isinstance(store, PooledStore):
            return store
        if self.layers[layer] is None:
            self.layers[layer] = PagePool.like(store)
        return self.layers[layer].adopt(store)

    def append(self, layer: int, stores: list[PooledStore], block_table: Tensor, lengths: Tensor, k: Tensor,
               v: Tensor, positions: Tensor) -> Tensor:
        """One decode token of every request in `stores` (one sequence each) appended in one write: k, v (R, H, d)
        into each head's next slot by the step's block table (R, H, M) and lengths (R, H) (`make_room` ran
        first); each store's lengths and room count it. Returns the lengths after the append (R, H)."""
        pool = self.layers[layer]
        s = pool.page_size
        r, h = lengths.shape
        entry = (block_table.gather(-1, (lengths // s)[..., None]).squeeze(-1) * s + lengths % s).view(-1)
        pool.k_pages.view(-1, pool.k_pages.shape[-1]).index_copy_(0, entry, k.reshape(r * h, -1).to(pool.k_pages.dtype))
        pool.v_pages.view(-1, pool.v_pages.shape[-1]).index_copy_(0, entry, v.reshape(r * h, -1).to(pool.v_pages.dtype))
        pool.score_pages.view(-1).index_fill_(0, entry, 0.0)
        pool.pos_pages.view(-1).index_copy_(0, entry, positions[:, None].expand(r, h).reshape(-1))
        pool.count_pages.view(-1).index_fill_(0, entry, 1.0)
        torch._foreach_add_([store.lengths for store in stores], 1)
        for store in stores:
            store.room -= 1
            store.version += 1
        return lengths + 1

    def batch(self, layer: int, stores: list[PooledStore], block_table: Tensor, lengths: Tensor) -> BatchStore:
        """The requests `stores` of a batched decode step (their block table (R, H, M) and lengths (R, H), made room
        in) as one store over the layer's pool, for the plan's decode step to run on once (`BatchStore`)."""
        pool = self.layers[layer]
        return BatchStore(**{name: getattr(pool, name) for name in PAGE_FIELDS}, block_table=block_table,
                          lengths=lengths, slots=torch.cat([s.slots for s in stores]), next_page=pool.pages,
                          owned=torch.cat([s.owned for s in stores]), settled=all(s.settled for s in stores),
                          room=min(s.room for s in stores), storage=stores[0].storage, members=stores)

    def attend(self, layer: int, backend, q: Tensor, block_table: Tensor, lengths: Tensor, scale: float) -> Tensor:
        """Decode attention of the batch's queries q (R, Hq, d) over their heads' pages in the layer's pool (block
        table (R, H, M), lengths (R, H)) by a decode attention backend (kvcompile.kernels.paged_attention): one call."""
        pool = self.layers[layer]
        return backend(q, pool.k_pages, pool.v_pages, block_table, lengths, None, scale)

    def report(self) -> dict:
        """Pages and bytes of every layer's pool: all, free, and taken."""
        pools = [p for p in self.layers if p is not None]
        return {"pages": sum(p.pages for p in pools), "free_pages": sum(p.free_pages for p in pools),
                "bytes": sum(p.nbytes for p in pools), "bytes_taken": sum(p.bytes_taken for p in pools)}
