"""Tiered storage parts: two precisions in one head (mixed by score, MiKV; KIVI's keys per channel with a
full-precision recent window).

The engine keeps each head's entries in two page stores (kvcompile.engine.tiers.TieredStore): the high
tier in the model's dtype, the low tier as codes; the reference keeps every entry's values as the split
gives them (reference.tiers). Token by token, every allocator family, the cascade, decode-time pruning
(mixed) and a prompt compressed in chunks hold the same entries as the reference, and the attention over
both tiers (combined by log-sum-exp) agrees with the reference's over the entries as stored. KIVI's groups
leave the full-precision tier as the count says; bytes are the arithmetic's; what cannot run is refused
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
from kvcompile.plan import PlanError, build_plan
from test_chunked import chunked_policy, run_both
from test_decode import token_by_token
from tiny import prompt, tiny_model

SMALL = {"ranking": {"by_score": {"window": 2}}, "scoring": {"window_attention": {"window": 2}}}
POLICIES = {  # every allocator family, a cascade, a threshold
    "snapkv": dict(name="snapkv", **SMALL),
    "adakv": dict(name="adakv", **SMALL),
    "pyramidkv": dict(name="pyramidkv", **SMALL),
    "lava": dict(name="lava", ranking={"by_score": {"window": 2}}, scoring={"lava": {"window": 2}},
                 schedule={"cascade": True}),
    "dbudgetkv": dict(name="dbudgetkv", budget={"threshold": {"attention_norm": {"keep_layers": 0}}},
                      ranking={"by_position": {"window": 1}}),
}
EVERY = {  # decode-time pruning: the split is made again (mixed only)
    "adakv_every": dict(name="adakv", ranking={"by_score": {"window": 4}}, scoring={"window_attention": {"window": 4}},
                        schedule={"decode": {"every": {"n": 2}}}),
    "lava_every": dict(name="lava", ranking={"by_score": {"window": 2}}, scoring={"lava": {"window": 2}},
                       schedule={"cascade": True, "decode": {"every": {"n": 3}}}),
}
MIXED = [{"mixed": {"full": 0.5, "bits": 4}}, {"mixed": {"full": 0.25, "bits": 8, "group": 4}},
         {"mixed": {"full": 0.0}}, {"mixed": {"full": 1.0}}]
KIVI = [{"kivi": {"bits": 4, "residual": 4, "tokens": 4}}, {"kivi": {"bits": 8, "residual": 0, "tokens": 4}},
        {"kivi": {"bits": 4, "residual": 3, "tokens": 8, "group": 4}}]


def policy_for(spec: dict, storage, per_head: int):
    spec = dict(spec)
    name = spec.pop("name")
    if kvcompile.load_spec(name).budget.threshold is None:
        spec["per_head"] = per_head
    return kvcompile.load_spec(name, storage=storage, **spec)


def random_heads(seed, b, h, g, n, d):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    return rand, (rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d))


@pytest.mark.parametrize("storage", MIXED, ids=str)
@settings(max_examples=8, deadline=None)
@given(key=st.sampled_from(sorted(POLICIES) + sorted(EVERY)), b=st.integers(1, 2), h=st.integers(1, 2),
       g=st.integers(1, 2), n=st.integers(6, 20), steps=st.integers(1, 8), per_head=st.integers(5, 10),
       page=st.sampled_from([2, 4]), d=st.sampled_from([8, 16]), seed=st.integers(0, 2 ** 16))
def test_mixed_engine_equals_reference_token_by_token(storage, key, b, h, g, n, steps, per_head, page, d, seed):
    """d = 16: the codes' attention by the C++ kernel (where a compiler is); d = 8: the eager reference."""
    policy = policy_for({**POLICIES, **EVERY}[key], storage, per_head)
    rand, (q, k, v) = random_heads(seed, b, h, g, n, d)
    cache, _, _ = token_by_token(policy, q, k, v, None, steps, rand, page)
    store = cache.stores[0]
    assert store.low.k_pages.dtype == torch.uint8 and store.high.k_pages.dtype == torch.float32


@pytest.mark.parametrize("storage", KIVI, ids=str)
@settings(max_examples=8, deadline=None)
@given(key=st.sampled_from(sorted(POLICIES)), b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 2),
       n=st.integers(6, 24), steps=st.integers(1, 20), per_head=st.integers(5, 12), page=st.sampled_from([2, 4]),
       d=st.sampled_from([8, 16]), seed=st.integers(0, 2 ** 16))
def test_kivi_engine_equals_reference_token_by_token(storage, key, b, h, g, n, steps, per_head, page, d, seed):
    """Groups leave the full-precision tier while decoding: the low tier holds L(n) entries of each head."""
    policy = policy_for(POLICIES[key], storage, per_head)
    rand, (q, k, v) = random_heads(seed, b, h, g, n, d)
    cache, _, _ = token_by_token(policy, q, k, v, None, steps, rand, page)
    store = cache.stores[0]
    part = policy.storage
    for n_h, low in zip(store.lengths.flatten().tolist(), store.low.lengths.flatten().tolist()):
        assert low == part.quantized_count(n_h)
    assert store.low.k_scale.shape[1:] == (d,)  # keys per channel: one scale per page and channel


@pytest.mark.parametrize("storage", [MIXED[0], KIVI[0]], ids=str)
@settings(max_examples=5, deadline=None)
@given(key=st.sampled_from(["snapkv", "lava"]), n=st.integers(8, 24), chunk=st.integers(3, 8),
       steps=st.integers(0, 6), seed=st.integers(0, 2 ** 16))
def test_a_prompt_compressed_in_chunks_equals_the_reference(storage, key, n, chunk, steps, seed):
    """Each chunk reads the held entries as stored and splits them again."""
    policy = kvcompile.load_spec(chunked_policy(key, 5, chunk), storage=storage)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    run_both(policy, 2, 1, 2, 2, n, 8, None, 4, rand, steps)
