"""The page layout and the full-precision page store: one layer's paged KV entries, and the only code that
builds, appends to, removes from, selects rows of and measures them (docs/INTERNALS.md "Paged cache layout").
The stores of codes (kvcompile.store.codes) and of two tiers (kvcompile.store.tiers) build on it.

Layout: pages of S = `page_size` entries; page p holds, in slot i, an entry's key `k_pages[p, i]`,
value `v_pages[p, i]`, score, logical position (−1 − r for residual slot r, −1 where nothing is
stored) and merge count (1 for a plain token, 0 for an empty slot). Each (sequence, KV head) owns
pages through its block table row: entry e of head (b, h) is slot e % S of page
`block_table[b, h, e // S]`. A head's residual slots come first, then its prompt tokens in position
order, then its generated tokens. A new store gives each head the pages of its n entries and a reserve (its
partly filled last page counted; whole spare pages where the reserve is k·S), heads in row-major order; a head's decode appends then stay in order in the pool, which the decode
kernel reads at streaming speed.

Kernels take and return tensors (the gather kernel `kvcompile.kernels.select.gather_pages_*` writes
the taken rows into pages the store allocated; the decode kernels read `k_pages`, `v_pages`,
`block_table`, `lengths`); serving asks the store for its bytes. The fused decode steps that write a store's
tensors in place are the store's own (`CppAppendStep`, `CppOnlineStep`, end of this module: their C++ and its
semantics are kvcompile.kernels.append_step and kernels.online_step), so a decode step of fp32 pages or of codes
runs its Python here alone: the plan's step, `LayerStore.step` (the tensors and the append's count), the call.

Decode-time state is updated in place where it can be (`lengths`, `slots`, the pages): a decode step
that needs no new page keeps every tensor's storage, what a captured CUDA graph replays into.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple

import torch
from torch import Tensor

from kvcompile.kernels import append_step as append_kernel, online_step as online_kernel
from kvcompile.kernels import paged_attention_cpp as paged
from kvcompile.kernels.online_step import DecodeStep, _alpha
from kvcompile.selection import HeadEntries

# The bytes every stored entry carries besides its key and value: score float32, position int64, count float32.
ENTRY_METADATA_BYTES = 4 + 8 + 4
# Bytes per head beside its block table row: lengths, slots, owned (int64) and one more word of slack.
HEAD_COUNTER_BYTES = 4 * 8
PAGE_FIELDS = ("k_pages", "v_pages", "score_pages", "pos_pages", "count_pages")
ONLINE_ROOM = 1 << 62  # `room` of a settled online-eviction store whose pages hold every head's budget


@dataclass
class Entries:
    """Candidate entries of one layer, per head: `take` (B, H, E) selects what is stored."""

    keys: Tensor  # (B, H, E, d)
    values: Tensor  # (B, H, E, d)
    scores: Tensor  # (B, H, E) float
    positions: Tensor  # (B, H, E) long, −1 − r for residual slot r
    counts: Tensor  # (B, H, E) float merge counts (1 = plain token, 0 = empty slot)
    take: Tensor  # (B, H, E) bool


def page_table(counts: Tensor, page_size: int, reserve: int = 0) -> tuple[Tensor, Tensor]:
    """The layout of a new store for heads of `counts` (B, H) entries: block table (B, H, max(1, most pages)) long,
    head (b, h) owning the pages of its n entries and `reserve` more, ceil((n + reserve)/S), consecutive in
    row-major head order (unused columns 0), and the pages each head owns (B, H). The free slots of a head's
    partly filled last page count toward the reserve; a reserve of k·S entries is k whole spare pages."""
    owned = (counts + reserve + page_size - 1) // page_size
    base = owned.flatten().cumsum(0).reshape(counts.shape) - owned
    cols = torch.arange(max(int(owned.max()), 1) if owned.numel() else 1, device=counts.device)
    return torch.where(cols < owned[..., None], base[..., None] + cols, 0), owned


def gather_rows(k_pages: Tensor, v_pages: Tensor, score_pages: Tensor, pos_pages: Tensor, count_pages: Tensor,
                block_table: Tensor, start: Tensor, keys: Tensor, values: Tensor, scores: Tensor,
                positions: Tensor, counts: Tensor, take: Tensor) -> None:
    """The plain write of the taken rows into pages (what the gather kernels compute): the i-th taken row
    of head (b, h), in entry order, becomes its entry start[b, h] + i."""
    from kvcompile.kernels.select import gather_pages_torch  # imported on first use: not at `import kvcompile`

    gather_pages_torch(k_pages, v_pages, score_pages, pos_pages, count_pages, block_table, start, keys, values,
                       scores, positions, counts, take)


def _rows(t: Tensor, flat: Tensor) -> Tensor:
    """The rows of pages t (P, S, ...) at entries page · S + slot `flat` (any shape)."""
    return t.reshape(-1, t.shape[-1])[flat] if t.dim() > 2 else t.reshape(-1)[flat]


# A store's tensors, what a kernel that updates pages in place takes (kvcompile.kernels.online_step)
PageTensors = NamedTuple("PageTensors", [(name, Tensor) for name in PAGE_FIELDS + ("block_table", "lengths",
                                                                                   "slots", "owned")])


@dataclass
class LayerStore:
    """One layer's pages in the model's dtype, and the page layout every store class keeps. Entries carry their
    key, value, score, logical position (−1 − r for residual slot r) and merge count (1 for a plain token, 0
    for an empty slot). A subclass changes how keys and values are held (`page_fields`, `_write_kv`,
    `kv_rows`, `kv`, `tensors`: kvcompile.store.codes), never the layout."""

    page_fields: ClassVar[tuple[str, ...]] = PAGE_FIELDS  # the per-entry page tensors (an entry moves with them)
    pool_fields: ClassVar[tuple[str, ...]] = PAGE_FIELDS  # every tensor with a row per page: the pool
    kv_fields: ClassVar[tuple[str, ...]] = ("k_pages", "v_pages")  # what a decode attention backend reads (`kv`)

    k_pages: Tensor  # (P, S, d)
    v_pages: Tensor  # (P, S, d)
    score_pages: Tensor  # (P, S) float32
    pos_pages: Tensor  # (P, S) int64
    count_pages: Tensor  # (P, S) float32
    block_table: Tensor  # (B, H, M) int64
    lengths: Tensor  # (B, H) int64: entries stored per head
    slots: Tensor  # (B, H) occupied residual slots at the start of each head (0 when the policy drops)
    next_page: int  # bump allocator: pages [next_page, P) are free
    owned: Tensor  # (B, H) int64: pages a head owns, block_table[b, h, :owned]; those past its
    #                 entries are its spares, consecutive after its last page where the pool allows
    settled: bool = False  # on the host: every head holds at most its online-eviction budget (ZSMerge), so
    #                        a decode step evicts at most one entry per head (engine.online.evict_online)
    room: int = 0  # on the host: appends every head can still take in the pages it owns (a lower bound:
    #                 removals and crops only add room); while positive an append reads nothing back
    storage: object = None  # the policy's storage part (kvcompile.policies.storage), or None
    k_scale = k_zero = v_scale = v_zero = None  # pages in the model's dtype have no scales (store.codes)

    # --- building --------------------------------------------------------------------------------------

    @classmethod
    def build(cls, sources: list[Entries], slots: Tensor, page_size: int, spare_pages: int = 0,
              gather: Callable = gather_rows, storage=None, dtype: torch.dtype | None = None,
              reserve: int | None = None) -> "LayerStore":
        """A store holding the taken rows of `sources`, one source after the other per head (merge slots
        first), in fresh pages laid out by `page_table`: each head with the pages of `reserve` more entries
        than it holds (Plan.spare_entries), or, without `reserve`, `spare_pages` whole spare pages; `slots`
        (B, H) the occupied residual slots. `gather` writes the rows (a kernel backend's `gather_pages`, or
        the plain `gather_rows`). Only the taken rows are copied (no dense copy of the layer). `storage`: the
        policy's storage part. `dtype`: the pages' dtype (the model's; default: the rows'): re-selected rows
        read from codes are float32."""
        if dtype is not None:
            sources = [dataclasses.replace(src, keys=src.keys.to(dtype), values=src.values.to(dtype))
                       for src in sources]
        first = sources[0]
        d, dv, dev = first.keys.shape[-1], first.values.shape[-1], first.keys.device
        taken = [src.take.sum(-1) for src in sources]  # each (B, H)
        lengths = torch.stack(taken).sum(0)
        block_table, owned = page_table(lengths, page_size, spare_pages * page_size if reserve is None else reserve)
        cap, room = torch.stack([owned.sum(), (owned * page_size - lengths).min()]).tolist() if owned.numel() \
            else (0, 0)
        store = LayerStore(k_pages=first.keys.new_zeros(cap, page_size, d),
                           v_pages=first.values.new_zeros(cap, page_size, dv),
                           score_pages=torch.zeros(cap, page_size, dtype=torch.float32, device=dev),
                           pos_pages=torch.full((cap, page_size), -1, dtype=torch.long, device=dev),
                           count_pages=torch.zeros(cap, page_size, dtype=torch.float32, device=dev),
                           block_table=block_table, lengths=lengths.clone(), slots=slots.to(dev, torch.long).clone(),
                           next_page=cap, owned=owned, room=room, storage=storage)
        start = torch.zeros_like(lengths)
        for src, count in zip(sources, taken):
            if src.take.numel():
                gather(store.k_pages, store.v_pages, store.score_pages, store.pos_pages, store.count_pages,
                       store.block_table, start, src.keys, src.values, src.scores, src.positions, src.counts,
                       src.take)
            start = start + count
        return store

    @classmethod
    def from_heads(cls, heads: list[list[HeadEntries]], page_size: int, spare_pages: int = 0,
                   storage=None, dtype: torch.dtype | None = None, reserve: int | None = None) -> "LayerStore":
        """A store holding every head's entries in order (the inverse of `to_heads`); `spare_pages`,
        `reserve` as `build`'s."""
        b, h = len(heads), len(heads[0])
        width = max(1, max(len(x.positions) for row in heads for x in row))
        first = heads[0][0]
        dev = first.keys.device
        keys = first.keys.new_zeros(b, h, width, first.keys.shape[-1])
        values = first.values.new_zeros(b, h, width, first.values.shape[-1])
        scores = torch.zeros(b, h, width, device=dev)
        pos = torch.full((b, h, width), -1, dtype=torch.long, device=dev)
        counts = torch.zeros(b, h, width, device=dev)
        take = torch.zeros(b, h, width, dtype=torch.bool, device=dev)
        for i, row in enumerate(heads):
            for j, x in enumerate(row):
                n = len(x.positions)
                keys[i, j, :n], values[i, j, :n], scores[i, j, :n] = x.keys, x.values, x.scores
                pos[i, j, :n], counts[i, j, :n], take[i, j, :n] = x.positions, x.counts, True
        return cls.build([Entries(keys, values, scores, pos, counts, take)], (take & (pos < 0)).sum(-1), page_size,
                         spare_pages, storage=storage, dtype=dtype, reserve=reserve)

    def rows(self, index: Tensor, spare_pages: int) -> "LayerStore":
        """A new store whose row i is a copy of row index[i] of this one (entries in the same order,
        merge slots first), each head on fresh pages with its spares (beam search, batch selection)."""
        k, v, scores, pos, counts, stored = self.gather()
        index = index.to(k.device)
        taken = Entries(k[index], v[index], scores[index], pos[index], counts[index], stored[index])
        return type(self).build([taken], self.slots[index], self.page_size, spare_pages, storage=self.storage)

    def writable(self) -> None:
        """Make a store made under torch.inference_mode() updatable outside it (its inference
        tensors are copied once into ordinary ones; DynamicCache concatenates, we write in place)."""
        if not self.k_pages.is_inference():
            return
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.is_inference():
                setattr(self, f.name, value.clone())

    # --- reading ---------------------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    def pages_per_head(self) -> Tensor:
        """(B, H) pages holding entries (a head's spares not counted)."""
        return (self.lengths + self.page_size - 1) // self.page_size

    def entries(self) -> tuple[Tensor, Tensor]:
        """Page and slot of every entry slot (B, H, M·S), and which of them are stored."""
        s = self.page_size
        e = torch.arange(self.block_table.shape[-1] * s, device=self.lengths.device)
        page = self.block_table[..., e // s]
        return page * s + e % s, e < self.lengths[..., None]

    def gather(self):
        """The stored entries as dense per-head tensors (B, H, E, ·), padded beyond lengths:
        keys, values (dequantized, float32, where the pages hold codes), scores, positions, counts, stored."""
        flat, stored = self.entries()
        keys, values = self.kv_rows(flat)
        return (keys, values, self.score_pages.reshape(-1)[flat], self.pos_pages.reshape(-1)[flat],
                self.count_pages.reshape(-1)[flat], stored)

    def kv_rows(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the entries at page · S + slot `flat` (any shape), as floats (the pages' own here;
        x̂ = code · scale + zero for codes, float32)."""
        return _rows(self.k_pages, flat), _rows(self.v_pages, flat)

    def kv(self) -> tuple[Tensor, ...]:
        """What a decode attention backend reads besides the block table and lengths: (k_pages, v_pages) here
        (the six tensors of codes for kvcompile.kernels.paged_attention_quant): the `kv_fields`."""
        return tuple(getattr(self, name) for name in self.kv_fields)

    def tensors(self) -> PageTensors:
        """The store's tensors, for a kernel that reads or updates them in place (the store's own methods
        hand them to it: `step`)."""
        return PageTensors(*(getattr(self, name) for name in PageTensors._fields))

    def attend(self, backend, q: Tensor, merge_bias, scale: float) -> Tensor:
        """Decode attention of one query per head over its pages by a decode attention backend
        (kvcompile.kernels.paged_attention, or paged_attention_quant for codes), with the per-entry bias pages
        `merge_bias(count_pages)` (None where the policy drops)."""
        return backend(q, *self.kv(), self.block_table, self.lengths, merge_bias(self.count_pages), scale)

    def to_heads(self) -> list[list[HeadEntries]]:
        """Every head's entries as HeadEntries (entry order kept)."""
        k, v, scores, pos, counts, _ = self.gather()
        return [[HeadEntries(k[b, h, :n], v[b, h, :n], pos[b, h, :n], scores[b, h, :n], counts[b, h, :n])
                 for h, n in enumerate(row)] for b, row in enumerate(self.lengths.tolist())]

    # --- changing --------------------------------------------------------------------------------------

    def append(self, k: Tensor, v: Tensor, positions: Tensor, step: int = 1, kernel=None) -> None:
        """Append one entry per head: k, v (B, H, d), positions (B,) long; `kernel`: where given, one call of it on
        the store's tensors writes them (`CppAppend`: every head's entry in one C++ call), else torch ops. O(1)
        amortised: a head whose last page is full moves on to its next spare page; one without spares
        takes a run of `step` fresh consecutive pages from the pool (its next spares, so its
        pages stay in runs the decode kernel streams), which grows (rarely) when none is left.

        While `room` (a host count: appends every head's owned pages still take) is positive,
        nothing is read back to the host, no shape changes and every tensor keeps its storage: the
        slot of each head is computed on the device and `lengths` is bumped in place. Only when it runs
        out does the append read the heads that need pages (one host read, Plan.host_syncs "page
        allocation": the generation outgrew the pages reserved for it)."""
        s, e = self.page_size, self.lengths  # (B, H)
        if self.room <= 0:
            self._allocate(e // s, e, step)
        if kernel is not None:
            kernel(self.tensors(), k, v, positions)
        else:
            b, h, _ = k.shape
            page = self.block_table.gather(-1, (e // s)[..., None]).squeeze(-1)
            slot = e % s
            self._write_kv(page, slot, k, v)
            entry = (page * s + slot).view(-1)  # each head's new entry, page · S + slot
            self.score_pages.view(-1).index_fill_(0, entry, 0.0)
            self.pos_pages.view(-1).index_copy_(0, entry, positions[:, None].expand(b, h).reshape(-1).to(torch.long))
            self.count_pages.view(-1).index_fill_(0, entry, 1.0)
            self.lengths += 1
        self.room -= 1

    def _write_kv(self, page: Tensor, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Write each head's new key and value (B, H, d) into its slot (page, slot (B, H))."""
        self.k_pages[page, slot] = k.to(self.k_pages.dtype)
        self.v_pages[page, slot] = v.to(self.v_pages.dtype)

    def _allocate(self, col: Tensor, e: Tensor, step: int) -> None:
        """Give every head on a full last page without spares a run of `step` fresh pages (the one host
        read of `append`), and count the room left."""
        need = col >= self.owned  # its pages all full: e = owned · S
        fresh, self.room = torch.stack([need.sum(), (self.owned * self.page_size - e).min()]).tolist()
        if not fresh:
            return
        self._take_pages(need, fresh, step)
        self.room = int((self.owned * self.page_size - e).min())

    def ensure_pages(self, col: Tensor, step: int) -> None:
        """Make every head own a page at block-table column col[b, h] (B, H): a head that owns fewer takes a
        run of `step` fresh consecutive pages (step > col − owned). One host read, two where pages are taken."""
        need = col >= self.owned
        fresh = int(need.sum())
        if fresh:
            self._take_pages(need, fresh, step)

    def _take_pages(self, need: Tensor, fresh: int, step: int) -> None:
        """A run of `step` fresh consecutive pages after the last page of each of the `fresh` heads with
        need[b, h], from the pool's free pages or a grown pool."""
        runs = self._new_runs(fresh, step, heads=need.numel())
        width = int(torch.where(need, self.owned, 0).max()) + step
        if width > self.block_table.shape[-1]:
            self.block_table = torch.nn.functional.pad(self.block_table, (0, width - self.block_table.shape[-1]))
        bi, hi = need.nonzero(as_tuple=True)
        run = torch.arange(step, device=need.device)
        self.block_table[bi[:, None], hi[:, None], self.owned[bi, hi][:, None] + run] = runs
        self.owned = torch.where(need, self.owned + step, self.owned)

    def _new_runs(self, fresh: int, step: int, heads: int) -> Tensor:
        """`fresh` runs of `step` free pages (fresh, step) long, each run consecutive: the store's own pool's next
        pages, the pool grown (by a quarter at least) when too few are left (kvcompile.store.pool: a shared pool's)."""
        if self.next_page + fresh * step > self.k_pages.shape[0]:
            self._grow(max(fresh * step, self.k_pages.shape[0] // 4, heads))
        first = self.next_page + torch.arange(fresh, device=self.block_table.device) * step  # each head's run
        self.next_page += fresh * step
        return first[:, None] + torch.arange(step, device=self.block_table.device)

    def _movable(self) -> None:
        """Raise where an entry cannot move alone (kvcompile.store.codes.ChannelCodeStore)."""

    def _grow(self, extra: int) -> None:
        """Add `extra` free pages to the pool (copies the compressed pool: amortised O(1))."""
        for name in self.pool_fields:
            t = getattr(self, name)
            fill = -1 if name == "pos_pages" else 0
            setattr(self, name, torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)]))

    def remove(self, b, h, e) -> None:
        """Remove entry e of head (b, h) in O(1): the head's last entry moves into its place
        (order within a head does not matter to attention); an emptied page stays the head's, a
        spare for its next appends (memory held counts only pages with entries).
        b, h, e are ints, or 1-D long tensors naming distinct heads (one entry each, removed at once)."""
        leaving, entry = torch.zeros_like(self.lengths, dtype=torch.bool), torch.zeros_like(self.lengths)
        leaving[b, h] = True
        entry[b, h] = torch.as_tensor(e, device=entry.device)
        self.remove_where(leaving, entry)

    def remove_where(self, leaving: Tensor, e: Tensor) -> None:
        """`remove` of entry e[b, h] (B, H) from every head with leaving[b, h] (B, H) bool, at once, with no
        host read and in place (fixed shapes): the other heads copy one of their own entries onto itself."""
        self._movable()
        s = self.page_size
        last = self.lengths - 1
        dst = torch.where(leaving, e, last.clamp(min=0))
        src = torch.where(leaving, last, dst)
        ends = torch.stack([src, dst], dim=-1)  # (B, H, 2)
        src, dst = (self.block_table.gather(-1, ends // s) * s + ends % s).unbind(-1)
        for name in self.page_fields:
            t = getattr(self, name)
            entries = t.view(-1, *t.shape[2:])
            entries[dst] = entries[src]
        self.lengths.sub_(leaving.to(self.lengths.dtype))

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of the store (pages, scales, block table, counters): what a decode step reads or writes."""
        return [getattr(self, f.name) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)]

    def replayed(self, tokens: int) -> None:
        """The host bookkeeping of `tokens` appends that ran as a replayed graph (`append` counts `room` down)."""
        self.room -= tokens

    def step(self, kernel, q: Tensor, k: Tensor, v: Tensor, position: Tensor, split: Tensor | None,
             scale: float) -> Tensor:
        """One decode step of the layer by a fused kernel (a C++ decode step of the plan's: `CppAppendStep`,
        `CppOnlineStep`, kernels.tiered_step: append, attention and, where the policy has them, running scores
        and online eviction),
        `kernel(tensors, q, k, v, position, split, scale)`, on this store's tensors, in place: its output
        (B, Hq, d). Every head's next entry has a page (`make_room` ran before)."""
        out = kernel(self.tensors(), q, k, v, position, split, scale)
        self.replayed(1)  # the host's count of the append the kernel made into the pages heads own
        return out

    def make_room(self, step: int) -> bool:
        """Before a decode step's append (the plan's step, or a batched one): where a head's pages are full, it
        takes its next run of `step` pages (the host read of `append`, Plan.host_syncs). True where it ran that
        read (`room` was spent)."""
        if self.room > 0:
            return False
        e = self.lengths
        self._allocate(e // self.page_size, e, step)
        return True

    # --- decode-time scores and online eviction (kvcompile.engine.decode, kvcompile.engine.online) -------

    def rescore(self, flat: Tensor, tokens: Tensor, new: Tensor) -> None:
        """Each token entry's score (tokens (B, H, E) at entries `flat`, `entries()`) ← new (B, H, E), with no
        host read: entries past a head's pages share page 0 in `entries()`, so the new scores are written by
        two scatter-adds that are exact whatever the order (s − s = 0, then 0 + new; the others add 0)."""
        scores = self.score_pages.view(-1)
        old = scores[flat]
        flat = flat.reshape(-1)
        scores.scatter_add_(0, flat, torch.where(tokens, -old, 0.0).reshape(-1))
        scores.scatter_add_(0, flat, torch.where(tokens, new, 0.0).to(scores.dtype).reshape(-1))

    def to_slots(self, entry: Tensor, fresh: Tensor, held: Tensor) -> None:
        """Entry entry[b, h] (page · S + slot) of every head with fresh[b, h] becomes its residual slot
        held[b, h] in place (position −1 − held, score 0: its key and value are the slot's mean, count 1)."""
        pf, sf = self.pos_pages.view(-1), self.score_pages.view(-1)
        pf[entry] = torch.where(fresh, -1 - held, pf[entry])
        sf[entry] = torch.where(fresh, 0.0, sf[entry])
        self.slots += fresh

    def fold_into(self, slot: Tensor, fold: Tensor, keys: Tensor, values: Tensor, counts: Tensor) -> None:
        """Entry slot[b, h] (page · S + slot) of every head with fold[b, h] takes key keys[b, h], value
        values[b, h] and count counts[b, h] (a merge into a residual slot; the others keep theirs)."""
        on = fold[..., None]
        for name, new in (("k_pages", keys), ("v_pages", values)):
            rows = getattr(self, name).view(-1, getattr(self, name).shape[-1])
            rows[slot] = torch.where(on, new.to(rows.dtype), rows[slot])
        cf = self.count_pages.view(-1)
        cf[slot] = torch.where(fold, counts, cf[slot])

    def settle(self, budget: Tensor) -> None:
        """Every head holds at most budget[b, h] entries from now on, budget + 1 between a step's append and its
        eviction (online eviction: `settled`, a step then evicts at most one entry a head); where every head's
        pages hold that many, no append needs a page (`room`)."""
        self.settled = True
        if bool((self.owned * self.page_size > budget).all()):
            self.room = ONLINE_ROOM

    def rotate_out(self, leaving: Tensor, pages: int) -> None:
        """Every head with leaving[b, h] gives up the entries of its first `pages` pages (copied elsewhere: KIVI's
        flush, kvcompile.store.codes): they become the last of the pages it owns, its spares, and its
        entries move up by pages · S. In place, with no host read."""
        j = torch.arange(self.block_table.shape[-1], device=leaving.device)
        owned = self.owned[..., None]
        rotated = self.block_table.gather(-1, torch.where(j < owned, (j + pages) % owned.clamp(min=1), j))
        self.block_table.copy_(torch.where(leaving[..., None], rotated, self.block_table))
        self.lengths.sub_(leaving.long() * pages * self.page_size)

    def refill(self, other: "LayerStore") -> bool:
        """Take `other`'s entries and layout into this store's own tensors, where they fit (the same rows,
        storage part and entry shapes, no more pages, no wider block table): every tensor keeps its storage,
        what a captured decode step replays into (a `decode: every` pruning rebuilds a layer). False, and
        nothing changed, where they do not fit."""
        fields = self.pool_fields
        p, m = other.k_pages.shape[0], other.block_table.shape[-1]
        if type(other) is not type(self) or other.storage != self.storage \
                or other.lengths.shape != self.lengths.shape or p > self.k_pages.shape[0] \
                or m > self.block_table.shape[-1] or any(
                    (getattr(other, n).shape[1:], getattr(other, n).dtype) != (getattr(self, n).shape[1:],
                                                                              getattr(self, n).dtype) for n in fields):
            return False
        for name in fields:
            getattr(self, name)[:p].copy_(getattr(other, name))
        self.pos_pages[p:] = -1  # the free pool, as `_grow` leaves it
        self.count_pages[p:] = 0
        self.block_table[..., :m].copy_(other.block_table)
        self.block_table[..., m:] = 0
        for name in ("lengths", "slots", "owned"):
            getattr(self, name).copy_(getattr(other, name))
        self.next_page, self.room, self.settled = other.next_page, other.room, other.settled
        return True

    def crop(self, cutoff: Tensor) -> None:
        """Keep the residual slots and the entries of logical position below cutoff (B, 1, 1): decode
        appends sit after a head's prompt entries, in order, so what is cut is a suffix."""
        flat, stored = self.entries()  # positions only: no key or value is read (nor dequantized)
        pos = self.pos_pages.reshape(-1)[flat]
        self.lengths = (stored & ((pos < cutoff.to(pos.device)) | (pos < 0))).sum(-1)

    # --- measuring -------------------------------------------------------------------------------------

    @staticmethod
    def entry_bytes(storage, head_dim: int, element_size: int) -> int:
        """Bytes of one stored entry: its key and value as `storage` keeps them (a storage part), and its
        score, position and count."""
        return storage.entry_bytes(head_dim, element_size) + ENTRY_METADATA_BYTES

    @staticmethod
    def bound_bytes(pages: int, page_size: int, entry_bytes: int, heads: int, table_width: int) -> int:
        """Bytes of stores holding `pages` pages of entries of `entry_bytes` each (`entry_bytes`) over
        `heads` (sequence, head) rows of block tables `table_width` wide."""
        return pages * page_size * entry_bytes + heads * (table_width * 8 + HEAD_COUNTER_BYTES)

    @classmethod
    def bound(cls, storage, pages: int, page_size: int, head_dim: int, element_size: int, heads: int,
              table_width: int, spare_pages: int) -> int:
        """`bound_bytes` of stores of this class holding `pages` pages of `storage`'s entries (what serving
        reserves for a prompt before it runs)."""
        return cls.bound_bytes(pages, page_size, cls.entry_bytes(storage, head_dim, element_size), heads,
                               table_width)

    @property
    def nbytes(self) -> int:
        """Bytes the store holds: its pool of pages (allocated, used or not), block table and per-head counters."""
        return sum(getattr(self, f.name).nbytes for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), Tensor))

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (its entries' key, value, score, position and count; codes and scales)."""
        return sum(getattr(self, name)[0].nbytes for name in self.page_fields)

    def kv_bytes_held(self) -> int:
        """Key and value bytes of the pages that hold entries (every head's partly filled last page counted whole)."""
        return int(self.pages_per_head().sum()) * self.kv_page_bytes

    @property
    def kv_page_bytes(self) -> int:
        """Key and value bytes of one page (codes, scales and zero points of a quantized one)."""
        return sum(t[0].nbytes for t in self.kv())

    @property
    def kv_entry_bytes(self) -> int:
        """Key and value bytes of one entry (a per-channel page's scales shared out over its entries)."""
        return self.kv_page_bytes // self.page_size

    def kv_bytes_entries(self) -> int:
        """Key and value bytes of the stored entries alone (a per-channel page's scales shared out over its
        entries)."""
        return int(self.lengths.sum()) * self.kv_page_bytes // self.page_size

    precision: ClassVar[str] = "model_dtype"  # the name of the format the entries are stored in ("int8", "int4")

    def bytes_by_precision(self) -> dict[str, int]:
        """kv_bytes_held() under the name of its format."""
        return {self.precision: self.kv_bytes_held()}

    @property
    def kv_bytes_allocated(self) -> int:
        """Key and value bytes of the whole pool (pages in use, spare or free; codes, scales and zero points)."""
        return sum(t.nbytes for t in self.kv())

    @property
    def metadata_bytes(self) -> int:
        """Bytes of the pool's scores, positions, counts and the block table."""
        return self.score_pages.nbytes + self.pos_pages.nbytes + self.count_pages.nbytes + self.block_table.nbytes

    def growth_bytes(self, step: int) -> int:
        """Bytes the store grows by when every head appends one entry (`append`): nothing while each
        head has room in its pages; a head on a full last page without spares takes a run of `step` pages,
        from the pool's free pages or from a grown pool (`_grow`)."""
        fresh, table = self._next_append(step)
        if not fresh:
            return 0
        b, h = self.lengths.shape
        pages = self.k_pages.shape[0]
        grown = 0
        if self.next_page + fresh * step > pages:
            grown = max(fresh * step, pages // 4, b * h) * self.page_bytes
        return grown + table

    def _next_append(self, step: int) -> tuple[int, int]:
        """(heads on a full last page without spares, which each take a run of `step` pages at the next append;
        bytes the block table grows by for them)."""
        s = self.page_size
        e = self.lengths
        col = e // s
        fresh = int(((col >= self.owned) & (e % s == 0)).sum())
        if not fresh:
            return 0, 0
        b, h = e.shape
        width = int(col.max()) + step
        return fresh, max(0, width - self.block_table.shape[-1]) * b * h * self.block_table.element_size()


# --- the fused decode steps (Plan.decode_step, of kvcompile.kernels.online_step's family) ----------------------

def _layout(pages, d: int, bits: int, group: int, key_group: int | None = None) -> bool:
    """The pages have the layout the fused steps (`append_step_cpp`, `online_step_cpp`, kernels.tiered_step) write
    into in place: fp32 (P, S, d), or codes uint8 (P, S, d · bits / 8) with scales and zero points float32
    (P, S, d / group), the keys' (P, d) where key_group is 0 (per channel over a page, KIVI); the block table and
    counters int64, scores and counts float32, every tensor contiguous."""
    if not (pages.lengths.dtype == torch.long and pages.block_table.dtype == torch.long
            and pages.owned.dtype == torch.long and pages.pos_pages.dtype == torch.long
            and pages.score_pages.dtype == torch.float32 and pages.count_pages.dtype == torch.float32
            and all(t.is_contiguous() for t in pages)):
        return False
    if bits == append_kernel.FLOAT:
        return pages.k_pages.dtype == torch.float32 and pages.v_pages.dtype == torch.float32 \
            and pages.k_pages.shape[-1] == d and pages.v_pages.shape[-1] == d
    kc, vc, ks, kz, vs, vz = pages.k_pages, pages.v_pages, pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero
    width, groups = d * bits // 8, d // group
    keys = ks.shape == (kc.shape[0], d) if key_group == 0 else \
        ks.dim() == 3 and ks.shape[-1] == groups and vs.shape == ks.shape
    return (kc.dtype == torch.uint8 and vc.dtype == torch.uint8 and kc.shape[-1] == width
            and vc.shape[-1] == width and ks.dtype == torch.float32 and kz.dtype == torch.float32
            and vs.dtype == torch.float32 and vz.dtype == torch.float32 and keys and vs.dim() == 3
            and vs.shape[-1] == groups and kz.shape == ks.shape and vz.shape == vs.shape)


def check_call(pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, d: int, bits: int, group: int,
               key_group: int | None = None) -> None:
    """RuntimeError where the call is not of the layout a fused step writes into in place (the plan chose the
    step for the store's layout and the model's fp32 CPU tensors: a mismatch is a bug, not a case to skip)."""
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32 \
            or position.dtype != torch.long or q.device.type != "cpu" or not _layout(pages, d, bits, group, key_group):
        raise RuntimeError(f"kvcompile: a fused decode step (C++, fp32 CPU) got tensors of another layout: q "
                           f"{q.dtype} on {q.device}, pages {pages.k_pages.dtype} {tuple(pages.k_pages.shape)}")


def _contiguous(*xs: Tensor) -> tuple[Tensor, ...]:
    return tuple(x if x.is_contiguous() else x.contiguous() for x in xs)


def append_step_cpp(pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, scale: float, bits: int, group: int,
                    parallel_work: int = paged.PARALLEL_WORK, threads: int | None = None,
                    alpha: float | None = None) -> Tensor:
    """kernels.append_step's C++ step on a store's tensors (`PageTensors`, `QuantPageTensors` for codes): the output
    (B, Hq, d). bits: 32 (fp32 pages) or the codes' width, group: their channels per scale (the storage part's);
    alpha: the merge rule's bias α·log w of every entry in the attention (ZSMerge Eq. 8, −inf for an empty slot;
    None: no bias); parallel_work, threads: as `paged_attention_cpp.paged_attention_cpp` (one thread below
    parallel_work multiply-adds a call, else `threads`, default torch's)."""
    b, hq, d = q.shape
    h = k.shape[1]
    check_call(pages, q, k, v, position, d, bits, group)
    max_threads = torch.get_num_threads() if threads is None else threads
    runs = max(1, -(-paged.ITEMS_PER_THREAD * max_threads // (b * h)))  # bounds the runs the C++ side chooses
    work = torch.empty(b * h * runs * (hq // h) * (d + 2))
    out = torch.empty(b, hq, d)
    status = torch.empty(1, dtype=torch.long)
    bias = out if alpha is None else torch.empty(pages.count_pages.shape)
    fp32 = bits == append_kernel.FLOAT
    scales = (out, out, out, out) if fp32 else (pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero)
    append_kernel._kernel(hq // h, d, None if fp32 else group)(
        *_contiguous(q, k, v, position), pages.k_pages, scales[0], scales[1], pages.v_pages, scales[2], scales[3],
        pages.score_pages, pages.pos_pages, pages.count_pages, pages.block_table, pages.lengths, pages.owned, work,
        out, b, h, pages.block_table.shape[-1], pages.k_pages.shape[1], float(scale), max_threads,
        paged.ITEMS_PER_THREAD, parallel_work if threads is None else 0, bits, int(alpha is not None),
        _alpha(float(alpha or 0.0)), bias, pages.count_pages.shape[0], status)
    if status.item():
        raise RuntimeError("kvcompile: the fused decode step met a head without a page for its next entry (the "
                           "engine makes room before every step: LayerStore.make_room)")
    return out


def append_cpp(pages, k: Tensor, v: Tensor, position: Tensor, bits: int, group: int) -> None:
    """kernels.append_step's append alone on a store's tensors (`PageTensors`, `QuantPageTensors` for codes), in
    place: every head's new key and value (B, H, d) into its next slot (copied, or quantized as `append_step_cpp`
    quantizes), its position (B,) long, score 0, count 1, its length + 1. bits, group: as `append_step_cpp`'s."""
    b, h, d = k.shape
    if k.dtype != torch.float32 or v.dtype != torch.float32 or position.dtype != torch.long \
            or k.device.type != "cpu" or not _layout(pages, d, bits, group):
        raise RuntimeError(f"kvcompile: the C++ append (fp32 CPU) got tensors of another layout: k {k.dtype} on "
                           f"{k.device}, pages {pages.k_pages.dtype} {tuple(pages.k_pages.shape)}")
    status = torch.empty(1, dtype=torch.long)
    fp32 = bits == append_kernel.FLOAT
    scales = (k, k, k, k) if fp32 else (pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero)
    append_kernel._append_kernel(d, None if fp32 else group)(
        *_contiguous(k, v, position), pages.k_pages, scales[0], scales[1], pages.v_pages, scales[2], scales[3],
        pages.score_pages, pages.pos_pages, pages.count_pages, pages.block_table, pages.lengths, pages.owned, b, h,
        pages.block_table.shape[-1], pages.k_pages.shape[1], bits, status)
    if status.item():
        raise RuntimeError("kvcompile: the C++ append met a head without a page for its next entry (the engine "
                           "makes room before every step: LayerStore.make_room)")


@dataclass(frozen=True)
class CppAppend:
    """The store's append as one C++ call (`append_cpp`), what `LayerStore.append(..., kernel=)` runs: a batched
    decode step's write of every request's entry before its attention backend's one call (kvcompile.engine.batch;
    the plan's `CppAppendStep` fuses the two for a request alone). bits: 32 for fp32 pages, else the codes' width;
    group: their channels per scale."""

    bits: int = append_kernel.FLOAT
    group: int = 0

    @classmethod
    def of(cls, step) -> "CppAppend | None":
        """The append of the plan's decode step where it is a `CppAppendStep` with no merge bias (its store's layout,
        which the plan checked the C++ writes), else None."""
        if isinstance(step, CppAppendStep) and step.alpha is None:
            return cls(step.bits, step.group)
        return None

    def __call__(self, pages, k: Tensor, v: Tensor, position: Tensor) -> None:
        append_cpp(pages, k, v, position, self.bits, self.group)

    def build(self, head_dim: int) -> None:
        append_kernel._append_kernel(head_dim, None if self.bits == append_kernel.FLOAT else self.group)


@dataclass(frozen=True)
class CppAppendStep(DecodeStep):
    """The fused C++ step of a layer whose step is an append and an attention (`append_step_cpp`; its C++:
    kvcompile.kernels.append_step): the new entry written into its slot (fp32, or quantized), then the paged
    kernel, one call a layer and step. bits: 32 for fp32 pages, else the storage part's code width; group: its
    channels per scale; parallel_work: the paged kernel's one-thread bound; alpha: the merge bias α of α·log w
    (slots beside fp32 pages; None: no bias)."""

    name: ClassVar[str] = "cpp"
    bits: int = 8
    group: int = 0
    parallel_work: int = paged.PARALLEL_WORK
    alpha: float | None = None

    @property
    def stores(self) -> tuple[str, ...]:
        return ("LayerStore",) if self.bits == append_kernel.FLOAT else ("CodeStore",)

    def __call__(self, plan, store, layer, q, k, v, position, split, scale):
        return store.step(self.run, q, k, v, position, split, scale)

    def run(self, pages, q, k, v, position, split, scale):
        """The kernel on a store's page tensors (`PageTensors`, `QuantPageTensors`; `__call__` hands them)."""
        return append_step_cpp(pages, q, k, v, position, scale, self.bits, self.group, self.parallel_work,
                               alpha=self.alpha)

    def build(self, group: int, head_dim: int) -> None:
        append_kernel._kernel(group, head_dim, None if self.bits == append_kernel.FLOAT else self.group)

    def describe(self) -> str:
        fp32 = self.bits == append_kernel.FLOAT
        pages = "fp32 pages" if fp32 else f"quantized pages (int{self.bits}, {self.group} channels a scale)"
        if self.alpha is not None:
            pages += f", merge bias {self.alpha}·log w"
        return (f"cpp, {pages}: the new entry {'copied' if fp32 else 'quantized'} into its slot, then the paged "
                f"kernel, one call (one thread below {self.parallel_work} multiply-adds, else torch's threads)")


CppQuantStep = CppAppendStep  # the step of a store of codes (bits 8 or 4)


_NO_SPLIT = torch.zeros(1, 3, dtype=torch.long)


def online_step_cpp(pages, q: Tensor, k: Tensor, v: Tensor, position: Tensor, split: Tensor | None,
                    rule, scale: float) -> Tensor:
    """kernels.online_step's C++ step on a store's tensors: the output (B, Hq, d) (RuntimeError where a head has
    no page for its next entry, or holds more residual slots than its split allows)."""
    b, hq, d = q.shape
    h = k.shape[1]
    check_call(pages, q, k, v, position, d, append_kernel.FLOAT, 0)
    out = torch.empty(b, hq, d)
    status = torch.empty(1, dtype=torch.long)
    online_kernel._kernel(hq // h, d)(
        *_contiguous(q, k, v), position, pages.k_pages, pages.v_pages, pages.score_pages, pages.pos_pages,
        pages.count_pages, pages.block_table, pages.lengths, pages.slots, pages.owned,
        _NO_SPLIT if split is None else _contiguous(split)[0], out, b, h, pages.block_table.shape[-1],
        pages.k_pages.shape[1], float(scale), int(rule.decay is not None), float(rule.decay or 0.0),
        int(rule.gqa_max), int(rule.alpha is not None), _alpha(float(rule.alpha or 0.0)),
        int(rule.evict and split is not None), status)
    if int(status[0]) == 1:
        raise RuntimeError("kvcompile: the fused decode step met a head without a page for its next entry (the "
                           "engine makes room before every step: LayerStore.make_room)")
    if int(status[0]) == 2:
        raise RuntimeError("kvcompile: a head holds more residual slots than its ZSMerge split allows")
    return out


@dataclass(frozen=True)
class CppOnlineStep(DecodeStep):
    """The fused C++ step (`online_step_cpp`; its C++ and semantics: kvcompile.kernels.online_step) computing
    `rule` on one thread: every step of a float store whose scores run or that evicts online, or a plain step
    (append + attention) where the paged C++ kernel does not take the head dim (`CppAppendStep` otherwise)."""

    name: ClassVar[str] = "cpp"
    stores: ClassVar[tuple[str, ...]] = ("LayerStore",)
    rule: object = None  # kvcompile.plan.StepRule

    def __call__(self, plan, store, layer, q, k, v, position, split, scale):
        out = store.step(self._step, q, k, v, position, split, scale)
        if split is not None and self.rule.evict and not store.settled:  # the first step after the prompt:
            store.settle(split.sum(-1))  # every head within its budget from now on (as engine.online's)
        return out

    def _step(self, pages, q, k, v, position, split, scale):
        return online_step_cpp(pages, q, k, v, position, split, self.rule, scale)

    def build(self, group: int, head_dim: int) -> None:
        online_kernel._kernel(group, head_dim)

    def describe(self) -> str:
        return f"cpp (one thread; {self.rule})"
