"""The decode step's backend family (kvcompile.kernels.online_step): the plan chooses the step once and the engine
calls it once a layer and step, with nothing checked per step and no step declined (no `runs`, no None: a step
where a head takes a fresh page or evicts several tokens is the chosen backend's too); a step that does not
compute the plan's store is refused when the plan is made; and the float and quantized paged kernels are one
C++ kernel (one entry; the log-sum-exp for fp32 pages too)."""
from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch.testing import assert_close

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile.engine.online import TorchStep
from kvcompile.kernels import paged_attention_cpp, paged_attention_quant as pq
from kvcompile.store import pages as online_step  # the fused steps are the store's
from kvcompile.kernels.online_step import DecodeStep
from kvcompile.store.pages import CppAppendStep, CppOnlineStep, CppQuantStep
from kvcompile.plan import PlanError, build_plan
from kvcompile.store import CodeStore, LayerStore
from test_online_step import assert_same_store, one_layer, policy, prompt_and_steps, with_impl

CPP = pq.supports(torch.device("cpu"), torch.float32, 16, (16,))
needs_cpp = pytest.mark.skipif(not CPP, reason="no C++ toolchain")


@needs_cpp
@pytest.mark.parametrize("spec, backend", [
    ("zsmerge", CppOnlineStep),  # the first step after the prompt evicts several tokens a head
    ("h2o", CppOnlineStep),  # heads grow: steps where a head takes a fresh page
    ("snapkv", CppAppendStep),
    ("lava_residual", CppAppendStep),  # the merge bias of the prompt's slots
    ("snapkv_int4", CppAppendStep),
])
def test_the_plans_step_runs_every_step_and_nothing_else(spec, backend):
    """Every decode step of every layer is one call of the plan's backend: the store's own append (the torch
    step's, and the fallback of old) never runs, and no backend is asked whether it takes a step."""
    pol = policy(spec, 8) if spec in ("zsmerge", "h2o", "snapkv", "lava_residual") else \
        kvcompile.load_spec("snapkv", per_head=8, storage="int4", ranking={"by_score": {"window": 2}},
                            scoring={"window_attention": {"window": 2}})
    b, h, g, d, page = 2, 2, 2, 16, 2
    prompt, steps, _ = prompt_and_steps(pol, b, h, g, d, page, 20, 10, 5, 2)
    cache = one_layer(pol, b, h, g, d, page)
    torch.ops.kvcompile.attend(*prompt, 0, cache.ref, cache.token, 0.3)
    assert isinstance(cache.plan.decode_step, backend) and not hasattr(cache.plan.decode_step, "runs")
    calls = Counter()
    real_call, real_append, real_codes = type(cache.plan.decode_step).__call__, LayerStore.append, CodeStore.append

    def count(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    with mock.patch.object(type(cache.plan.decode_step), "__call__", count("step", real_call)), \
            mock.patch.object(LayerStore, "append", count("append", real_append)), \
            mock.patch.object(CodeStore, "append", count("append", real_codes)):
        for q, k, v in steps:
            torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, 0.3)
    assert calls == Counter(step=len(steps))
    if spec == "h2o":  # heads took pages between steps (the engine's make_room, counted as the append's read)
        assert sum(cache.host_syncs.values()) > 0


@needs_cpp
@pytest.mark.parametrize("spec", ["snapkv", "lava_residual"])
def test_the_fused_plain_step_is_the_torch_steps_kernel_bit_for_bit(spec):
    """fp32 pages of a plain step: the fused append and paged C++ kernel (with the merge bias where slots are)
    give the torch step's output (its append, then the same paged kernel) bit for bit, and the same store."""
    pol = policy(spec, 8)
    prompt, steps, _ = prompt_and_steps(pol, 2, 3, 2, 16, 4, 24, 12, 11, 3)
    cache = one_layer(pol, 2, 3, 2, 16, 4)
    torch.ops.kvcompile.attend(*prompt, 0, cache.ref, cache.token, 0.25)
    assert isinstance(cache.plan.decode_step, CppAppendStep)
    assert (cache.plan.decode_step.alpha is None) == (spec == "snapkv")
    other = with_impl(cache, "torch")
    for q, k, v in steps:
        got = torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, 0.25)
        want = torch.ops.kvcompile.attend(q, k, v, None, 0, other.ref, other.token, 0.25)
        assert torch.equal(got, want)
        assert_same_store(cache.stores[0], other.stores[0])
    assert cache.host_syncs == other.host_syncs


CONFIG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4, head_dim=16,
                         hidden_size=64)
FP32 = dict(device="cpu", dtype=torch.float32)


def test_a_step_that_does_not_cover_the_plan_is_refused_when_the_plan_is_made():
    plan = build_plan(kvcompile.load_spec("snapkv"), CONFIG, **FP32)
    with pytest.raises(PlanError, match=r"computes CodeStore layers, and this policy's are LayerStore"):
        dataclasses.replace(plan, decode_step=CppQuantStep(8, 16))
    half = build_plan(kvcompile.load_spec("zsmerge"), CONFIG, device="cpu", dtype=torch.float16)
    assert isinstance(half.decode_step, TorchStep)  # the C++ steps are fp32: the torch step there
    codes = build_plan(kvcompile.load_spec("snapkv_int4"), CONFIG, **FP32)
    with pytest.raises(PlanError, match="the decode step cpp .* cannot run"):
        dataclasses.replace(codes, decode_step=CppOnlineStep(plan.step_rule))
    for spec in ("snapkv", "zsmerge", "h2o", "snapkv_int4", "kivi", "lava_mixed"):  # the torch step runs them all
        for options in (FP32, dict(device="cpu", dtype=torch.bfloat16)):
            plan = build_plan(kvcompile.load_spec(spec), CONFIG, **options)
            assert isinstance(plan.decode_step, DecodeStep)
            assert dataclasses.replace(plan, decode_step=TorchStep()).decode_step == TorchStep()


@needs_cpp
@pytest.mark.parametrize("bias", [False, True])
def test_float_and_quantized_pages_are_one_kernel(bias):
    """One C++ kernel (paged_attention.cpp, one entry `paged_attention_cpp.launch`) over fp32 pages and over int8
    codes whose dequantized values are those floats (code · 1 + 0): the same attention, and over fp32 pages the
    log-sum-exp the codes' kernel gives (the entry's, which the float pages had no kernel for), both equal to the
    eager reference."""
    gen = torch.Generator().manual_seed(0)
    b, h, g, d, s, pages = 2, 2, 3, 32, 16, 12
    codes_k = torch.randint(0, 256, (pages, s, d), generator=gen, dtype=torch.uint8)
    codes_v = torch.randint(0, 256, (pages, s, d), generator=gen, dtype=torch.uint8)
    ones, zeros = torch.ones(pages, s, d // 16), torch.zeros(pages, s, d // 16)
    table = torch.randperm(pages, generator=gen)[:b * h * 3].view(b, h, 3)
    lengths = torch.tensor([[40, 7], [0, 48]])
    q = torch.randn(b, h * g, d, generator=gen) / 64
    bias_pages = torch.randn(pages, s, generator=gen) if bias else None
    k, v = codes_k.float(), codes_v.float()
    out, lse = paged_attention_cpp.launch(paged_attention_cpp._kernel(g, d), q, (k, k, k, v, v, v), 32, table,
                                          lengths, bias_pages, 0.1, return_lse=True)
    quantized, quantized_lse = pq.paged_attention_quant_cpp(q, codes_k, ones, zeros, codes_v, ones, zeros, table,
                                                            lengths, bias_pages, 0.1, return_lse=True)
    want, want_lse = pq.paged_attention_lse_torch(q, k, v, table, lengths, 0.1, bias_pages)
    for got, got_lse in ((out, lse), (quantized, quantized_lse)):
        assert_close(got, want)
        assert_close(got_lse, want_lse)
    assert torch.equal(out, paged_attention_cpp.paged_attention_cpp(q, k, v, table, lengths, bias_pages, 0.1))


def test_no_step_backend_has_a_per_step_check():
    for cls in (DecodeStep, TorchStep, CppOnlineStep, CppAppendStep, online_step.CppOnlineStep):
        assert not hasattr(cls, "runs")
