"""The page store: one owner of the KV pages below the engine (docs/INTERNALS.md "Paged cache layout").

- `pages`: the page layout (`Entries`, `page_table`, `PageTensors`) and `LayerStore`, a layer's pages in the
  model's dtype, the class every store builds on;
- `codes`: `CodeStore` (int8 / int4 codes per entry) and `ChannelCodeStore` (KIVI's keys per channel);
- `tiers`: `TieredStore`, two stores per layer (a float tier and a tier of codes), and its attention.
- `pool`: `PagePool`, one layer's pages of one layout shared by every request of a serving engine, its allocator,
  and the `Pooled` mixin that puts a store class in it (`PooledStore`, `PooledCodeStore`,
  `PooledChannelCodeStore`; a TieredStore tier by tier); `PagePools`: an engine's pools, per layer one per page
  layout, and the batched append and attention.

The plan names a layer's store class once (`Plan.store`, `store_class`); the engine builds stores with it and
changes them only through their methods: nothing outside this package writes a store's fields or into its
tensors (tests/test_store_ownership.py).
"""
from kvcompile.store.codes import ChannelCodeStore, CodeStore, QuantPageTensors
from kvcompile.store.pages import ENTRY_METADATA_BYTES, Entries, LayerStore, PageTensors, page_table
from kvcompile.store.tiers import SoftcapTieredPagedAttention, TieredPagedAttention, TieredStore

__all__ = ["ENTRY_METADATA_BYTES", "ChannelCodeStore", "CodeStore", "Entries", "LayerStore", "PageTensors",
           "QuantPageTensors", "SoftcapTieredPagedAttention", "TieredPagedAttention", "TieredStore", "page_table",
           "store_class"]


def store_class(policy) -> type:
    """The store class of a policy's layers (chosen once, by the plan): `TieredStore` where its entries take
    two precisions (Policy.tiered: a tiered part, or codes beside merge slots), a store of codes where its part
    quantizes, else `LayerStore` (the model's dtype)."""
    if policy.tiered:
        return TieredStore
    return CodeStore if policy.storage.quantizes else LayerStore
