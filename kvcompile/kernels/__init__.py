"""kvcompile.kernels: each kernel a Triton version beside a torch lowering.

- `paged_attention`: decode attention over the paged cache (flash-decoding); its CPU
  kernel in C++ is `paged_attention_cpp`.
- `window_scores`: fused window scoring of one layer (SnapKV / LAVa).
- `merge`: the ZSMerge residual merge update.
- `select`: prefill selection (top-k per head, pooled top-k, DBudgetKV threshold) and
  the gather of the kept rows into pages.
- `online_step`: the decode step's backend family (the plan's `online_step`) and its fused C++ step of
  running scores and online eviction; `append_step`, `tiered_step`: the fused decode step of fp32 pages or a
  store of int8 / int4 codes, and of a two-tier store (C++, over the paged kernel); the first two are called
  on a store's tensors by the store (kvcompile.store.pages `CppOnlineStep`, `CppAppendStep`);
  `attention_column_sums`: the prompt's attention
  with its weighted column sums (C++); `chunk_attention`: a chunk's attention over the held
  entries and itself (a chunked prompt).
- `choice`: `resolve`, which implementation of each of these runs (the `impl=` names,
  their defaults per device and dtype, and the errors for names that cannot run).

Each module defines its backends, one class per implementation with one call signature
(`TritonPagedAttention`, `CppPagedAttention`, ...), and `backend(name)`; `kvcompile.plan.build_plan`
makes the plan's backends from `resolve`'s names once, and the runtime calls them.

Submodules are imported on demand (by build_plan, or a caller): importing a kernel module imports
triton, and without a GPU TRITON_INTERPRET must be set before that (tests/conftest.py does it).
"""
