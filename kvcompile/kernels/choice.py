"""Which implementation runs a kernel: one resolver for every dispatcher and for the plan.

Each kernel op has a few implementations ("impls"), named by strings:

    op                impls                               default
    paged_attention   triton | cpp | torch | compiled     triton on CUDA (torch there without
                                                          triton); elsewhere cpp where the C++
                                                          kernel applies (CPU, fp32, head dim a
                                                          multiple of 16, a C++ compiler), else torch
    select            triton | torch | compiled           triton on CUDA, else torch
    merge             triton | cpp | torch | compiled     triton on CUDA; cpp on the CPU for fp32
                                                          with a C++ compiler (any head dim); else torch
    window_scores     triton | torch | compiled           triton on CUDA, else torch
    online_step       cpp | torch                         cpp on the CPU for fp32 with a C++
                                                          compiler (any head dim), else torch
    column_sums       cpp | torch                         cpp where the C++ kernel applies (as
                                                          paged_attention), else torch

"torch" is the eager torch lowering, "compiled" the same lowering through Inductor
(torch.compile), "cpp" the hand-written C++ kernels (paged_attention_cpp; online_step: the
fused decode steps, kernels.online_step's family, "torch" its step in torch ops; column_sums: the prompt's attention
with the weighted column sums of its probabilities, attention_column_sums; its "torch" is the
model's attention and the scorer's own pass), "triton"
the Triton kernels: on a CUDA device, or on any device under Triton's interpreter
(TRITON_INTERPRET=1, how the tests run them without a GPU).
"""
from __future__ import annotations

import functools
import os

import torch

from kvcompile.kernels.paged_attention_cpp import supports as cpp_supports

IMPLS: dict[str, tuple[str, ...]] = {
    "paged_attention": ("triton", "cpp", "torch", "compiled"),
    "select": ("triton", "torch", "compiled"),
    "merge": ("triton", "cpp", "torch", "compiled"),
    "window_scores": ("triton", "torch", "compiled"),
    "online_step": ("cpp", "torch"),
    "column_sums": ("cpp", "torch"),
}


def resolve(op: str, requested: str | None, device: torch.device | str, dtype: torch.dtype | None, *,
            head_dim: int | None = None) -> str:
    """The impl that runs `op` on tensors of `device` and `dtype`: `requested`, checked, or
    the default for the device and dtype (the table in the module docstring).

    op: "paged_attention" | "select" | "merge" | "window_scores" | "online_step" | "column_sums"
        (the keys of IMPLS).
    requested: an impl name of that op, or None for the default.
    device, dtype: where the op's tensors live and the dtype it reads (for paged_attention
        the queries' and the pages'; None when they differ: then there is no C++ kernel).
    head_dim: the head dim d; paged_attention and column_sums need it to decide on the C++
        kernel (when `requested` is None or "cpp"), the other ops ignore it.

    Returns one of IMPLS[op], which the kernel can run on these tensors. Raises ValueError
    naming the op and its impls for an unknown op or name, or for an impl that cannot run
    here: "triton" without triton, or without a CUDA device outside the interpreter; "cpp"
    off the CPU, for a dtype other than fp32, a head dim not a multiple of 16, or without
    a C++ compiler. Pure: it reads the environment and imports triton (only for "triton"
    or a CUDA device), nothing else; the answer holds for every call with the same
    arguments, so a caller may resolve once and pass the name to the kernels' `impl=`.
    """
    if op not in IMPLS:
        raise ValueError(f"kernel choice: unknown op {op!r}; one of {', '.join(IMPLS)}")
    names = IMPLS[op]
    device = torch.device(device)
    if op in ("paged_attention", "column_sums") and requested in (None, "cpp") and head_dim is None:
        raise ValueError("paged_attention: resolving impl None or 'cpp' needs head_dim")
    if op == "online_step":
        return _resolve_any_dim_cpp(op, requested, device, dtype)  # no Triton kernel: cpp where it runs
    if op == "merge" and requested in (None, "cpp") and not (device.type == "cuda" and _triton_imports()):
        return _resolve_any_dim_cpp(op, requested, device, dtype)
    if requested is None:
        if device.type == "cuda" and "triton" in names and _triton_imports():
            return "triton"
        if op in ("paged_attention", "column_sums") and _cpp_runs(device, dtype, head_dim):
            return "cpp"
        return "torch"
    if requested not in names:
        raise ValueError(f"{op}: unknown impl {requested!r}; one of {' | '.join(names)}")
    if requested == "triton" and not (_triton_imports() and (device.type == "cuda" or _interpreting())):
        raise ValueError(f"{op}: impl 'triton' needs triton and a CUDA device (or TRITON_INTERPRET=1); "
                         f"here {device.type}, triton {'installed' if _triton_imports() else 'missing'}. "
                         f"Impls: {' | '.join(names)}")
    if requested == "cpp" and not _cpp_runs(device, dtype, head_dim):
        raise ValueError(f"{op}: impl 'cpp' needs fp32 CPU tensors, a head dim that is a multiple of 16 "
                         f"and a C++ compiler; here {device.type}, {dtype}, head dim {head_dim}. "
                         f"Impls: {' | '.join(names)}")
    return requested


def _resolve_any_dim_cpp(op: str, requested: str | None, device: torch.device, dtype: torch.dtype | None) -> str:
    """A C++ kernel that takes any head dim: cpp where it runs (fp32 on the CPU with a compiler)
    when asked for or by default, else torch."""
    names = IMPLS[op]
    runs = dtype is not None and cpp_supports(device, dtype, 16)  # its C++ takes any head dim
    if requested is None:
        return "cpp" if runs else "torch"
    if requested not in names:
        raise ValueError(f"{op}: unknown impl {requested!r}; one of {' | '.join(names)}")
    if requested == "cpp" and not runs:
        raise ValueError(f"{op}: impl 'cpp' needs fp32 CPU tensors and a C++ compiler; here "
                         f"{device.type}, {dtype}. Impls: {' | '.join(names)}")
    return requested


def _cpp_runs(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> bool:
    return dtype is not None and head_dim is not None and cpp_supports(device, dtype, head_dim)


@functools.cache
def _triton_imports() -> bool:
    """Triton is installed and imports (it is optional: the torch lowerings need none)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    """Triton runs its kernels in its interpreter (on CPU tensors): TRITON_INTERPRET is on, as
    Triton itself reads it (its knob; the variable for Triton versions without knobs)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
