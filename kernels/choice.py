"""Which implementation of each kernel runs (temporary; replaced by the kernels branch's resolver)."""
from __future__ import annotations

import torch

IMPLS = {
    "paged_attention": ("triton", "cpp", "torch", "compiled"),
    "select": ("triton", "torch", "compiled"),
    "merge": ("triton", "torch", "compiled"),
    "window_scores": ("triton", "torch", "compiled"),
}


def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(op: str, requested: str | None, device, dtype, head_dim: int | None = None) -> str | None:
    if requested is not None:
        if requested not in IMPLS[op]:
            raise ValueError(f"{op}: unknown kernel {requested!r} (allowed: {' | '.join(IMPLS[op])})")
        return requested
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda":
        return "triton" if _triton() else "torch"
    if op == "paged_attention":
        if dtype is None or head_dim is None:
            return None
        from kvcompile.kernels.paged_attention_cpp import _toolchain

        return "cpp" if dtype == torch.float32 and head_dim % 16 == 0 and _toolchain() else "torch"
    return "torch"
