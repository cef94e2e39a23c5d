"""kvcompile.kernels: each kernel a Triton version beside a torch lowering.

- `paged_attention`: decode attention over the paged cache (flash-decoding); its CPU
  kernel in C++ is `paged_attention_cpp`.
- `window_scores`: fused window scoring of one layer (SnapKV / LAVa).
- `merge`: the ZSMerge residual merge update.
- `select`: prefill selection (top-k per head, pooled top-k, DBudgetKV threshold) and
  the gather of the kept rows into pages.

Submodules are imported on demand: importing one imports triton, and without a GPU
TRITON_INTERPRET must be set before that (tests/conftest.py does it).
"""
