"""kvcompile.kernels.choice.resolve: each op's defaults per device and dtype, and clear
errors for names that do not exist or cannot run."""
import pytest
import torch

from kvcompile.kernels import choice
from kvcompile.kernels.paged_attention_cpp import supports as cpp_supports
from tiny import triton_device

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device name needs no GPU
f32, f16 = torch.float32, torch.float16
TRITON_OPS = [op for op, names in choice.IMPLS.items() if "triton" in names]  # online_step: cpp | torch


def test_defaults():
    cpp = "cpp" if cpp_supports(CPU, f32, 64) else "torch"  # "cpp" wherever g++ is on the PATH
    assert choice.resolve("paged_attention", None, CPU, f32, head_dim=64) == cpp
    assert choice.resolve("paged_attention", None, "cpu", f16, head_dim=64) == "torch"
    assert choice.resolve("paged_attention", None, CPU, f32, head_dim=20) == "torch"  # not a multiple of 16
    assert choice.resolve("paged_attention", None, CPU, None, head_dim=64) == "torch"  # mixed dtypes
    for op in ("select", "window_scores"):
        assert choice.resolve(op, None, CPU, f32) == "torch"
    assert choice.resolve("merge", None, CPU, f32) == cpp  # the C++ walk, any head dim
    assert choice.resolve("merge", None, CPU, f32, head_dim=20) == cpp
    assert choice.resolve("merge", None, CPU, f16) == "torch"
    for op in TRITON_OPS:  # triton is installed for the tests
        assert choice.resolve(op, None, CUDA, f16, head_dim=64) == "triton"


def test_requested_names_pass_through():
    for op in TRITON_OPS:
        names = choice.IMPLS[op]
        for name in ("torch", "compiled", "triton"):  # triton: on the GPU, or the CPU under the interpreter (conftest)
            device = triton_device() if name == "triton" else CPU
            assert name in names and choice.resolve(op, name, device, f32, head_dim=64) == name


@pytest.mark.parametrize("op", TRITON_OPS)
def test_unknown_impl_names_the_op_and_its_impls(op):
    with pytest.raises(ValueError, match=rf"{op}: unknown impl 'cuda'; one of triton \| .*compiled"):
        choice.resolve(op, "cuda", CPU, f32, head_dim=64)
    if "cpp" not in choice.IMPLS[op]:
        with pytest.raises(ValueError, match=rf"{op}: unknown impl 'cpp'"):
            choice.resolve(op, "cpp", CPU, f32)


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown op 'attention'; one of paged_attention, select"):
        choice.resolve("attention", None, CPU, f32)


def test_triton_off_the_gpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="select: impl 'triton' needs triton and a CUDA device"):
        choice.resolve("select", "triton", CPU, f32)
    assert choice.resolve("select", "triton", CUDA, f32) == "triton"


def test_triton_missing(monkeypatch):
    monkeypatch.setattr(choice, "_triton_imports", lambda: False)
    with pytest.raises(ValueError, match="merge: impl 'triton' needs triton.*triton missing"):
        choice.resolve("merge", "triton", CUDA, f32)
    assert choice.resolve("merge", None, CUDA, f32) == "torch"
    assert choice.resolve("paged_attention", None, CUDA, f32, head_dim=64) == "torch"


def test_cpp_only_where_it_runs():
    for device, dtype, d in ((CPU, f16, 64), (CPU, f32, 20), (CUDA, f32, 64), (CPU, None, 64)):
        with pytest.raises(ValueError, match="paged_attention: impl 'cpp' needs fp32 CPU tensors"):
            choice.resolve("paged_attention", "cpp", device, dtype, head_dim=d)
    with pytest.raises(ValueError, match="needs head_dim"):
        choice.resolve("paged_attention", None, CPU, f32)


def test_online_step_is_cpp_where_it_runs_else_torch():
    cpp = "cpp" if cpp_supports(CPU, f32, 64) else "torch"
    assert choice.resolve("online_step", None, CPU, f32) == cpp
    assert choice.resolve("online_step", None, CPU, f32, head_dim=8) == cpp  # any head dim
    assert choice.resolve("online_step", None, CPU, f16) == "torch"
    assert choice.resolve("online_step", None, CUDA, f16) == "torch"  # no Triton kernel
    assert choice.resolve("online_step", "torch", CUDA, f32) == "torch"
    for device, dtype in ((CPU, f16), (CUDA, f32), (CPU, None)):
        with pytest.raises(ValueError, match="online_step: impl 'cpp' needs fp32 CPU tensors"):
            choice.resolve("online_step", "cpp", device, dtype)
    with pytest.raises(ValueError, match=r"online_step: unknown impl 'triton'; one of cpp \| torch"):
        choice.resolve("online_step", "triton", CUDA, f16)
