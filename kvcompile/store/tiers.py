"""Two precisions in one layer: each head's entries split between a high tier in the model's dtype and a
low tier of integer codes, each tier a page store of its own (kvcompile.store.pages.LayerStore for the high
tier; kvcompile.store.codes.CodeStore, or ChannelCodeStore for KIVI's keys per channel, for the low one).

The tiered storage part decides the split (kvcompile.policies.storage):
- `mixed` (MiKV): of each head's n kept tokens, the round(full · n) highest-scored in the high tier (ties
  to the later position), the rest as codes per token. Decode appends join the high tier.
- `kivi` (KIVI): each head's first L(n) tokens in position order as codes, keys per channel over groups
  of `tokens` entries (the low tier's pages are `tokens` entries long, one group a page), values per
  token; the last n − L(n) in the high tier. A decode step whose append brings a head's high tier to
  residual + tokens entries moves its oldest `tokens` into one new low page (`ChannelCodeStore.flush`):
  computed for every head on the device, applied where a head is full (no host read, fixed shapes), the
  high tier's first pages rotated to the end of the pages it owns.
- codes beside merge slots (`int8`, `int4` for a policy that merges): the slots (running means) in the high
  tier, every token as codes; decode appends join the codes.

The part says how many of a head's tokens stay in the model's dtype and in what order (`high_tokens`,
`tier_key`) and which tier a generated token joins (`new_token_tier`); the low tier's store class says what
it takes from the high tier after an append (`flush`).

Attention over a head is the attention over its two tiers, combined by their log-sum-exp
(kvcompile.kernels.paged_attention_quant.merge_partials): `TieredPagedAttention`; with a model's soft-cap and
learned sinks, `SoftcapTieredPagedAttention`.

What needs every entry of a head in one pool (running scores, online eviction, merge slots) is refused
by the plan for a tiered part; `decode: every` (mixed) rebuilds both tiers from the pruned heads.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels.backend import KernelBackend
from kvcompile.selection import HeadEntries
from kvcompile.store.codes import ChannelCodeStore, CodeStore
from kvcompile.store.pages import ENTRY_METADATA_BYTES, Entries, LayerStore

# the low tier's store class by how the part quantizes keys (Storage.key_axis)
CODE_STORES = {"token": CodeStore, "channel": ChannelCodeStore}


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
    the `storage.high_tokens(n)` tokens first by `storage.tier_key` then by position, both descending (none
    for a part that stores every token as codes; mixed: by score; KIVI: the latest positions)."""
    tokens = src.take & (src.positions >= 0)
    slots = src.take & (src.positions < 0)
    high = storage.high_tokens(tokens.sum(-1))
    return slots | (tokens & (_rank(tokens, storage.tier_key(src.scores, src.positions), src.positions)
                              < high[..., None]))


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
    low: CodeStore  # CodeStore, or ChannelCodeStore for keys per channel (KIVI)
    storage: object  # the part: tiered (policies.storage.MixedByScore, Kivi), or codes beside merge slots

    @classmethod
    def build(cls, sources: list[Entries], slots: Tensor, page_size: int, spare_pages: int = 0, gather=None,
              storage=None, dtype: torch.dtype | None = None, reserve: int | None = None) -> "TieredStore":
        """The taken rows of `sources` split by `high_tier`, each tier in a store of its own (the low one
        in pages of `storage.tokens` entries for KIVI). `slots` (B, H): the occupied merge slots, the high
        tier's first entries. `dtype`: the high tier's (the model's; re-selected rows read from codes are
        float32). Each tier gets whole spare pages a head: `spare_pages`, or the pages of `reserve` entries,
        ceil(reserve / S) (KIVI's flush moves the high tier's pages a run at a time, and `bound` counts whole
        spares)."""
        if reserve is not None:
            spare_pages = -(-reserve // page_size)
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
        codes = CODE_STORES[storage.key_axis]
        lo = codes.build([dataclasses.replace(src, take=src.take & ~high)], none,
                         codes.tier_page_size(storage, page_size), spare_pages, storage=storage.low())
        return cls(hi, lo, storage)

    @classmethod
    def bound(cls, storage, pages: int, page_size: int, head_dim: int, element_size: int, heads: int,
              table_width: int, spare_pages: int) -> int:
        """`LayerStore.bound` of two stores a layer: each head rounds each tier up once and each tier has its
        spares; counted in pages of S entries of the larger of the two entry sizes, a low page of `low` entries
        as ceil(low / S) of them (its per-page key scales, KIVI, are within its entries' bound)."""
        low = CODE_STORES[storage.key_axis].tier_page_size(storage, page_size)
        # the high tier's entries are in the model's dtype whatever the part (codes beside merge slots: int8, int4)
        entry = max(2 * head_dim * element_size + ENTRY_METADATA_BYTES,
                    math.ceil(storage.low_entry_bytes(head_dim)) + ENTRY_METADATA_BYTES)
        pages += heads * (1 + math.ceil(low / page_size) * (1 + spare_pages))
        return LayerStore.bound_bytes(pages, page_size, entry, 2 * heads, table_width)

    @classmethod
    def from_heads(cls, heads: list[list[HeadEntries]], page_size: int, spare_pages: int = 0, storage=None,
                   dtype: torch.dtype | None = None, reserve: int | None = None) -> "TieredStore":
        """A store holding every head's entries, split again into tiers (`decode: every`); whole spare pages,
        as `build`."""
        flat = LayerStore.from_heads(heads, page_size)
        k, v, scores, pos, counts, stored = flat.gather()
        return cls.build([Entries(k, v, scores, pos, counts, stored)], flat.slots, page_size, spare_pages,
                         storage=storage, dtype=dtype, reserve=reserve)

    def rows(self, index: Tensor, spare_pages: int) -> "TieredStore":
        """Row i a copy of row index[i] (beam search), each tier kept as it is."""
        return TieredStore(self.high.rows(index, spare_pages), self.low.rows(index, spare_pages), self.storage)

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
        """Appends (decode steps) the store takes with no host read: its appending tier's room, and the steps
        the low tier's owned pages cover for its flushes (KIVI's `flush_room`)."""
        return min(self._appending.room, self.low.flush_room)

    @property
    def _appending(self) -> LayerStore:
        """The tier a decode step's entry joins (the part's `new_token_tier`)."""
        return getattr(self, self.storage.new_token_tier)

    def state_tensors(self) -> list[Tensor]:
        return self.high.state_tensors() + self.low.state_tensors()

    def replayed(self, tokens: int) -> None:
        """The host bookkeeping of `tokens` appends that ran as a replayed graph (`append`, the low tier's `flush`)."""
        self._appending.replayed(tokens)
        self.low.flushed(tokens)

    settled = False  # tiered parts have no online eviction
    step = LayerStore.step  # a fused step over both tiers' tensors (kernels.tiered_step)

    def make_room(self, step: int) -> bool:
        """Before a decode step, where `room` is spent: `LayerStore.make_room` of the appending tier and the pages
        of the low tier's flush (`reserve_flush`). True where it ran (the host read of `append`)."""
        if self.room > 0:
            return False
        self._appending.make_room(step)
        self.low.reserve_flush(step)
        return True

    version = property(lambda self: (self.high.version, self.low.version))  # its pooled tiers' (store.pool)

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
        """Both tiers' tensors, the high tier's `PageTensors` first (what kernels.tiered_step updates in place)."""
        return tuple(self.high.tensors()) + tuple(self.low.tensors())

    # --- changing --------------------------------------------------------------------------------------

    def append(self, k: Tensor, v: Tensor, positions: Tensor, step: int = 1, kernel=None) -> None:
        """Append one entry per head: to the high tier for a tiered part (KIVI then moves a full group to the
        low tier), as codes for a part that stores every token so (its merge slots alone are floats); `kernel`:
        the appending tier's (`LayerStore.append`)."""
        self._appending.append(k, v, positions, step, kernel)
        self.low.flush(self.high, step)

    def refill(self, other: "TieredStore") -> bool:
        """Not in place: a pruned tiered layer takes new tensors (a captured decode step records again)."""
        return False

    def crop(self, cutoff: Tensor) -> None:
        """Keep the entries of logical position below cutoff (B, 1, 1), in both tiers (KIVI's groups are fixed
        by a head's count: a crop that would remove an entry is refused, `ChannelCodeStore.crop_tiers`)."""
        self.low.crop_tiers(self.high, cutoff)

    # --- attention -------------------------------------------------------------------------------------

    def attend(self, backend, q: Tensor, merge_bias, scale: float) -> Tensor:
        """Decode attention over both tiers (`TieredPagedAttention`); `merge_bias(count_pages)`: the merge
        rule's logit bias pages (slots live in the high tier; a token's bias is 0)."""
        return backend(q, self, merge_bias(self.high.count_pages), scale)

    # --- measuring -------------------------------------------------------------------------------------

    # each the sum of the tiers'
    nbytes = property(lambda self: self.high.nbytes + self.low.nbytes)
    kv_bytes_allocated = property(lambda self: self.high.kv_bytes_allocated + self.low.kv_bytes_allocated)
    metadata_bytes = property(lambda self: self.high.metadata_bytes + self.low.metadata_bytes)

    def kv_bytes_held(self) -> int:
        return self.high.kv_bytes_held() + self.low.kv_bytes_held()

    def kv_bytes_entries(self) -> int:
        return self.high.kv_bytes_entries() + self.low.kv_bytes_entries()

    def bytes_by_precision(self) -> dict[str, int]:
        out = Counter(self.high.bytes_by_precision())
        out.update(self.low.bytes_by_precision())
        return dict(out)

    def growth_bytes(self, step: int) -> int:
        """Bytes one append can add: the appending tier's (the codes' where every token is codes, beside merge
        slots), and for KIVI a run of low pages where a flush may need them."""
        return self._appending.growth_bytes(step) + self.low.flush_bytes(step)


@dataclass(frozen=True)
class TieredPagedAttention(KernelBackend):
    """Decode attention over a TieredStore: the high tier by the eager float kernel with its log-sum-exp,
    the low tier by a quantized-pages backend (kvcompile.kernels.paged_attention_quant) with its own,
    combined by `merge_partials` (the attention over the union of the two sets of entries); with a model's
    soft-cap and learned sinks, `SoftcapTieredPagedAttention`."""

    low: KernelBackend  # a QuantPagedAttention backend
    high_cpp: bool = False  # the float tier by the paged C++ kernel (with its log-sum-exp), else the eager torch
    softcap: float = 0.0  # the model's logit soft-cap, in the eager float tier (and in `low`'s); 0: none
    sinks: Tensor | None = None  # (Hq,) one layer's learned sinks, once over both tiers, else None
    name: ClassVar[str] = "tiered"

    def build(self, group: int, head_dim: int) -> None:
        self.low.build(group, head_dim)

    def __call__(self, q: Tensor, store: TieredStore, bias: Tensor | None, scale: float) -> Tensor:
        from kvcompile.kernels.paged_attention import _gathered, with_sinks
        from kvcompile.kernels.paged_attention_quant import merge_partials

        hi, lo = store.high, store.low
        if self.high_cpp:
            from kvcompile.kernels.paged_attention_cpp import paged_attention_cpp

            out_h, lse_h = paged_attention_cpp(q, hi.k_pages, hi.v_pages, hi.block_table, hi.lengths, bias, scale,
                                               return_lse=True)
        else:  # the logits soft-capped before the merge bias of the slots
            out_h, lse_h = _gathered(q, hi.k_pages, hi.v_pages, hi.block_table, hi.lengths, bias, scale,
                                     return_lse=True, softcap=self.softcap)
        out_l, lse_l = self.low(q, *lo.kv(), lo.block_table, lo.lengths, None, scale, return_lse=True)
        out = merge_partials(out_h, lse_h, out_l, lse_l)
        if self.sinks is not None:
            out = with_sinks(out, torch.logaddexp(lse_h, lse_l), self.sinks)
        return out.to(q.dtype)

    def describe(self) -> str:
        return f"model dtype: {'cpp' if self.high_cpp else 'torch'} (with log-sum-exp); codes: {self.low.describe()}"


@dataclass(frozen=True, eq=False)
class SoftcapTieredPagedAttention(TieredPagedAttention):
    """Decode attention over a TieredStore for a model that soft-caps its logits (Gemma 2) or has learned sinks
    (gpt-oss), in eager torch: each tier's attention with the cap (the merge bias of the high tier's slots added
    after it; `low` a kernels.paged_attention_quant.SoftcapQuantPagedAttention of the same cap) and its
    log-sum-exp, combined by `merge_partials`, then the sinks once over the union (the output scaled by
    sigmoid(lse − sink), lse the log-sum-exp over both tiers). `with_sinks` gives a layer's."""

    def with_sinks(self, sinks: Tensor | None) -> "SoftcapTieredPagedAttention":
        return dataclasses.replace(self, sinks=sinks)

    def describe(self) -> str:
        return f"torch, both tiers (eager{f', logits soft-capped at {self.softcap:g}' if self.softcap else ''}" \
               f"{', learned sinks' if self.sinks is not None else ''})"
