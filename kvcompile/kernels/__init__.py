"""kvcompile.kernels: each kernel a Triton version beside a torch lowering.

- `paged_attention`: decode attention over the paged cache (flash-decoding); its CPU
  kernel in C++ is `paged_attention_cpp`.
- `window_scores`: fused window scoring of one layer (SnapKV / LAVa).
- `merge`: the ZSMerge residual merge update.
- `select`: prefill selection (top-k per head, pooled top-k, DBudgetKV threshold) and
  the gather of the kept rows into pages.
- `choice`: `resolve`, which implementation of each of these runs (the `impl=` names,
  their defaults per device and dtype, and the errors for names that cannot run).

Submodules are imported on demand: importing a kernel module imports triton, and without a GPU
TRITON_INTERPRET must be set before that (tests/conftest.py does it).
"""
