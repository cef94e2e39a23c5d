"""Storage parts (precision as a part of a policy): int8 and int4 pages mixed with eviction.

The engine keeps every kept key and value as integer codes with a scale and zero point per group; the
reference keeps x̂ = dequantize(quantize(x)) (reference.stored). Token by token, every policy family
(uniform, pooled and pyramid heads, a cascade, a threshold, running scores, decode-time pruning, a prompt
compressed in chunks) holds the same entries as the reference, and its attention agrees with the
reference's over the dequantized entries; the bytes are the arithmetic's; what cannot run is refused
before anything runs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from kvcompile.store import ENTRY_METADATA_BYTES
from kvcompile.kernels.quantize import dequantize, quantize
from kvcompile.plan import PlanError, build_plan
from kvcompile.spec import SpecError, loads_spec
from test_chunked import chunked_policy, run_both
from test_decode import token_by_token
from tiny import prompt, tiny_model

SMALL = {"ranking": {"by_score": {"window": 2}}, "scoring": {"window_attention": {"window": 2}}}
POLICIES = {  # every allocator family, running scores, decode-time pruning
    "snapkv": dict(name="snapkv", **SMALL),
    "adakv": dict(name="adakv", **SMALL),
    "pyramidkv": dict(name="pyramidkv", ranking={"by_score": {"window": 2}},
                      scoring={"window_attention": {"window": 2}}),
    "lava_every": dict(name="lava", ranking={"by_score": {"window": 2}}, scoring={"lava": {"window": 2}},
                       schedule={"cascade": True, "decode": {"every": {"n": 3}}}),
    "dbudgetkv": dict(name="dbudgetkv", budget={"threshold": {"attention_norm": {"keep_layers": 0}}},
                      ranking={"by_position": {"window": 1}}),
    "h2o": dict(name="h2o", ranking={"by_score": {"window": 2}}),
}
STORAGE = ["int8", "int4", {"int8": {"group": 4}}, {"int4": {"group": 4}}]


def policy_for(key: str, storage, per_head: int):
    spec = dict(POLICIES[key])
    name = spec.pop("name")
    if kvcompile.load_spec(name).budget.threshold is None:
        spec["per_head"] = per_head
    return kvcompile.load_spec(name, storage=storage, **spec)


def test_the_quantizer_is_the_formula():
    x = torch.tensor([[-1.0, 0.5, 2.0, 3.0], [4.0, 4.0, 4.0, 4.0]])
    q = quantize(x, 8)
    lo = torch.tensor([[-1.0], [4.0]])
    scale = torch.tensor([[4.0 / 255], [1.0]])  # a constant group: scale 1, every code 0
    assert torch.equal(q.scale, scale) and torch.equal(q.zero, lo)
    assert torch.equal(q.codes, torch.round((x - lo) / scale).clamp(0, 255).to(torch.uint8))
    assert torch.equal(dequantize(q.codes, q.scale, q.zero, 8), q.codes.float() * scale + lo)
    assert torch.equal(reference.stored(kvcompile.load_spec("snapkv", storage="int8").storage, x),
                       q.codes.float() * scale + lo)


@pytest.mark.parametrize("storage", STORAGE, ids=str)
@settings(max_examples=8, deadline=None)
@given(key=st.sampled_from(sorted(POLICIES)), b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 2),
       n=st.integers(6, 20), steps=st.integers(1, 8), per_head=st.integers(5, 10), page=st.sampled_from([2, 4]),
       d=st.sampled_from([8, 16]), seed=st.integers(0, 2 ** 16))
def test_engine_equals_reference_token_by_token(storage, key, b, h, g, n, steps, per_head, page, d, seed):
    """d = 16: decode attention by the C++ kernel over quantized pages (where a compiler is); d = 8: the
    eager reference backend (dequantize, then attend)."""
    policy = policy_for(key, storage, per_head)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    q, k, v = rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d)
    cache, _, _ = token_by_token(policy, q, k, v, None, steps, rand, page)
    assert cache.stores[0].k_pages.dtype == torch.uint8  # codes in the pages, not floats


@pytest.mark.parametrize("storage", ["int8", "int4"])
@settings(max_examples=6, deadline=None)
@given(key=st.sampled_from(["snapkv", "lava"]), n=st.integers(8, 24), chunk=st.integers(3, 8),
       steps=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_a_prompt_compressed_in_chunks_equals_the_reference(storage, key, n, chunk, steps, seed):
    """Each chunk reads the held entries as stored (dequantized) and the pages hold them as codes."""
    base = chunked_policy(key, 5, chunk)
    policy = kvcompile.load_spec(base, storage=storage)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    run_both(policy, 2, 1, 2, 2, n, 8, None, 4, rand, steps)


def test_bytes_are_the_arithmetic():
    """A quantized store's bytes: per entry d·bits/8 bytes of codes and two float32 per group, for K and V."""
    d, h, page = 16, 2, 4
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h, head_dim=d,
                             hidden_size=h * d)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 30, d, generator=gen) for _ in range(3))
    reports = {}
    for storage in ("model_dtype", "int8", "int4", {"int4": {"group": 8}}):
        policy = kvcompile.load_spec("snapkv", per_head=10, storage=storage, **SMALL)
        cache = KVCompileCache(policy, config, page_size=page)
        torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, d ** -0.5)
        store, part = cache.stores[0], policy.storage
        groups = d // part.group_size(d)
        entry = 2 * d * 4 if not part.quantizes else 2 * (d * part.bits // 8 + 2 * 4 * groups)
        assert store.kv_entry_bytes == entry == part.entry_bytes(d, 4)
        pages = int(store.pages_per_head().sum())
        report = cache.memory_report()
        assert report["bytes_held"] == pages * page * entry
        assert report["bytes_entries"] == int(store.lengths.sum()) * entry
        assert report["bytes_allocated"] == store.k_pages.shape[0] * page * entry
        assert store.nbytes == store.k_pages.shape[0] * page * (entry + ENTRY_METADATA_BYTES) + \
            store.block_table.nbytes + 3 * store.lengths.nbytes
        reports[str(storage)] = report["bytes_held"]
    assert reports["int8"] * 128 == reports["model_dtype"] * 48  # per entry 2 (16 + 8) bytes against 2 · 16 · 4
    assert reports["int4"] < reports["int8"] < reports["model_dtype"]


def test_spec_errors_name_the_file_line_and_field(tmp_path):
    spec = tmp_path / "q.yaml"
    spec.write_text("scoring: window_attention\nbudget: {per_head: 8}\nstorage: {int4: {group: -2}}\n")
    with pytest.raises(SpecError, match=r"q.yaml:3: storage.int4.group"):
        kvcompile.load_spec(spec)
    spec.write_text("scoring: window_attention\nbudget: {per_head: 8}\nstorage: int3\n")
    with pytest.raises(SpecError, match=r"q.yaml:3: storage: unknown storage part 'int3'"):
        kvcompile.load_spec(spec)
    policy = kvcompile.load_spec("snapkv", storage={"int4": {"group": 32}})
    assert loads_spec(policy.to_yaml()) == policy


@pytest.mark.parametrize("spec, overrides, why", [
    ("zsmerge", {"storage": "int8"}, "decayed updates every entry's score while decoding"),
    ("snapkv", {"storage": {"int8": {"group": 3}}}, "group 3 does not divide the head dim 8"),
])
def test_what_cannot_run_is_refused_before_anything_runs(spec, overrides, why):
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, num_attention_heads=1, head_dim=8,
                             hidden_size=8)
    with pytest.raises(PlanError, match=why):
        build_plan(kvcompile.load_spec(spec, **overrides), config)


def test_generate_on_a_model_holds_fewer_bytes_and_the_plan_says_how():
    model = tiny_model()
    ids = prompt(40)
    held = {}
    for storage in ("model_dtype", "int8", "int4"):
        with torch.no_grad(), kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=8, storage=storage, **SMALL)):
            out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 return_dict_in_generate=True)
            describe = model.kvcompile_plan.describe()
        assert out.sequences.shape[1] == ids.shape[1] + 6
        held[storage] = out.past_key_values.memory_report()["bytes_held"]
        assert f"storage: {kvcompile.load_spec('snapkv', storage=storage).storage}" in describe
    assert held["int4"] < held["int8"] < held["model_dtype"]
