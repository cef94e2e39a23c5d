"""The fused decode step of a quantized store (kvcompile.kernels.append_step): the new entry quantized into its
slot and the attention over the codes in one C++ call, against the torch step (`LayerStore.append` with the
torch quantizer, then the quantized decode backend), the torch quantizer itself (codes, scales and zero points
bit for bit) and the eager reference (reference.decode_step, token by token); every step of it, a head taking a
fresh page included; and how the plan chooses it."""
from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
import kvcompile.store.pages as quant_step_module
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from kvcompile.kernels import paged_attention_quant as pq
from kvcompile.engine.online import TorchStep
from kvcompile.store.codes import ChannelCodeStore
from kvcompile.store.pages import CppQuantStep
from kvcompile.kernels.tiered_step import CppTieredStep
import kvcompile.kernels.tiered_step as tiered_step_module
from kvcompile.kernels.quantize import dequantize, quantize
from kvcompile.plan import build_plan
from test_decode import token_by_token
from tiny import prompt, tiny_model

CPP = pq.supports(torch.device("cpu"), torch.float32, 16, (16,))
needs_cpp = pytest.mark.skipif(not CPP, reason="no C++ toolchain")
SMALL = {"ranking": {"by_score": {"window": 2}}, "scoring": {"window_attention": {"window": 2}}}
PAGE_FIELDS = ("k_pages", "v_pages", "k_scale", "k_zero", "v_scale", "v_zero", "score_pages", "pos_pages",
               "count_pages", "block_table", "lengths", "owned", "slots")


def storage_part(bits: int, group: int) -> dict:
    return {f"int{bits}": {"group": group}}


def one_layer(policy, b, h, g, d, page, kernels=None):
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    return KVCompileCache(policy, config, page_size=page, kernels=kernels)


def prefilled(policy, b, h, g, d, page, n, pad, rand, scale):
    """One layer prefilled with n random entries a head (the batch's last row left-padded by up to `pad`),
    and its copy whose decode steps take the engine's path (`unfused`)."""
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, :min(pad, n - 3)] = False
    cache = one_layer(policy, b, h, g, d, page)
    torch.ops.kvcompile.attend(rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d),
                               None if bool(mask.all()) else mask, 0, cache.ref, cache.token, scale)
    return cache, unfused(cache)


def unfused(cache: KVCompileCache) -> KVCompileCache:
    """A copy of a prefilled cache whose decode steps take the engine's path (append, then attention)."""
    return cache.copy_with(dataclasses.replace(cache.plan, decode_step=TorchStep()))


def assert_same_store(got, want):
    """Bit for bit the same pool, block table and counters (codes, scales, zero points, positions, ...)."""
    for name in PAGE_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) if a is None or b is None else a.shape == b.shape and torch.equal(a, b), name
    assert got.room == want.room and got.next_page == want.next_page


@contextlib.contextmanager
def counted(module=quant_step_module, name: str = "append_step_cpp"):
    """Each call of a C++ step while the block runs: whether it ran (False: not its case, the engine's path ran)."""
    calls = []
    original = getattr(module, name)

    def count(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    with mock.patch.object(module, name, count):
        yield calls


def appended_entry(store, b: int, h: int):
    """The codes, scales and zero points of head (b, h)'s last entry."""
    e = int(store.lengths[b, h]) - 1
    page, slot = int(store.block_table[b, h, e // store.page_size]), e % store.page_size
    return tuple(getattr(store, name)[page, slot] for name in ("k_pages", "k_scale", "k_zero", "v_pages", "v_scale",
                                                              "v_zero"))


def assert_quantized_as_torch(store, k, v, bits, group):
    """Every head's appended entry holds quantize(x)'s codes, scale and zero point exactly."""
    for b in range(k.shape[0]):
        for h in range(k.shape[1]):
            got = appended_entry(store, b, h)
            want = quantize(k[b, h][None], bits, group) + quantize(v[b, h][None], bits, group)
            for x, y in zip(got, want):
                assert torch.equal(x, y[0]), (b, h)


def dequantized_attention(store, q, scale):
    """reference.decode_attention over the store's dequantized entries."""
    keys, values, _, _, _, stored = store.gather()
    return reference.decode_attention(q[:, :, None], keys, values, None, stored.sum(-1), scale)[:, :, 0]


@needs_cpp
@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 8]), d=st.sampled_from([16, 32, 64]), groups=st.integers(0, 2),
       b=st.integers(1, 3), h=st.integers(1, 3), g=st.integers(1, 4), page=st.sampled_from([2, 4, 16]),
       per_head=st.integers(6, 20), extra=st.integers(-3, 12), steps=st.integers(1, 24), pad=st.integers(0, 4),
       magnitude=st.sampled_from([1e-3, 1.0, 50.0]), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_fused_step_equals_the_unfused_path(bits, d, groups, b, h, g, page, per_head, extra, steps, pad, magnitude,
                                            threads, seed):
    """From one prefilled cache, step by step: the same pool bit for bit (codes, scales, zero points,
    positions, counts, block table, lengths, pages taken where a head outgrows its spares), every appended
    entry quantized exactly as the torch quantizer does it, the same output as the unfused path's kernel, and
    the reference's attention over the dequantized entries."""
    group = max(16, d >> groups)
    policy = kvcompile.load_spec("snapkv", per_head=per_head, storage=storage_part(bits, group), **SMALL)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * magnitude  # noqa: E731
    scale = d ** -0.5
    cache, other = prefilled(policy, b, h, g, d, page, max(4, per_head + extra), pad, rand, scale)
    assert isinstance(cache.plan.decode_step, CppQuantStep)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(steps):
            q, k, v = rand(b, h * g, 1, d) / magnitude ** 2, rand(b, h, 1, d), rand(b, h, 1, d)  # logits ~ 1
            got = torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, scale)
            want = torch.ops.kvcompile.attend(q, k, v, None, 0, other.ref, other.token, scale)
            assert_same_store(cache.stores[0], other.stores[0])
            assert_quantized_as_torch(cache.stores[0], k[:, :, 0], v[:, :, 0], bits, group)
            assert torch.equal(got, want)  # the same kernel over the same pages
            assert_close(got[:, :, 0], dequantized_attention(cache.stores[0], q[:, :, 0], scale), rtol=1e-4,
                         atol=1e-5 * magnitude)
    finally:
        torch.set_num_threads(before)


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_ties_round_half_to_even_constants_and_the_range_ends(bits):
    """Entries whose (x − zero) / scale fall exactly halfway (groups of scale 1: x = 0, 0.5, 1.5, ..., the top code),
    a constant entry (scale 1, codes 0), a range of subnormal steps, and huge and tiny magnitudes: the fused
    step's codes, scales and zero points are the torch quantizer's, bit for bit."""
    with counted() as calls:
        top = float(2 ** bits - 1)
        d, h = 32, 6
        ends = torch.tensor([0.0, top])  # each group of 16: min 0, max top, so scale 1 and codes round(x)
        halves = torch.cat([ends, torch.arange(14) + 0.5, ends, torch.arange(14) * 0.5])
        rows = torch.stack([
            halves,
            torch.full((d,), 1.25),  # constant: scale 1, every code 0
            torch.cat([torch.tensor([1e-38]), torch.full((d - 1,), 1.1e-38)]),  # range below the levels' step
            torch.randn(d, generator=torch.Generator().manual_seed(1)) * 1e30,
            torch.randn(d, generator=torch.Generator().manual_seed(2)) * 1e-30,
            -halves.flip(0) - 7.0,
        ])  # (h, d)
        policy = kvcompile.load_spec("snapkv", per_head=8, storage=storage_part(bits, 16), **SMALL)
        cache = one_layer(policy, 1, h, 1, d, 4)
        gen = torch.Generator().manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
        torch.ops.kvcompile.attend(rand(1, h, 12, d), rand(1, h, 12, d), rand(1, h, 12, d), None, 0, cache.ref,
                                   cache.token, 0.2)
        other = unfused(cache)
        k, v = rows[None, :, None], rows.flip(-1)[None, :, None]
        q = rand(1, h, 1, d)
        got = torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, 0.2)
        want = torch.ops.kvcompile.attend(q, k, v, None, 0, other.ref, other.token, 0.2)
        assert calls == [True]
        assert_quantized_as_torch(cache.stores[0], k[:, :, 0], v[:, :, 0], bits, 16)
        assert_same_store(cache.stores[0], other.stores[0])
        assert torch.equal(got, want)
        codes = appended_entry(cache.stores[0], 0, 0)[0]  # the halves' codes: round half to even
        unpacked = torch.stack([codes & 0xF, codes >> 4], -1).flatten() if bits == 4 else codes
        evens = torch.round(halves)  # torch.round: half to even
        assert torch.equal(unpacked.float(), evens) and not torch.equal(evens, torch.floor(halves + 0.5))


@needs_cpp
@pytest.mark.parametrize("storage", ["int8", "int4", {"int4": {"group": 16}}], ids=str)
@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 3), n=st.integers(6, 20), steps=st.integers(1, 10),
       per_head=st.integers(5, 10), page=st.sampled_from([2, 4]), d=st.sampled_from([16, 32]),
       seed=st.integers(0, 2 ** 16))
def test_fused_step_equals_reference_token_by_token(storage, b, h, g, n, steps, per_head, page, d, seed):
    """The engine with the fused step against reference.decode_step (entries x̂ = dequantize(quantize(x)))."""
    policy = kvcompile.load_spec("snapkv", per_head=per_head, storage=storage, **SMALL)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    q, k, v = rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d)
    cache, _, _ = token_by_token(policy, q, k, v, None, steps, rand, page)
    assert isinstance(cache.plan.decode_step, CppQuantStep)


@needs_cpp
def test_a_head_taking_a_fresh_page_runs_the_engines_path():
    """Past its spare pages a head takes a fresh page: the engine makes room before the step (the append's host
    read), and every step is one C++ call that equals the unfused path."""
    with counted() as calls:
        b, h, g, d, page, n = 2, 2, 3, 16, 2, 20
        policy = kvcompile.load_spec("snapkv", per_head=6, storage="int4", **SMALL)
        cache = one_layer(policy, b, h, g, d, page)  # no headroom given: one spare page per head
        gen = torch.Generator().manual_seed(3)
        rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
        mask = torch.ones(b, n, dtype=torch.bool)
        mask[1, :3] = False
        torch.ops.kvcompile.attend(rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d), mask, 0, cache.ref,
                                   cache.token, 0.25)
        other = unfused(cache)
        for _ in range(7):
            q, k, v = rand(b, h * g, 1, d), rand(b, h, 1, d), rand(b, h, 1, d)
            got = torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, 0.25)
            want = torch.ops.kvcompile.attend(q, k, v, None, 0, other.ref, other.token, 0.25)
            assert torch.equal(got, want)
            assert_same_store(cache.stores[0], other.stores[0])
        # 6 entries a head in 3 pages + 1 spare: 2 appends fit, the 3rd takes a run of pages, 1 more fits, ...:
        # every step the C++ one (the pages taken before it), none declined
        assert calls == [True] * 7
        assert sum(cache.host_syncs.values()) == sum(other.host_syncs.values()) == 3


@needs_cpp
@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_generate_gives_the_unfused_paths_tokens(storage):
    """On a model: the same tokens, logits and bytes with the fused step as with the engine's path, and the
    fused step ran every decode step of every layer (the plan names it)."""
    with counted() as calls:
        model = tiny_model()
        ids = prompt(40, batch=2)
        policy = kvcompile.load_spec("snapkv", per_head=8, storage=storage, **SMALL)
        runs = {}
        with torch.no_grad(), kvcompile.compiled(model, policy):
            plan = model.kvcompile_plan
            for fused in (True, False):
                cache = KVCompileCache.from_plan((plan if fused else dataclasses.replace(plan, decode_step=TorchStep()))
                                                 .with_headroom(12))
                out = model.generate(ids, past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                     return_dict_in_generate=True, output_logits=True)
                assert out.past_key_values is cache
                runs[fused] = out, cache.plan
                assert calls == ([True] * 11 * 3 if fused else [])  # 11 decode steps after the prompt's token, 3 layers
                calls.clear()
        (a, plan), (b, _) = runs[True], runs[False]
        assert isinstance(plan.decode_step, CppQuantStep) and isinstance(runs[False][1].decode_attention, pq.QuantPagedAttention)
        assert "online_impl: cpp, quantized pages" in plan.describe()
        assert torch.equal(a.sequences, b.sequences)
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        fused_report, unfused_report = a.past_key_values.memory_report(), b.past_key_values.memory_report()
        assert fused_report.keys() == unfused_report.keys()
        for key, value in fused_report.items():
            other = unfused_report[key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


# --- the plan ------------------------------------------------------------------------------

CONFIG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=6, head_dim=64,
                         hidden_size=384)
FP32 = dict(device="cpu", dtype=torch.float32)


def test_the_plan_chooses_the_fused_step_where_it_computes_the_policy():
    for spec, storage, bits, group in (("snapkv_int4", None, 4, 64), ("snapkv", "int8", 8, 64),
                                       ("adakv", {"int4": {"group": 32}}, 4, 32)):
        policy = kvcompile.load_spec(spec) if storage is None else kvcompile.load_spec(spec, storage=storage)
        plan = build_plan(policy, CONFIG, **FP32)
        if not CPP:
            assert plan.decode_step == TorchStep()
            continue
        assert plan.decode_step == CppQuantStep(bits, group, pq.PARALLEL_WORK) and plan.online_impl == "cpp"
        assert plan.step_rule.decay is None and plan.step_rule.alpha is None and not plan.step_rule.evict
        assert f"online_impl: cpp, quantized pages (int{bits}, {group} channels a scale)" in plan.describe()
        assert build_plan(policy, CONFIG, kernels="cpp", **FP32).decode_step == plan.decode_step
    tiered = [(kvcompile.load_spec("lava_mixed"), CppTieredStep(4, 64, None, False, pq.PARALLEL_WORK)),
              (kvcompile.load_spec("snapkv", storage={"mixed": {"full": 0.5, "bits": 8, "group": 16}}),
               CppTieredStep(8, 16, None, False, pq.PARALLEL_WORK)),
              (kvcompile.load_spec("lava_residual", storage="int8"),  # merge slots beside the codes
               CppTieredStep(8, 64, kvcompile.load_spec("lava_residual").merge.bias_alpha, True, pq.PARALLEL_WORK)),
              (kvcompile.load_spec("kivi"),  # keys per channel: the flush of a full group inside the step
               CppTieredStep(4, 64, None, False, pq.PARALLEL_WORK, residual=128))]
    for policy, step in tiered:
        plan = build_plan(policy, CONFIG, **FP32)
        assert plan.decode_step == (step if CPP else TorchStep()), policy.name
        if CPP:
            assert f"online_impl: cpp, two tiers (model dtype and int{step.bits}" in plan.describe()
    not_fused = [
        (kvcompile.load_spec("snapkv_int4"), dict(kernels="torch", **FP32)),  # asked for the torch lowerings
        (kvcompile.load_spec("snapkv_int4"), dict(device="cpu", dtype=torch.float16)),  # not fp32
        (kvcompile.load_spec("snapkv", storage={"int4": {"group": 8}}), FP32),  # a group the C++ kernel lacks
        (kvcompile.load_spec("lava_mixed"), dict(kernels="torch", **FP32)),
        (kvcompile.load_spec("kivi", storage={"kivi": {"group": 8}}), FP32),  # a value group the C++ kernel lacks
        (kvcompile.load_spec("kivi"), dict(kernels="torch", **FP32)),
        (kvcompile.load_spec("h2o", storage="int8"), FP32),  # running scores
    ]
    for policy, options in not_fused:
        assert build_plan(policy, CONFIG, **options).decode_step == TorchStep(), (policy.name, options)
    # no device yet: chosen when the first prompt binds it
    assert build_plan(kvcompile.load_spec("snapkv_int4"), CONFIG).decode_step is None


# --- two tiers (kvcompile.kernels.tiered_step) ---------------------------------------------------------------

TIERED = {  # storage, spec: mixed precision (appends to the float tier), codes beside merge slots (to the codes)
    "mixed_half_int4": ({"mixed": {"full": 0.5, "bits": 4}}, "snapkv"),
    "mixed_third_int8_g16": ({"mixed": {"full": 0.34, "bits": 8, "group": 16}}, "snapkv"),
    "mixed_all_codes": ({"mixed": {"full": 0.0, "bits": 4}}, "snapkv"),
    "mixed_all_float": ({"mixed": {"full": 1.0, "bits": 8}}, "snapkv"),
    "int4_slots": ("int4", "lava_residual"),
    "int8_g16_slots": ({"int8": {"group": 16}}, "lava_residual"),
    # KIVI: to the float tier, a full group of 16 (every page size's multiple) into the codes, keys per channel
    "kivi_int4_r4": ({"kivi": {"bits": 4, "residual": 4, "tokens": 16}}, "snapkv"),
    "kivi_int8_r0_g16": ({"kivi": {"bits": 8, "residual": 0, "tokens": 16, "group": 16}}, "snapkv"),
}


def tiered_policy(key: str, per_head: int, alpha: float = 0.6):
    storage, spec = TIERED[key]
    if spec == "lava_residual":  # its split's proximity is the recent window (ranking window 0)
        return kvcompile.load_spec(spec, per_head=per_head, storage=storage, scoring={"lava": {"window": 2}},
                                   merge={"residual": {"alpha": alpha}})
    return kvcompile.load_spec(spec, per_head=per_head, storage=storage, **SMALL)


def assert_same_tiers(got, want):
    assert_same_store(got.high, want.high)
    if not isinstance(got.low, ChannelCodeStore):
        assert_same_store(got.low, want.low)
        return
    # KIVI's codes: the torch flush (ChannelCodeStore.flush) writes every head's next page, used or not; the fused
    # step writes a flushing head's only. The pages heads hold bit for bit, and every counter and table.
    for name in ("block_table", "lengths", "owned", "slots"):
        assert torch.equal(getattr(got.low, name), getattr(want.low, name)), name
    assert (got.low.room, got.low.next_page, got.low.flush_room) == (want.low.room, want.low.next_page,
                                                                    want.low.flush_room)
    used = [int(p) for row, n in zip(got.low.block_table.flatten(0, 1), got.low.lengths.flatten())
            for p in row[:int(n) // got.low.page_size]]
    for name in PAGE_FIELDS[:9]:
        assert torch.equal(getattr(got.low, name)[used], getattr(want.low, name)[used]), name


@needs_cpp
@settings(max_examples=20, deadline=None)
@given(key=st.sampled_from(sorted(TIERED)), d=st.sampled_from([16, 32, 64]), b=st.integers(1, 3), h=st.integers(1, 3),
       g=st.integers(1, 4), page=st.sampled_from([2, 4, 16]), per_head=st.integers(6, 20), extra=st.integers(-3, 12),
       steps=st.integers(1, 18), pad=st.integers(0, 4), alpha=st.sampled_from([0.0, 0.6, 1.0]),
       magnitude=st.sampled_from([1e-3, 1.0, 50.0]), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_tiered_step_equals_the_unfused_path(key, d, b, h, g, page, per_head, extra, steps, pad, alpha, magnitude,
                                             threads, seed):
    """Both tiers bit for bit as the engine's path leaves them (appends to the float tier, or quantized into the
    codes exactly as the torch quantizer does it; pages taken past the spares), and the attention over both
    tiers (the merge bias on the slots) equal to TieredPagedAttention's up to float summation order."""
    with counted(tiered_step_module, "tiered_step_cpp") as calls:
        policy = tiered_policy(key, per_head, alpha)
        gen = torch.Generator().manual_seed(seed)
        rand = lambda *shape: torch.randn(*shape, generator=gen) * magnitude  # noqa: E731
        scale = d ** -0.5
        cache, other = prefilled(policy, b, h, g, d, page, max(4, per_head + extra), pad, rand, scale)
        assert isinstance(cache.plan.decode_step, CppTieredStep)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for _ in range(steps):
                q, k, v = rand(b, h * g, 1, d) / magnitude ** 2, rand(b, h, 1, d), rand(b, h, 1, d)  # logits ~ 1
                got = torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, scale)
                want = torch.ops.kvcompile.attend(q, k, v, None, 0, other.ref, other.token, scale)
                assert_same_tiers(cache.stores[0], other.stores[0])
                if cache.plan.decode_step.append_low:
                    assert_quantized_as_torch(cache.stores[0].low, k[:, :, 0], v[:, :, 0], cache.plan.decode_step.bits,
                                              cache.plan.decode_step.group)
                assert_close(got, want, rtol=1e-5, atol=1e-5 * magnitude)
        finally:
            torch.set_num_threads(before)
        assert True in calls  # the C++ step ran (and the engine's path where a head took a fresh page)


@needs_cpp
@pytest.mark.parametrize("key", sorted(TIERED))
@settings(max_examples=3, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 3), n=st.integers(8, 20), steps=st.integers(1, 10),
       per_head=st.integers(6, 10), page=st.sampled_from([2, 4]), seed=st.integers(0, 2 ** 16))
def test_tiered_step_equals_reference_token_by_token(key, b, h, g, n, steps, per_head, page, seed):
    """The engine with the fused two-tier step against reference.decode_step (reference.tiers' split)."""
    policy = tiered_policy(key, per_head)
    d = 16
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    q, k, v = rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d)
    cache, _, _ = token_by_token(policy, q, k, v, None, steps, rand, page)
    assert isinstance(cache.plan.decode_step, CppTieredStep)


@needs_cpp
@settings(max_examples=8, deadline=None)
@given(bits=st.sampled_from([4, 8]), page=st.sampled_from([2, 4]), groups=st.integers(1, 3),
       residual=st.sampled_from([0, 3, 8]), b=st.integers(1, 2), h=st.integers(1, 3), g=st.integers(1, 2),
       per_head=st.integers(6, 14), pad=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_kivis_flush_inside_the_fused_step_is_the_torch_flush(bits, page, groups, residual, b, h, g, per_head, pad,
                                                               seed):
    """KIVI in the fused step (kernels.tiered_step, keys per channel): over steps enough for several flushes of
    every head (a group of `page · groups` tokens each), both tiers as the torch step leaves them (the codes of a
    flushed group bit for bit: keys per channel, values per entry; the float tier's rotated block table) and the
    attention equal to TieredPagedAttention's."""
    tokens, d = page * groups, 16
    policy = kvcompile.load_spec("snapkv", per_head=per_head, **SMALL,
                                 storage={"kivi": {"bits": bits, "residual": residual, "tokens": tokens}})
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    scale = d ** -0.5
    with counted(tiered_step_module, "tiered_step_cpp") as calls:
        cache, other = prefilled(policy, b, h, g, d, page, per_head + 4, pad, rand, scale)
        step = cache.plan.decode_step
        assert isinstance(step, CppTieredStep) and step.residual == residual and not step.append_low
        flushed = cache.stores[0].low.lengths.clone()
        # a head's float tier may hold fewer than `residual` after the prompt (per_head < residual): it flushes
        # first at residual + tokens, then every `tokens` steps, so residual + 3 · tokens steps flush it 3 times
        for _ in range(residual + 3 * tokens + 1):
            q, k, v = rand(b, h * g, 1, d), rand(b, h, 1, d), rand(b, h, 1, d)
            got = torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, scale)
            want = torch.ops.kvcompile.attend(q, k, v, None, 0, other.ref, other.token, scale)
            assert_same_tiers(cache.stores[0], other.stores[0])
            assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert bool((cache.stores[0].low.lengths - flushed >= 3 * tokens).all())  # every head flushed 3 times
    assert True in calls
