"""The kernel backends the Plan holds: build_plan chooses them once (from choice.resolve's names), the
runtime calls them without resolving or comparing a name again, their threading thresholds are fields
that describe() shows, and a bound plan refuses tensors it was not planned for."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile.cache import KVCompileCache
from kvcompile.kernels import choice, merge, paged_attention, select, window_scores
from kvcompile.store import pages as online_step  # the fused steps are the store's
from kvcompile.kernels.paged_attention_cpp import PARALLEL_WORK as CPP_PARALLEL_WORK
from kvcompile.kernels.paged_attention_cpp import supports as cpp_supports
from kvcompile.plan import PartScores, build_plan

CPP = cpp_supports(torch.device("cpu"), torch.float32, 16)
CONFIG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4, head_dim=16,
                         hidden_size=64)
FP32 = dict(device="cpu", dtype=torch.float32)


def test_the_plan_holds_one_backend_per_family():
    plan = build_plan(kvcompile.load_spec("zsmerge"), CONFIG, **FP32)
    assert isinstance(plan.selection, select.TorchSelection) and plan.selection.one_thread
    if CPP:
        assert isinstance(plan.decode_attention, paged_attention.CppPagedAttention)
        assert plan.decode_attention.parallel_work == CPP_PARALLEL_WORK
        assert isinstance(plan.prompt_merge, merge.CppResidualMerge)
        assert isinstance(plan.decode_step, online_step.CppOnlineStep) and not hasattr(plan.decode_step, "runs")
        assert plan.decode_step.rule == plan.step_rule
    torch_plan = build_plan(kvcompile.load_spec("zsmerge"), CONFIG, kernels="torch", **FP32)
    assert isinstance(torch_plan.decode_attention, paged_attention.TorchPagedAttention)
    assert isinstance(torch_plan.prompt_merge, merge.TorchResidualMerge)
    assert torch_plan.prompt_merge.compile_above is None  # asked for: the eager lowering, always
    default_half = build_plan(kvcompile.load_spec("zsmerge"), CONFIG, device="cpu", dtype=torch.float16)
    assert default_half.prompt_merge == merge.TorchResidualMerge(compile_above=2048)
    compiled = build_plan(kvcompile.load_spec("snapkv"), CONFIG, device="cpu", dtype=torch.float16,
                          compiled_entry=True)
    assert compiled.decode_attention == paged_attention.CompiledPagedAttention(paged_attention.PARALLEL_WORK)
    assert isinstance(compiled.prompt_scores, PartScores) and compiled.prompt_merge is None


def test_describe_shows_the_backends_and_their_thresholds():
    text = build_plan(kvcompile.load_spec("snapkv"), CONFIG, device="cpu", dtype=torch.float16,
                      compiled_entry=True).describe()
    assert f"decode_impl: compiled (one-thread graph below {paged_attention.PARALLEL_WORK} multiply-adds" in text
    assert "select_impl: torch (one thread)" in text
    if CPP:
        text = build_plan(kvcompile.load_spec("snapkv"), CONFIG, **FP32).describe()
        assert f"online_impl: cpp, fp32 pages: the new entry copied into its slot, then the paged kernel, one " \
               f"call (one thread below {CPP_PARALLEL_WORK} multiply-adds" in text
        text = build_plan(kvcompile.load_spec("zsmerge"), CONFIG, **FP32).describe()
        assert f"merge_impl: cpp (heads on torch's threads from {merge.CPP_PARALLEL_WORK} multiply-adds" in text
    assert "chosen at the first prompt" in build_plan(kvcompile.load_spec("snapkv"), CONFIG).describe()


def run_prompt_and_steps(cache: KVCompileCache, steps: int = 3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    outs = []
    for layer in range(CONFIG.num_hidden_layers):
        outs.append(torch.ops.kvcompile.attend(rand(1, 4, 120, 16), rand(1, 2, 120, 16), rand(1, 2, 120, 16), None,
                                               layer, cache.ref, cache.token, 0.25))
    for _ in range(steps):
        for layer in range(CONFIG.num_hidden_layers):
            outs.append(torch.ops.kvcompile.attend(rand(1, 4, 1, 16), rand(1, 2, 1, 16), rand(1, 2, 1, 16), None,
                                                   layer, cache.ref, cache.token, 0.25))
    return outs


@pytest.mark.parametrize("spec", ["snapkv", "zsmerge", "h2o", "lava"])
@pytest.mark.parametrize("kernels", [None, "torch"])
def test_after_build_plan_nothing_is_resolved_again(monkeypatch, spec, kernels):
    """A bound plan's prompt and decode steps run without choice.resolve (it raises once the plan is
    built), and give what the same plan gives with resolve in place."""
    policy = kvcompile.load_spec(spec, per_head=80)
    plan = build_plan(policy, CONFIG, kernels=kernels, **FP32)
    want = run_prompt_and_steps(KVCompileCache.from_plan(plan))

    def refuse(*args, **kwargs):
        raise AssertionError("choice.resolve called after build_plan")

    monkeypatch.setattr(choice, "resolve", refuse)
    for module in (paged_attention, merge, select, window_scores):
        monkeypatch.setattr(module, "resolve", refuse)
    got = run_prompt_and_steps(KVCompileCache.from_plan(plan))
    for a, b in zip(got, want):
        assert_close(a, b)


def test_an_unbound_plan_is_bound_once_by_its_first_prompt():
    cache = KVCompileCache(kvcompile.load_spec("snapkv", per_head=80), CONFIG)
    assert not cache.plan.bound and cache.plan.decode_attention is None
    run_prompt_and_steps(cache, steps=1)
    plan = cache.plan
    assert plan.bound and plan.device == torch.device("cpu") and plan.dtype == torch.float32
    assert plan.decode_attention == paged_attention.backend(plan.decode_impl)
    assert plan.bound_to(torch.zeros(1)) is plan  # its own tensors: the same plan, nothing chosen again


def test_a_bound_plan_refuses_other_tensors():
    plan = build_plan(kvcompile.load_spec("snapkv", per_head=80), CONFIG, **FP32)
    cache = KVCompileCache.from_plan(plan)
    with pytest.raises(RuntimeError, match=r"runs in torch.float64 on cpu, but the cache's plan chose its kernels "
                                           r"for torch.float32 on cpu"):
        run_prompt_and_steps(cache, steps=0, dtype=torch.float64)
    assert cache.stores == [None, None]


def test_under_autocast_compile_plans_the_cache_for_the_autocast_dtype():
    from tiny import prompt, tiny_model

    model = tiny_model("llama", layers=2)
    with kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=80)), torch.no_grad():
        assert model.kvcompile_plan.dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cache = model(prompt(100)).past_key_values
        assert cache.plan.dtype == torch.bfloat16 and cache.plan.decode_impl == "torch"
        assert model.kvcompile_plan.dtype == torch.float32  # the model's plan is unchanged
