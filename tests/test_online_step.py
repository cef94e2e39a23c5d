"""The fused decode step (kvcompile.kernels.online_step) of running scores and online eviction:
its C++ kernel against the torch step (kvcompile.engine.online.TorchStep: `_attend_with_probs` +
`_update_scores` + `evict_online` + `merge_victims`, Plan.online_impl "torch") and
against reference.decode_step, token by token; and how the plan chooses it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
import kvcompile.store.pages as online_step_module
from kvcompile.engine.online import TorchStep
from kvcompile.cache import KVCompileCache
from kvcompile.kernels.paged_attention_cpp import supports as cpp_supports
from kvcompile.plan import PlanError, StepRule, build_plan
from kvcompile.policies.scoring import Accumulated, Decayed
from test_decode import token_by_token

CPP = cpp_supports(torch.device("cpu"), torch.float32, 16)
needs_cpp = pytest.mark.skipif(not CPP, reason="no C++ toolchain")


def policy(kind: str, per_head: int, alpha: float = 0.6, gqa: str = "mean", residual: float = 0.3):
    """zsmerge (its split with `residual`), zsmerge with no slots (drop), H2O's accumulated
    score decoding online (with slots or dropping), and H2O as shipped (scores run, nothing
    leaves while decoding)."""
    split = {"proximity": 0.2, "context": round(0.8 - residual, 2), "residual": residual}
    if kind == "zsmerge":  # merge: residual needs slots
        split = {"proximity": 0.2, "context": round(0.8 - (residual or 0.1), 2), "residual": residual or 0.1}
        return kvcompile.load_spec("zsmerge", per_head=per_head, budget={"split": split},
                                   scoring={"decayed": {"gqa": gqa}}, merge={"residual": {"alpha": alpha}})
    if kind == "zsmerge_no_slots":
        return kvcompile.load_spec("zsmerge", per_head=per_head, scoring={"decayed": {"gqa": gqa}}, merge="drop",
                                   budget={"split": {"proximity": 0.25, "context": 0.75, "residual": 0.0}})
    if kind == "h2o_online":
        merge = {"residual": {"alpha": alpha}} if residual else "drop"
        return kvcompile.load_spec("h2o", per_head=per_head, ranking={"by_score": {"window": 0}},
                                   scoring={"accumulated": {"gqa": gqa}}, budget={"split": split}, merge=merge,
                                   schedule={"decode": "online"})
    if kind == "h2o":
        return kvcompile.load_spec("h2o", per_head=per_head, ranking={"by_score": {"window": 3}},
                                   scoring={"accumulated": {"gqa": gqa}})
    if kind == "snapkv":  # a plain step: append and attention only
        return kvcompile.load_spec("snapkv", per_head=per_head, ranking={"by_score": {"window": 3}},
                                   scoring={"window_attention": {"window": 4, "gqa": gqa}})
    if kind == "lava_residual":  # a plain step with the merge bias of the prompt's residual slots
        return kvcompile.load_spec("lava_residual", per_head=per_head, scoring={"lava": {"window": 4}},
                                   merge={"residual": {"alpha": alpha}},
                                   budget={"split": {"proximity": 0.25, "context": 0.5, "residual": 0.25}})
    raise KeyError(kind)


def one_layer(pol, b, h, g, d, page, impl=None, record=False):
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    return KVCompileCache(pol, config, page_size=page, record=record, kernels=impl)


def with_impl(cache: KVCompileCache, impl: str | None) -> KVCompileCache:
    """A copy of a prefilled cache whose decode steps run `impl` (None: the torch step, the runtime's path)."""
    step = {"cpp": cache.plan.decode_step, "torch": TorchStep(), None: TorchStep()}[impl]
    return cache.copy_with(dataclasses.replace(cache.plan, decode_step=step))


def assert_same_store(got, want):
    """Exactly the same entries in the same places (evictions, positions, slots, counts, keys,
    values); the running scores up to float summation order."""
    kg, vg, sg, pg, cg, stored = got.gather()
    kw, vw, sw, pw, cw, stored_w = want.gather()
    assert torch.equal(got.lengths, want.lengths) and torch.equal(stored, stored_w)
    assert torch.equal(got.slots, want.slots)
    assert torch.equal(pg[stored], pw[stored])  # the same tokens left, the same slots
    assert torch.equal(cg[stored], cw[stored])  # merge counts
    assert torch.equal(kg[stored], kw[stored]) and torch.equal(vg[stored], vw[stored])
    assert_close(sg[stored], sw[stored], rtol=1e-5, atol=1e-6)
    assert torch.equal(got.block_table, want.block_table) and torch.equal(got.owned, want.owned)


def prompt_and_steps(pol, b, h, g, d, page, n, steps, seed, pad):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, :min(pad, n - 4)] = False
    prompt = (rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d), None if bool(mask.all()) else mask)
    return prompt, [(rand(b, h * g, 1, d), rand(b, h, 1, d), rand(b, h, 1, d)) for _ in range(steps)], mask


KINDS = ["zsmerge", "zsmerge_no_slots", "h2o_online", "h2o", "snapkv", "lava_residual"]


@needs_cpp
@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), b=st.integers(1, 3), h=st.integers(1, 3), g=st.integers(1, 3),
       d=st.sampled_from([8, 16, 20]), page=st.sampled_from([2, 4, 16]), per_head=st.integers(8, 16),
       extra=st.integers(-4, 6), alpha=st.sampled_from([0.0, 0.6]), gqa=st.sampled_from(["mean", "max"]),
       residual=st.sampled_from([0.0, 0.1, 0.3]), pad=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_fused_step_equals_the_python_path(kind, b, h, g, d, page, per_head, extra, alpha, gqa, residual, pad,
                                           seed):
    """C++ step, torch step and the runtime's Python path, from one prefilled cache, step by step:
    the same stores (evictions, positions, slots, counts, k/v exactly) and outputs."""
    pol = policy(kind, per_head, alpha, gqa, residual)
    scale = d ** -0.5
    prompt, steps, _ = prompt_and_steps(pol, b, h, g, d, page, per_head + extra, 12, seed, pad)
    cache = one_layer(pol, b, h, g, d, page)
    torch.ops.kvcompile.attend(*prompt, 0, cache.ref, cache.token, scale)
    assert cache.plan.online_impl == "cpp"
    caches = {impl: with_impl(cache, impl) for impl in ("cpp", "torch", None)}
    for q, k, v in steps:
        outs = {impl: torch.ops.kvcompile.attend(q, k, v, None, 0, c.ref, c.token, scale) for impl, c in caches.items()}
        for impl in ("cpp", "torch"):
            assert_close(outs[impl], outs[None], rtol=1e-5, atol=1e-5)
            assert_same_store(caches[impl].stores[0], caches[None].stores[0])


@needs_cpp
@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(KINDS), b=st.integers(1, 2), h=st.integers(1, 3), g=st.integers(1, 3),
       page=st.sampled_from([2, 4]), per_head=st.integers(8, 14), extra=st.integers(-3, 8),
       alpha=st.sampled_from([0.0, 0.6]), gqa=st.sampled_from(["mean", "max"]), pad=st.integers(0, 3),
       seed=st.integers(0, 2 ** 16))
def test_fused_step_equals_reference_token_by_token(kind, b, h, g, page, per_head, extra, alpha, gqa, pad, seed):
    """The runtime with the C++ step (and its fallbacks) against reference.decode_step."""
    pol = policy(kind, per_head, alpha, gqa)
    d, n = 8, per_head + extra
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    q, k, v = rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, :min(pad, n - 4)] = False
    cache, _, _ = token_by_token(pol, q, k, v, None if bool(mask.all()) else mask, 10, rand, page)
    assert cache.plan.online_impl == "cpp"


@needs_cpp
def test_cpp_runs_the_common_case_and_falls_back_where_it_does_not(monkeypatch):
    """The first step after a prompt that filled the cache evicts several tokens per head, in rounds (the C++
    step runs them as the torch path does); every step is one C++ call, none declined."""
    pol = kvcompile.load_spec("zsmerge", per_head=20, budget={"split": {"proximity": 0.2, "context": 0.5,
                                                                         "residual": 0.3}})
    b, h, g, d, n = 2, 3, 2, 16, 20
    calls = []
    original = online_step_module.online_step_cpp

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(online_step_module, "online_step_cpp", counting)
    prompt, steps, _ = prompt_and_steps(pol, b, h, g, d, 4, n, 6, 3, 0)
    cache = one_layer(pol, b, h, g, d, 4)
    torch.ops.kvcompile.attend(*prompt, 0, cache.ref, cache.token, 0.3)
    python = with_impl(cache, None)
    for q, k, v in steps:
        got = torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, 0.3)
        want = torch.ops.kvcompile.attend(q, k, v, None, 0, python.ref, python.token, 0.3)
        assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert_same_store(cache.stores[0], python.stores[0])
    assert calls == [True] * 6


@needs_cpp
def test_a_head_past_its_spare_pages_falls_back():
    """H2O as shipped: heads grow while decoding; a step where a head takes a fresh page takes it before the
    C++ step (`make_room`), and every step equals the Python path."""
    pol = policy("h2o", 8)
    prompt, steps, _ = prompt_and_steps(pol, 2, 2, 3, 16, 2, 20, 12, 7, 2)
    cache = one_layer(pol, 2, 2, 3, 16, 2)
    torch.ops.kvcompile.attend(*prompt, 0, cache.ref, cache.token, 0.25)
    assert cache.plan.step_rule.evict is False and cache.plan.step_rule.decay == 1.0
    python = with_impl(cache, None)
    for q, k, v in steps:
        got = torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, 0.25)
        want = torch.ops.kvcompile.attend(q, k, v, None, 0, python.ref, python.token, 0.25)
        assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert_same_store(cache.stores[0], python.stores[0])
    assert bool((cache.stores[0].lengths == python.stores[0].lengths).all())


# --- the plan ------------------------------------------------------------------------------

CONFIG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)


def test_the_plan_chooses_the_step():
    cpu = dict(device="cpu", dtype=torch.float32)
    zs = build_plan(kvcompile.load_spec("zsmerge"), CONFIG, **cpu)
    assert zs.online_impl == ("cpp" if CPP else "torch")
    assert zs.step_rule.decay == 0.98 and zs.step_rule.alpha == 0.6 and zs.step_rule.evict
    assert not zs.step_rule.gqa_max
    assert build_plan(kvcompile.load_spec("zsmerge"), CONFIG, kernels="torch", **cpu).online_impl == "torch"
    assert build_plan(kvcompile.load_spec("zsmerge"), CONFIG, device="cpu", dtype=torch.float16).online_impl \
        == "torch"
    snapkv = build_plan(kvcompile.load_spec("snapkv"), CONFIG, **cpu)  # nothing runs: append + attention
    assert snapkv.online_impl == ("cpp" if CPP else "torch") and not snapkv.running_scores
    assert snapkv.step_rule == (StepRule(None, False, None, False) if CPP else None)
    assert build_plan(kvcompile.load_spec("snapkv"), CONFIG, kernels="torch", **cpu).online_impl == "torch"
    assert build_plan(kvcompile.load_spec("lava_residual"), CONFIG, **cpu).step_rule.alpha == \
        kvcompile.load_spec("lava_residual").merge.bias_alpha
    h2o = build_plan(kvcompile.load_spec("h2o"), CONFIG, **cpu)
    assert h2o.step_rule.decay == 1.0 and h2o.step_rule.alpha is None and not h2o.step_rule.evict
    no_slots = build_plan(policy("zsmerge_no_slots", 16, gqa="max"), CONFIG, **cpu)
    assert no_slots.step_rule.alpha is None and no_slots.step_rule.gqa_max
    assert "online_impl" in zs.describe()


def test_cpp_where_it_cannot_run_is_refused_by_the_plan():
    with pytest.raises(PlanError, match="impl 'cpp' needs fp32 CPU tensors"):
        build_plan(kvcompile.load_spec("zsmerge"), SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2,
                                                                   head_dim=16),
                   device="cpu", dtype=torch.float16, kernels="cpp")


def test_the_numbers_are_the_parts_behaviour():
    """StepRule's numbers reproduce the parts' own running update and bias."""
    scores, attention = torch.rand(50), torch.rand(50)
    for scorer in (Decayed(decay=0.9), Accumulated()):
        lam = scorer.running_decay
        assert torch.equal(lam * scores + attention, scorer.running_update(scores, attention))
    counts = torch.tensor([0.0, 1.0, 2.0, 3.0, 17.0])
    merges = [kvcompile.load_spec("zsmerge", merge={"residual": {"alpha": a}}).merge for a in (0.6, 0.0, 1.0)]
    for merge in merges:
        a = merge.bias_alpha
        assert torch.equal(torch.where(counts > 0, a * counts.clamp(min=1).double().log(), float("-inf")).float(),
                           merge.bias(counts))


@dataclass(frozen=True)
class SquaredDecay(Decayed):
    """A running update the fused step does not compute (s ← λ·s + a²)."""

    def running_update(self, scores, attention):
        return self.decay * scores + attention * attention


def test_parts_it_cannot_express_keep_the_python_path():
    pol = dataclasses.replace(kvcompile.load_spec("zsmerge", per_head=8), scoring=SquaredDecay())
    assert SquaredDecay().running_decay is None
    plan = build_plan(pol, CONFIG, device="cpu", dtype=torch.float32)
    assert plan.online_impl == "torch" and plan.step_rule is None and plan.running_scores
    cache = one_layer(pol, 1, 2, 1, 8, 4)
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    torch.ops.kvcompile.attend(rand(1, 2, 12, 8), rand(1, 2, 12, 8), rand(1, 2, 12, 8), None, 0, cache.ref, cache.token,
                               0.3)
    for _ in range(3):
        torch.ops.kvcompile.attend(rand(1, 2, 1, 8), rand(1, 2, 1, 8), rand(1, 2, 1, 8), None, 0, cache.ref,
                                   cache.token, 0.3)
    assert bool((cache.stores[0].lengths <= cache.budgets[:, 0]).all())
