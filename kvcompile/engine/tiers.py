"""Two precisions in one layer: each head's entries split between a high tier in the model's dtype and a
low tier of integer codes, each tier a page store of its own (kvcompile.engine.pages.LayerStore).

The tiered storage part decides the split (kvcompile.policies.storage):
- `mixed` (MiKV): of each head's n kept tokens, the round(full · n) highest-scored in the high tier (ties
  to the later position), the rest as codes per token. Decode appends join the high tier.
- `kivi` (KIVI): each head's first L(n) tokens in position order as codes, keys per channel over groups
  of `tokens` entries (the low tier's pages are `tokens` entries long, one group a page), values per
  token; the last n − L(n) in the high tier. A decode step whose append brings a head's high tier to
  residual + tokens entries moves its oldest `tokens` into one new low page ("flush"): computed for every
  head on the device, applied where a head is full (no host read, fixed shapes), the high tier's first
  pages rotated to the end of the pages it owns.

Attention over a head is the attention over its two tiers, combined by their log-sum-exp
(kvcompile.kernels.paged_attention_quant.merge_partials): `TieredPagedAttention`.

What needs every entry of a head in one pool (running scores, online eviction, merge slots) is refused
by the plan for a tiered part; `decode: every` (mixed) rebuilds both tiers from the pruned heads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.engine.pages import Entries, LayerStore
from kvcompile.kernels.backend import KernelBackend
from kvcompile.selection import HeadEntries


def _cat(sources: list[Entries]) -> Entries:
    """One candidate set of several sources, side by side along the entries."""
    if len(sources) == 1:
        return sources[0]
    return Entries(*(torch.cat([getattr(s, f.name) for s in sources], dim=2) for f in dataclasses.fields(Entries)))


def _rank(take: Tensor, primary: Tensor, secondary: Tensor) -> Tensor:
    """(B, H, E) rank of every candidate: taken ones first, by `primary` then `secondary`, both descending."""
    order = torch.argsort(secondary, dim=-1, descending=True, stable=True)
    order = order.gather(-1, torch.argsort(primary.gather(-1, order), dim=-1, descending=True, stable=True))
    order = order.gather(-1, torch.argsort(take.gather(-1, order).to(torch.int8), dim=-1, descending=True,
                                           stable=True))
    rank = torch.empty_like(order)
    return rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))


def high_tier(storage, src: Entries) -> Tensor:
    """(B, H, E) bool: the taken candidates kept in the model's dtype: merge slots (their running means), and
    the tokens the tiered part chooses (none for a part that stores every token as codes)."""
    tokens = src.take & (src.positions >= 0)
    slots = src.take & (src.positions < 0)
    if not storage.tiered:
        return slots
    n = tokens.sum(-1)
    if storage.key_axis == "channel":  # KIVI: the n − L(n) latest positions
        r, g = storage.residual, storage.tokens
        low = torch.where(n < r, 0, g * torch.div(n - r, g, rounding_mode="floor"))
        return slots | (tokens & (_rank(tokens, src.positions, src.positions) < (n - low)[..., None]))
    high = torch.round(n.double() * storage.full).long()  # round(full · n), half to even, as the part says
    return slots | (tokens & (_rank(tokens, src.scores.float(), src.positions) < high[..., None]))


def _entry_order(positions: Tensor, stored: Tensor) -> Tensor:
    """(B, H, E) the order of a head's entries as one store holds them: merge slots in slot order (position
    −1 − r), then tokens in position order, then what is not stored."""
    big = torch.iinfo(torch.long).max
    key = torch.where(positions < 0, -big + (-1 - positions), positions)
    return torch.argsort(torch.where(stored, key, big), dim=-1, stable=True)


@dataclass
class TieredStore:
    """One layer's entries in two page stores: `high` in the model's dtype, `low` as codes."""

    high: LayerStore
    low: LayerStore
    storage: object  # the tiered part (policies.storage.MixedByScore or Kivi)
    flush_room: int = 0  # KIVI, on the host: decode steps whose flushes the low tier's owned pages take

    @classmethod
    def build(cls, sources: list[Entries], slots: Tensor, page_size: int, spare_pages: int, gather=None,
              storage=None, dtype: torch.dtype | None = None) -> "TieredStore":
        """The taken rows of `sources` split by `high_tier`, each tier in a store of its own (the low one
        in pages of `storage.tokens` entries for KIVI). `slots` (B, H): the occupied merge slots, the high
        tier's first entries. `dtype`: the high tier's (the model's; re-selected rows read from codes are
        float32)."""
        src = _cat(sources)
        # one order for every head: slots, then tokens by position (KIVI's groups: consecutive tokens)
        order = _entry_order(src.positions, src.take)
        src = Entries(*(getattr(src, f.name).gather(2, order if getattr(src, f.name).dim() == 3 else
                                                    order[..., None].expand_as(getattr(src, f.name)))
                        for f in dataclasses.fields(Entries)))
        high = high_tier(storage, src)
        kw = {} if gather is None else {"gather": gather}
        none = torch.zeros_like(slots)
        hi = LayerStore.build([dataclasses.replace(src, take=high)], slots, page_size, spare_pages, dtype=dtype, **kw)
        low_page = storage.tokens if storage.key_axis == "channel" else page_size
        lo = LayerStore.build([dataclasses.replace(src, take=src.take & ~high)], none, low_page, spare_pages,
                              storage=storage.low())
        store = cls(hi, lo, storage)
        store._count_flush_room()
        return store

    @classmethod
    def from_heads(cls, heads: list[list[HeadEntries]], page_size: int, spare_pages: int, storage=None,
                   dtype: torch.dtype | None = None) -> "TieredStore":
        """A store holding every head's entries, split again into tiers (`decode: every`)."""
        flat = LayerStore.from_heads(heads, page_size, spare_pages)
        k, v, scores, pos, counts, stored = flat.gather()
        return cls.build([Entries(k, v, scores, pos, counts, stored)], flat.slots, page_size, spare_pages,
                         storage=storage, dtype=dtype)

    def rows(self, index: Tensor, spare_pages: int) -> "TieredStore":
        """Row i a copy of row index[i] (beam search), each tier kept as it is."""
        store = TieredStore(self.high.rows(index, spare_pages), self.low.rows(index, spare_pages), self.storage)
        store._count_flush_room()
        return store

    def writable(self) -> None:
        self.high.writable()
        self.low.writable()

    # --- reading ---------------------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self.high.page_size

    @property
    def lengths(self) -> Tensor:
        """(B, H) entries per head, both tiers."""
        return self.high.lengths + self.low.lengths

    @property
    def slots(self) -> Tensor:
        return self.high.slots

    @property
    def room(self) -> int:
        """Appends (decode steps) the store takes with no host read: its appending tier's room, and for KIVI
        the steps its low tier's owned pages cover (`flush_room`)."""
        room = self._appending.room
        return min(room, self.flush_room) if self.storage.key_axis == "channel" else room

    @property
    def _appending(self) -> LayerStore:
        return self.high if self.storage.tiered else self.low

    def state_tensors(self) -> list[Tensor]:
        return self.high.state_tensors() + self.low.state_tensors()

    def replayed(self, tokens: int) -> None:
        """The host bookkeeping of `tokens` appends that ran as a replayed graph (`append`, `_flush`)."""
        self._appending.replayed(tokens)
        if self.storage.key_axis == "channel":
            self.flush_room -= tokens

    settled = False  # tiered parts have no online eviction

    def pages_per_head(self) -> Tensor:
        return self.high.pages_per_head() + self.low.pages_per_head()

    def gather(self):
        """Both tiers' entries as LayerStore.gather gives them (B, H, E, ·): each head's merge slots in slot
        order, then its tokens in position order (what a chunk's candidates and the cascade read), padded."""
        parts = [torch.cat([a, b], dim=2) for a, b in zip(self.low.gather(), self.high.gather())]
        order = _entry_order(parts[3], parts[5])
        return tuple(x.gather(2, order[..., None].expand_as(x) if x.dim() == 4 else order) for x in parts)

    def to_heads(self) -> list[list[HeadEntries]]:
        low, high = self.low.to_heads(), self.high.to_heads()
        return [[HeadEntries(*(torch.cat([getattr(a, f.name), getattr(b, f.name)])
                               for f in dataclasses.fields(HeadEntries)))
                 for a, b in zip(row_a, row_b)] for row_a, row_b in zip(low, high)]

    @property
    def device(self) -> torch.device:
        return self.high.device

    def tensors(self) -> tuple[Tensor, ...]:
        """Both tiers' tensors (no fused kernel takes a tiered store: the plan runs its Python path)."""
        return tuple(self.high.tensors()) + tuple(self.low.tensors())

    # --- changing --------------------------------------------------------------------------------------

    def append(self, k: Tensor, v: Tensor, positions: Tensor, step: int = 1) -> None:
        """Append one entry per head: to the high tier for a tiered part (KIVI then moves a full group to the
        low tier), as codes for a part that stores every token so (its merge slots alone are floats)."""
        self._appending.append(k, v, positions, step)
        if self.storage.key_axis == "channel":
            self._flush(step)

    def _flush(self, step: int) -> None:
        """KIVI: every head whose high tier holds residual + tokens entries moves its oldest `tokens` (its
        first pages: the high tier is filled from a page start and flushed a page run at a time) into one
        new low page, quantized (keys per channel, values per token); the high tier's first pages go to the
        end of the run it owns. Computed for every head, applied where a head is full: no host read."""
        from kvcompile.kernels.quantize import quantize_pages_into

        hi, lo, part = self.high, self.low, self.storage
        g, s = part.tokens, hi.page_size
        cols = g // s
        if self.flush_room <= 0:
            self._reserve_low(step)
        self.flush_room -= 1
        full = hi.lengths >= part.residual + g  # (B, H)
        b, h = full.shape
        table = hi.block_table  # a head that flushes owns `cols` pages at least; a narrower table holds none
        if table.shape[-1] < cols:
            table = torch.nn.functional.pad(table, (0, cols - table.shape[-1]))
        first = table[..., :cols]  # (B, H, cols): the oldest `tokens` entries
        k = hi.k_pages[first].reshape(b * h, g, -1)
        v = hi.v_pages[first].reshape(b * h, g, -1)
        page = lo.block_table.gather(-1, (lo.lengths // g)[..., None]).reshape(-1)  # owned (flush_room)
        quantize_pages_into(k, lo.k_pages, lo.k_scale, lo.k_zero, page, part.bits, "channel")
        quantize_pages_into(v, lo.v_pages, lo.v_scale, lo.v_zero, page, part.bits, "token")
        for name in ("score_pages", "pos_pages", "count_pages"):
            getattr(lo, name)[page] = getattr(hi, name)[first].reshape(b * h, g)
        lo.lengths.add_(full.long() * g)
        j = torch.arange(hi.block_table.shape[-1], device=full.device)
        owned = hi.owned[..., None]
        rotated = hi.block_table.gather(-1, torch.where(j < owned, (j + cols) % owned.clamp(min=1), j))
        hi.block_table.copy_(torch.where(full[..., None], rotated, hi.block_table))
        hi.lengths.sub_(full.long() * g)

    def _count_flush_room(self) -> None:
        """Flushes every head's owned low pages take, as decode steps (one host read; KIVI only)."""
        if self.storage.key_axis != "channel":
            return
        lo = self.low
        spare = int((lo.owned - lo.lengths // self.storage.tokens).min()) if lo.owned.numel() else 0
        # a head flushes at most once every `tokens` steps; every step writes (for every head) into the page
        # at column lengths // tokens, so that page must be owned at every step: `spare` ≥ 1 pages cover
        # the next (spare − 1) flushes, whenever they come, hence (spare − 1) · tokens + 1 steps
        self.flush_room = max(0, (spare - 1) * self.storage.tokens + 1)

    def _reserve_low(self, step: int) -> None:
        """Give every head of the low tier a run of `step` + 1 pages past its last group where it has fewer
        (one host read: Plan.host_syncs "page allocation")."""
        lo = self.low
        col = lo.lengths // self.storage.tokens
        lo.ensure_pages(col + 1, step + 1)
        self._count_flush_room()

    def refill(self, other: "TieredStore") -> bool:
        """Not in place: a pruned tiered layer takes new tensors (a captured decode step records again)."""
        return False

    def crop(self, cutoff: Tensor) -> None:
        """Keep the entries of logical position below cutoff (B, 1, 1), in both tiers. KIVI's groups are fixed
        by a head's count: a crop that would remove an entry is refused."""
        if self.storage.key_axis == "channel":
            _, _, _, pos, _, stored = self.gather()
            if bool((stored & (pos >= cutoff.to(pos.device))).any()):
                raise NotImplementedError("kvcompile: storage: kivi: crop() would remove entries, and KIVI's "
                                          "quantized groups are fixed by each head's count")
            return
        self.high.crop(cutoff)
        self.low.crop(cutoff)

    # --- attention -------------------------------------------------------------------------------------

    def attend(self, backend, q: Tensor, merge_bias, scale: float) -> Tensor:
        """Decode attention over both tiers (`TieredPagedAttention`); `merge_bias(count_pages)`: the merge
        rule's logit bias pages (slots live in the high tier; a token's bias is 0)."""
        return backend(q, self, merge_bias(self.high.count_pages), scale)

    # --- measuring -------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.high.nbytes + self.low.nbytes

    def kv_bytes_held(self) -> int:
        return self.high.kv_bytes_held() + self.low.kv_bytes_held()

    def kv_bytes_entries(self) -> int:
        return self.high.kv_bytes_entries() + self.low.kv_bytes_entries()

    def bytes_by_precision(self) -> dict[str, int]:
        out = dict(self.high.bytes_by_precision())
        for name, n in self.low.bytes_by_precision().items():
            out[name] = out.get(name, 0) + n
        return out

    @property
    def kv_bytes_allocated(self) -> int:
        return self.high.kv_bytes_allocated + self.low.kv_bytes_allocated

    @property
    def metadata_bytes(self) -> int:
        return self.high.metadata_bytes + self.low.metadata_bytes

    def growth_bytes(self, step: int) -> int:
        """Bytes one append can add: the high tier's, and for KIVI a run of low pages where a flush may need
        them."""
        extra = 0
        if self.storage.key_axis == "channel" and self.flush_room <= 1:
            b, h = self.low.lengths.shape
            extra = (step + 1) * b * h * self.low.page_bytes
        return self.high.growth_bytes(step) + extra


@dataclass(frozen=True)
class TieredPagedAttention(KernelBackend):
    """Decode attention over a TieredStore: the high tier by the eager float kernel with its log-sum-exp,
    the low tier by a quantized-pages backend (kvcompile.kernels.paged_attention_quant) with its own,
    combined by `merge_partials` (the attention over the union of the two sets of entries)."""

    low: KernelBackend  # a QuantPagedAttention backend
    name: ClassVar[str] = "tiered"

    def build(self, group: int, head_dim: int) -> None:
        self.low.build(group, head_dim)

    def __call__(self, q: Tensor, store: TieredStore, bias: Tensor | None, scale: float) -> Tensor:
        from kvcompile.kernels.paged_attention_quant import merge_partials, paged_attention_lse_torch

        hi, lo = store.high, store.low
        out_h, lse_h = paged_attention_lse_torch(q, hi.k_pages, hi.v_pages, hi.block_table, hi.lengths, scale,
                                                 bias)
        out_l, lse_l = self.low(q, *lo.kv(), lo.block_table, lo.lengths, None, scale, return_lse=True)
        return merge_partials(out_h, lse_h, out_l, lse_l).to(q.dtype)

    def describe(self) -> str:
        return f"model dtype: torch (with log-sum-exp); codes: {self.low.describe()}"


def store_type(policy):
    """The page store class of a policy's layers: TieredStore where its entries take two precisions
    (Policy.tiered), else LayerStore."""
    return TieredStore if policy.tiered else LayerStore
