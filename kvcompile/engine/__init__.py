"""The engine: what runs inside the `kvcompile.attend` op, one file per phase (docs/INTERNALS.md "The engine").

- `op`: the op, its entries (transformers' attention and mask interfaces), and the dispatch of a call to
  a phase; `state`: the declared state a prompt and a generation carry across layers and calls;
- `prefill`: a prompt in one call, or in calls the cache expects; `chunked`: a prompt the policy compresses
  chunk by chunk; `cascade`: LAVa's re-selection of lower layers; `compress`: selection, merging and the
  pages of a layer (shared by every phase that compresses);
- `decode`: append, attention and the decode schedule; `online`: ZSMerge's online eviction;
  `reconstruction`: a reconstruction scorer's forwards (KVzip);
The pages are kvcompile.store's, which the engine changes only through the stores' methods.
"""
