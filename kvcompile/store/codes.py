"""Stores of integer codes (a storage part that quantizes; the formula: kvcompile.kernels.quantize): the
float store's layout and methods, with `k_pages`, `v_pages` holding uint8 codes (P, S, d · bits / 8) and
float32 scales and zero points beside them. Only how keys and values are written and read differs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from kvcompile.store.pages import PAGE_FIELDS, LayerStore, PageTensors, _rows

QUANT_FIELDS = ("k_scale", "k_zero", "v_scale", "v_zero")  # a store of codes' pages besides the codes


# A store of codes' tensors (`PageTensors`, k_pages and v_pages holding codes, then the scales and zero points),
# what the fused step of a quantized store takes (kvcompile.kernels.append_step)
QuantPageTensors = NamedTuple("QuantPageTensors", [(name, Tensor) for name in PageTensors._fields + QUANT_FIELDS])


@dataclass
class CodeStore(LayerStore):
    """One layer's entries as codes of `storage` (int8, int4; a tiered part's low tier), keys and values per
    entry and group of channels."""

    page_fields: ClassVar[tuple[str, ...]] = PAGE_FIELDS + QUANT_FIELDS
    pool_fields: ClassVar[tuple[str, ...]] = PAGE_FIELDS + QUANT_FIELDS
    # (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero): what kernels.paged_attention_quant reads (`kv`)
    kv_fields: ClassVar[tuple[str, ...]] = ("k_pages", "k_scale", "k_zero", "v_pages", "v_scale", "v_zero")
    flush_room: ClassVar[int] = 1 << 62  # a tier of codes per entry takes nothing from the float tier (`flush`)
    key_axis: ClassVar[str] = "token"  # keys quantized per entry; "channel": each channel over a page
    k_scale: Tensor = None  # (P, S, d / group) float32
    k_zero: Tensor = None
    v_scale: Tensor = None
    v_zero: Tensor = None

    @classmethod
    def build(cls, sources, slots: Tensor, page_size: int, spare_pages: int = 0, gather=None, storage=None,
              dtype: torch.dtype | None = None, reserve: int | None = None) -> "CodeStore":
        """The float store's `build` (the plain row write; its layout, `spare_pages` and `reserve`), then every
        page quantized with the part's bits:
        values per entry, keys per entry or, for `key_axis` "channel", each channel over the page's entries
        (KIVI: the caller fills every page it quantizes so; an empty slot of a per-entry page is quantized
        alone and never read). `gather` and `dtype` do not apply: the codes are written by the quantizer."""
        from kvcompile.kernels.quantize import quantize

        floats = LayerStore.build(sources, slots, page_size, spare_pages, reserve=reserve)
        # channels per key scale (None: one scale per channel over a page)
        key_group = None if cls.key_axis == "channel" else storage.group_size(floats.k_pages.shape[-1])
        k = quantize(floats.k_pages, storage.bits, key_group, cls.key_axis)
        v = quantize(floats.v_pages, storage.bits, storage.group_size(floats.v_pages.shape[-1]))
        fields = {f.name: getattr(floats, f.name) for f in dataclasses.fields(LayerStore)}
        store = cls(**{**fields, "storage": storage, "k_pages": k.codes, "k_scale": k.scale, "k_zero": k.zero,
                       "v_pages": v.codes, "v_scale": v.scale, "v_zero": v.zero})
        store._count_flush_room()
        return store

    @property
    def precision(self) -> str:
        return f"int{self.storage.bits}"

    def _write_kv(self, page: Tensor, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Quantize each head's new key and value into its slot (no host read)."""
        from kvcompile.kernels.quantize import quantize_pair_into_pages

        quantize_pair_into_pages(k, v, (self.k_pages, self.k_scale, self.k_zero),
                                 (self.v_pages, self.v_scale, self.v_zero), page, slot, self.storage.bits)

    def _key_rows(self, flat: Tensor) -> Tensor:
        from kvcompile.kernels.quantize import dequantize

        return dequantize(_rows(self.k_pages, flat), _rows(self.k_scale, flat), _rows(self.k_zero, flat),
                          self.storage.bits)

    def kv_rows(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """x̂ = code · scale + zero (float32) of the keys and values at entries `flat`."""
        from kvcompile.kernels.quantize import dequantize

        values = dequantize(_rows(self.v_pages, flat), _rows(self.v_scale, flat), _rows(self.v_zero, flat),
                            self.storage.bits)
        return self._key_rows(flat), values

    def tensors(self) -> QuantPageTensors:
        return QuantPageTensors(*(getattr(self, name) for name in QuantPageTensors._fields))

    # --- as the low tier of a TieredStore ----------------------------------------------------------------

    @classmethod
    def tier_page_size(cls, storage, page_size: int) -> int:
        """Entries a page of this tier holds, beside float pages of `page_size`."""
        return page_size

    def _count_flush_room(self) -> None:
        """Codes per entry take nothing after they are built."""

    def flush(self, high: LayerStore, step: int) -> None:
        """What this tier takes from the float tier `high` after an append there: nothing (entries are split
        between the tiers when a layer is built)."""

    def reserve_flush(self, step: int) -> None:
        """Before a decode step (`TieredStore.make_room`): pages for the flush after its append; none here."""

    def flushed(self, tokens: int) -> None:
        """The host bookkeeping of `tokens` flushes that ran as a replayed graph."""

    def flush_bytes(self, step: int) -> int:
        """Bytes a flush after one append can add."""
        return 0

    def crop_tiers(self, high: LayerStore, cutoff: Tensor) -> None:
        """`crop` of both tiers (this one and the float tier `high`)."""
        high.crop(cutoff)
        self.crop(cutoff)


@dataclass
class ChannelCodeStore(CodeStore):
    """KIVI's codes (the low tier of a TieredStore for storage `kivi`): keys quantized per channel over each
    page of `storage.tokens` entries (`k_scale`, `k_zero` (P, d): one scale a page and channel), values per
    entry. A page is written whole: a group of the float tier's oldest entries at a time (`flush`); an
    entry neither moves nor is appended alone."""

    page_fields: ClassVar[tuple[str, ...]] = PAGE_FIELDS + ("v_scale", "v_zero")
    key_axis: ClassVar[str] = "channel"
    flush_room: int = 0  # on the host: decode steps whose flushes the pages this tier owns take

    @classmethod
    def tier_page_size(cls, storage, page_size: int) -> int:
        return storage.tokens

    def _write_kv(self, page: Tensor, slot: Tensor, k: Tensor, v: Tensor) -> None:
        raise RuntimeError("kvcompile: pages of keys per channel take whole pages (store.tiers), not single entries")

    def _movable(self) -> None:
        raise RuntimeError("kvcompile: an entry of a page of keys per channel cannot move alone: the page's scales "
                           "hold for all its entries")

    def _key_rows(self, flat: Tensor) -> Tensor:
        from kvcompile.kernels.quantize import dequantize

        page = flat // self.page_size  # a scale and zero per page and channel: x̂_c = code_c · s_c + z_c
        return dequantize(_rows(self.k_pages, flat), self.k_scale[page], self.k_zero[page], self.storage.bits)

    def flush(self, high: LayerStore, step: int) -> None:
        """Every head whose float tier holds residual + tokens entries moves its oldest `tokens` (its first
        pages: the float tier is filled from a page start and flushed a page run at a time) into one new page
        here, quantized (keys per channel, values per entry); the float tier's first pages go to the end of
        the run it owns (`rotate_out`). Computed for every head, applied where a head is full: no host read. On
        a batched step's requests as one store (kvcompile.store.pool.Batch), one op for all their heads."""
        from kvcompile.kernels.quantize import quantize_pages_into

        part = self.storage
        g, s = part.tokens, high.page_size
        cols = g // s
        self.reserve_flush(step)
        self.flush_room -= 1
        full = high.lengths >= part.flushes_after + g  # (B, H)
        b, h = full.shape
        table = high.block_table  # a head that flushes owns `cols` pages at least; a narrower table holds none
        if table.shape[-1] < cols:
            table = torch.nn.functional.pad(table, (0, cols - table.shape[-1]))
        first = table[..., :cols]  # (B, H, cols): the oldest `tokens` entries
        page = self.block_table.gather(-1, (self.lengths // g)[..., None]).reshape(-1)  # owned (flush_room)
        quantize_pages_into(high.k_pages[first].reshape(b * h, g, -1), self.k_pages, self.k_scale, self.k_zero,
                            page, part.bits, "channel")
        quantize_pages_into(high.v_pages[first].reshape(b * h, g, -1), self.v_pages, self.v_scale, self.v_zero,
                            page, part.bits, "token")
        for name in ("score_pages", "pos_pages", "count_pages"):
            getattr(self, name)[page] = getattr(high, name)[first].reshape(b * h, g)
        self.lengths.add_(full.long() * g)
        high.rotate_out(full, cols)

    def _count_flush_room(self) -> None:
        """Flushes every head's owned pages take, as decode steps (one host read)."""
        spare = int((self.owned - self.lengths // self.page_size).min()) if self.owned.numel() else 0
        # a head flushes at most once every `tokens` steps; every step writes (for every head) into the page
        # at column lengths // tokens, so that page must be owned at every step: `spare` ≥ 1 pages cover
        # the next (spare − 1) flushes, whenever they come, hence (spare − 1) · tokens + 1 steps
        self.flush_room = max(0, (spare - 1) * self.page_size + 1)

    def reserve_flush(self, step: int) -> None:
        """Where the pages this tier owns cover no more flushes (`flush_room`), give every head a run of `step` + 1
        pages past its last group where it has fewer (one host read: Plan.host_syncs "page allocation")."""
        if self.flush_room > 0:
            return
        self.ensure_pages(self.lengths // self.page_size + 1, step + 1)
        self._count_flush_room()

    def flushed(self, tokens: int) -> None:
        self.flush_room -= tokens

    def flush_bytes(self, step: int) -> int:
        """A run of pages for every head where a flush may need them."""
        if self.flush_room > 1:
            return 0
        b, h = self.lengths.shape
        return (step + 1) * b * h * self.page_bytes

    def crop_tiers(self, high: LayerStore, cutoff: Tensor) -> None:
        """KIVI's groups are fixed by a head's count: a crop that would remove an entry is refused (nothing
        changes)."""
        for tier in (high, self):
            flat, stored = tier.entries()
            if bool((stored & (tier.pos_pages.reshape(-1)[flat] >= cutoff.to(flat.device))).any()):
                raise NotImplementedError("kvcompile: storage: kivi: crop() would remove entries, and KIVI's "
                                          "quantized groups are fixed by each head's count")
