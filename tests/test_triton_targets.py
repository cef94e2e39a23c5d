"""Every Triton kernel of kvcompile compiled for sm_80 and sm_90 without a GPU
(kvcompile/kernels/targets.py), at an 8B-class GQA model's shapes in bf16 and fp16: no
compile error, no stack frame, local memory or register spill, shared memory within the
target's per-block limit. Stack and spills must be 0: every kernel fits its registers
today, so any stack frame is state moved to local memory (a spill, or an array indexed at
run time), on kernels whose job is to stream the cache through registers once."""
import concurrent.futures
import os
import shutil

import pytest

pytest.importorskip("triton.backends.nvidia.compiler",
                    reason="Triton's NVIDIA backend (ptxas, cuobjdump) is not installed")

import triton  # noqa: E402  (after the skip)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvcompile.kernels import merge, paged_attention, paged_attention_quant, select, targets, window_scores  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    # One process per (target, dtype), as many at once as there are cores, at most 4: Triton
    # decides interpreter or compiler at import, and compiling is CPU-bound.
    jobs = [(arch, (dtype,)) for arch in targets.ARCHS for dtype in targets.DTYPES]
    with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        return [row for report in pool.map(lambda job: targets.run_report(*job), jobs) for row in report]


def kernels_of(module) -> set[str]:
    """The launched Triton kernels a module defines (by the house convention, *_kernel)."""
    kinds = (triton.runtime.JITFunction, InterpretedFunction)  # interpreted under TRITON_INTERPRET
    return {name for name, value in vars(module).items()
            if isinstance(value, kinds) and name.endswith("_kernel")}


def describe(row) -> str:
    return f"{row['kernel']} ({row['case']}) {row['arch']} {row['dtype']}"


def test_every_kernel_compiles_for_every_target_and_dtype(rows):
    errors = [f"{describe(r)}: {r['error']}" for r in rows if "error" in r]
    assert not errors, "\n".join(errors)
    expected = set().union(*(kernels_of(m) for m in (paged_attention, paged_attention_quant, window_scores, merge,
                                                     select)))
    assert len(expected) >= 9
    for arch in targets.ARCHS:
        for dtype in targets.DTYPES:
            seen = {r["kernel"] for r in rows if r["arch"] == f"sm_{arch}" and r["dtype"] == dtype}
            assert seen == expected, (arch, dtype, expected ^ seen)


def test_no_stack_frame_local_memory_or_spill(rows):
    bad = [f"{describe(r)}: REG {r['registers']} STACK {r['stack']} LOCAL {r['local']} "
           f"spill stores {r['spill_stores']} loads {r['spill_loads']}"
           for r in rows if "error" not in r
           and (r["stack"] or r["local"] or r["spill_stores"] or r["spill_loads"])]
    assert not bad, "\n".join(bad)
    assert all(0 < r["registers"] <= 255 for r in rows if "error" not in r)


def test_shared_memory_within_the_targets_limit(rows):
    over = [f"{describe(r)}: {r['shared']} > {r['shared_limit']} bytes"
            for r in rows if "error" not in r and r["shared"] > r["shared_limit"]]
    assert not over, "\n".join(over)
    assert targets.SHARED_PER_BLOCK == {80: 163 * 1024, 90: 227 * 1024}


def test_the_tools_are_there():
    """cuobjdump and ptxas ship with Triton's NVIDIA backend (what the report reads)."""
    from triton.backends.nvidia.compiler import get_ptxas
    assert shutil.which(targets._tool("cuobjdump"))
    assert shutil.which(get_ptxas(90).path) and shutil.which(get_ptxas(80).path)
