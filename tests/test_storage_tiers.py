"""Tiered storage parts: two precisions in one head (mixed by score, MiKV; KIVI's keys per channel with a
full-precision recent window).

The engine keeps each head's entries in two page stores (kvcompile.store.tiers.TieredStore): the high
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
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from kvcompile.plan import PlanError, build_plan
from kvcompile.store.tiers import TieredStore
from test_chunked import chunked_policy, run_both
from test_decode import assert_same_cache, token_by_token
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
MERGING = {  # residual slots beside codes: the slots' running means in the high tier
    "lava_residual": dict(name="lava_residual", scoring={"lava": {"window": 2}}),
    "snapkv_residual": dict(name="lava_residual", scoring={"window_attention": {"window": 2}}),
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


@pytest.mark.parametrize("storage", MIXED[:2], ids=str)
@settings(max_examples=12, deadline=None)
@given(key=st.sampled_from(["snapkv", "adakv", "lava", "pyramidkv"]), b=st.integers(1, 2), h=st.integers(1, 2),
       g=st.integers(1, 2), n=st.integers(5, 20), chunk=st.integers(2, 6), per_head=st.integers(4, 8),
       page=st.sampled_from([2, 4]), pad=st.integers(1, 9), steps=st.integers(0, 4), seed=st.integers(0, 2 ** 16))
@example(key="snapkv", b=2, h=1, g=1, n=9, chunk=2, per_head=4, page=2, pad=3, steps=0, seed=3)  # a tie (below)
def test_mixed_tiers_on_a_left_padded_prompt_in_chunks_equal_the_reference(storage, key, b, h, g, n, chunk, per_head,
                                                                           page, pad, steps, seed):
    """Two tiers by score, a prompt compressed chunk by chunk on a left-padded batch (the first row padded, maybe
    over whole chunks): every chunk's attention and every layer's entries, each in its tier, are the reference's,
    then decode steps."""
    from test_chunked import POLICIES as CHUNKED

    spec = dict(CHUNKED[key])
    policy = kvcompile.load_spec(spec.pop("name"), per_head=per_head, storage=storage,
                                 schedule={"prefill": {"chunk": chunk}}, **spec)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :min(pad, n - 1)] = False
    cache = run_both(policy, 2, b, h, g, n, 8, mask, page, rand, steps)
    assert isinstance(cache.stores[0], TieredStore)


def test_a_tie_in_the_pooled_scores_of_a_padded_row_goes_to_the_later_position():
    """The case Hypothesis found: on the padded row, after its second real chunk, a head holds 3 tokens whose
    pooled scores are one mean (the pooling window covers all 3: an exact tie); of the 3, round(0.5 · 3) = 2 stay
    floats, the later positions 1 and 2, and position 0 is codes, in the engine and the reference alike.
    Summing each pooling window in one order keeps the tie a tie whatever the row's padding; a reduction's
    order (`.sum(-1)` over the windows) made position 0's mean one ulp above the others' in the reference
    alone, which put it in the float tier there."""
    from test_chunked import config_for

    policy = kvcompile.load_spec(chunked_policy("snapkv", 4, 2), storage=MIXED[0])
    gen = torch.Generator().manual_seed(4)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    cache = KVCompileCache(policy, config_for(1, 1, 1, 8), page_size=2)
    cache.expect_prompt(9)
    ref = reference.ChunkedPrefill(policy, 1)
    for start in range(0, 6, 2):
        q, k, v = rand(2, 1, 2, 8), rand(2, 1, 2, 8), rand(2, 1, 2, 8)
        torch.ops.kvcompile.attend(q, k, v, mask[:, :start + 2], 0, cache.ref, cache.token, 8 ** -0.5)
        ref.step(0, q, k, v, mask[:, start:start + 2], 8 ** -0.5)
    held = ref.heads[0][0][0]
    assert held.positions.tolist() == [0, 1, 2] and len(set(held.scores.tolist())) == 1  # the tie, bit for bit
    store = cache.stores[0]
    high = store.high.gather()[3][0, 0]
    assert sorted(high[high >= 0].tolist()) == [1, 2]
    low = store.low.gather()[3][0, 0]
    assert low[low >= 0].tolist() == [0]
    assert_same_cache(store.to_heads(), ref.heads[0])


CONFIG = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, num_attention_heads=1, head_dim=8, hidden_size=8)


@pytest.mark.parametrize("spec, overrides, why", [
    ("h2o", {"storage": {"mixed": {"full": 0.5}}}, "running scores"),
    ("zsmerge", {"storage": {"mixed": {"full": 0.5}}}, "decayed updates every entry's score while decoding"),
    ("lava_residual", {"storage": "kivi"}, "merge: residual keeps slots in the full-precision tier"),
    ("snapkv", {"storage": "kivi", "schedule": {"decode": {"every": {"n": 2}}}}, "decode: every re-selects"),
    ("snapkv", {"storage": {"kivi": {"tokens": 24}}}, "multiple of the page size 16"),
    ("snapkv", {"storage": {"mixed": {"group": 3}}}, "group 3 does not divide the head dim 8"),
])
def test_what_cannot_run_is_refused_before_anything_runs(spec, overrides, why):
    with pytest.raises(PlanError, match=why):
        build_plan(kvcompile.load_spec(spec, **overrides), CONFIG)


def test_spec_errors_name_the_file_line_and_field(tmp_path):
    spec = tmp_path / "m.yaml"
    spec.write_text("scoring: window_attention\nbudget: {per_head: 8}\nstorage: {mixed: {full: 1.5}}\n")
    with pytest.raises(kvcompile.spec.SpecError, match=r"m.yaml:3: storage.mixed.full"):
        kvcompile.load_spec(spec)
    spec.write_text("scoring: window_attention\nbudget: {per_head: 8}\nstorage: {kivi: {bits: 2}}\n")
    with pytest.raises(kvcompile.spec.SpecError, match=r"m.yaml:3: storage.kivi.bits"):
        kvcompile.load_spec(spec)


def test_the_split_is_the_parts_rule():
    """mixed: the round(full · n) best-scored tokens stay floats (ties to the later position); kivi: L(n)."""
    part = kvcompile.load_spec("snapkv", storage={"mixed": {"full": 0.4}}).storage
    assert [part.high_count(n) for n in (0, 1, 2, 5, 10)] == [0, 0, 1, 2, 4]  # round half to even: 0.4 → 0
    kivi = kvcompile.load_spec("kivi").storage
    assert [kivi.quantized_count(n) for n in (0, 127, 128, 159, 160, 200)] == [0, 0, 0, 0, 32, 64]
    from kvcompile.store import Entries
    from kvcompile.store.tiers import high_tier

    scores = torch.tensor([[[0.5, 0.9, 0.5, 0.1, 0.7]]])
    take = torch.tensor([[[True, True, True, True, False]]])
    src = Entries(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), scores, torch.arange(5)[None, None],
                  torch.ones(1, 1, 5), take)
    mixed = kvcompile.load_spec("snapkv", storage={"mixed": {"full": 0.5}}).storage
    assert high_tier(mixed, src).tolist() == [[[False, True, True, False, False]]]  # 0.9, then the later 0.5


def test_bytes_are_the_arithmetic_and_split_by_precision():
    """A tiered store's bytes: its float pages, and its codes with their scales (KIVI's keys: two float32 per
    channel a page of `tokens` entries); memory_report() splits bytes_held by precision."""
    d, h, page = 16, 2, 4
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h, head_dim=d,
                             hidden_size=h * d)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 30, d, generator=gen) for _ in range(3))
    for storage, low_entry in (({"mixed": {"full": 0.25, "bits": 8}}, 2 * (16 + 8)),
                               ({"kivi": {"bits": 4, "residual": 4, "tokens": 8}}, None)):
        policy = kvcompile.load_spec("snapkv", per_head=20, storage=storage, **SMALL)
        cache = KVCompileCache(policy, config, page_size=page)
        torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, d ** -0.5)
        store = cache.stores[0]
        hi, lo = store.high, store.low
        high_pages, low_pages = int(hi.pages_per_head().sum()), int(lo.pages_per_head().sum())
        if low_entry is None:  # kivi: keys d/2 bytes of codes, values d/2 + 8; per page 2·4·d of key scales
            assert lo.page_size == 8 and lo.k_scale.shape[1:] == (d,)
            low_page = 8 * (d // 2 + d // 2 + 8) + 2 * 4 * d
            assert lo.lengths.tolist() == [[16, 16]] and hi.lengths.tolist() == [[4, 4]]  # L(20) = 16
        else:
            low_page = page * low_entry
            assert hi.lengths.tolist() == [[5, 5]] and lo.lengths.tolist() == [[15, 15]]  # round(0.25 · 20) = 5
        report = cache.memory_report()
        assert report["bytes_by_precision"] == {"model_dtype": high_pages * page * 2 * d * 4,
                                                f"int{policy.storage.bits}": low_pages * low_page}
        assert report["bytes_held"] == sum(report["bytes_by_precision"].values())
        assert report["bytes_full"] == 30 * h * 2 * d * 4


@pytest.mark.parametrize("storage", [{"mixed": {"full": 1.0}}, {"kivi": {"residual": 4096}}], ids=str)
@pytest.mark.parametrize("beams", [1, 2])
def test_everything_in_full_precision_is_the_plain_model(storage, beams):
    """A budget covering the sequence with every entry in the high tier: generate() (greedy and beam search,
    whose row copies run TieredStore.rows) gives the plain model's tokens and logits."""
    model = tiny_model("llama", layers=2)
    ids = prompt(40, seed=3)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=beams, return_dict_in_generate=True,
              output_logits=True)
    with torch.no_grad():
        plain = model.generate(ids, **kw)
        policy = kvcompile.load_spec("snapkv", per_head=4096, storage=storage, **SMALL)
        with kvcompile.compiled(model, policy):
            got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, plain.sequences)
    for a, b in zip(plain.logits, got.logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert type(got.past_key_values.stores[0]).__name__ == "TieredStore"


@pytest.mark.parametrize("name", ["kivi", "lava_mixed", "snapkv_int4"])
def test_shipped_precision_specs_generate_within_fewer_bytes(name):
    """The shipped specs on a tiny model: generate() runs, and the cache holds fewer bytes than the same
    policy in the model's dtype, in the precisions the spec names."""
    model = tiny_model("llama", layers=2)
    ids = prompt(300, seed=4)
    held = {}
    for storage in ("model_dtype", None):
        overrides = {} if storage is None else {"storage": storage}
        policy = kvcompile.load_spec(name, **overrides)
        if name != "kivi":
            policy = kvcompile.load_spec(name, per_head=64, **overrides)
        with torch.no_grad(), kvcompile.compiled(model, policy):
            out = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                 return_dict_in_generate=True)
        report = out.past_key_values.memory_report()
        held[storage] = report["bytes_held"]
        if storage is None:
            assert set(report["bytes_by_precision"]) == ({"int4"} if name == "snapkv_int4" else {"model_dtype", "int4"})
        if name == "kivi" and storage is None:  # nothing evicted: a head holds every token, the first L(n) as codes
            store = out.past_key_values.stores[0]
            n = ids.shape[1] + 39
            assert store.lengths.flatten().tolist() == [n] * store.lengths.numel()
            assert store.low.lengths.flatten().tolist() == [policy.storage.quantized_count(n)] * store.lengths.numel()
    assert held[None] < held["model_dtype"]


@pytest.mark.parametrize("name", ["kivi", "lava_mixed", "snapkv_int4"])
def test_under_autocast_the_precision_specs_stay_close_to_their_fp32_run(name):
    """An fp32 model under torch.autocast(bfloat16): the float tier in bf16, the codes' attention in fp32 (the
    torch backend: the C++ kernel takes fp32 queries); logits within bf16 rounding of the fp32 run of the same
    spec, and with KIVI's whole sequence in its full-precision tier, of the plain model under autocast."""
    model = tiny_model("llama", layers=2)
    ids = prompt(60, seed=6)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    policy = kvcompile.load_spec(name, per_head=40) if name != "kivi" else kvcompile.load_spec(name)
    with torch.no_grad():
        with kvcompile.compiled(model, policy):
            fp32 = model.generate(ids, **kw)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = model.generate(ids, **kw)
            with kvcompile.compiled(model, policy):
                got = model.generate(ids, **kw)
    want = plain if name == "kivi" else fp32  # kivi: 66 tokens < residual 128, all in the float tier
    for a, b in zip(want.logits, got.logits):
        torch.testing.assert_close(b.float(), a.float(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("storage", [{"mixed": {"full": 0.5, "bits": 4}}, {"kivi": {"residual": 8, "tokens": 16}},
                                     "int4"], ids=str)
def test_continuous_batching_equals_generate(storage):
    """Three requests through transformers' continuous-batching engine (kvcompile.integrations.batching) under a precision
    part: each gives what it gives alone through generate(), and every block comes back."""
    from test_serving import compiled, prompts, reference, serve

    model = compiled("adakv", per_head=40, storage=storage)
    ids = prompts([150, 90, 190])
    tokens, report = serve(model, ids, max_batch_tokens=96)
    assert tokens == [reference(model, x) for x in ids]
    assert report["requests"] == {}


@pytest.mark.parametrize("storage", [{"mixed": {"full": 0.5, "bits": 4}}, {"kivi": {"residual": 8, "tokens": 16}}],
                         ids=str)
def test_a_continued_cache_equals_one_generation(storage):
    """generate() continued from its own returned cache (a second turn) gives the tokens of one longer
    generate() over the same ids: the tiers carry over (KIVI's groups keep leaving the float tier)."""
    model = tiny_model("llama", layers=2)
    ids = prompt(80, seed=9)
    kw = dict(do_sample=False, return_dict_in_generate=True)
    policy = kvcompile.load_spec("snapkv", per_head=30, storage=storage, **SMALL)
    with torch.no_grad(), kvcompile.compiled(model, policy):
        whole = model.generate(ids, max_new_tokens=30, min_new_tokens=30, **kw)
        first = model.generate(ids, max_new_tokens=12, min_new_tokens=12, **kw)
        second = model.generate(first.sequences, past_key_values=first.past_key_values, max_new_tokens=18,
                                min_new_tokens=18, **kw)
    assert torch.equal(second.sequences, whole.sequences)


@pytest.mark.parametrize("storage", MIXED + KIVI + [{"mixed": {"full": 0.9, "bits": 4, "group": 2}}], ids=str)
@pytest.mark.parametrize("name", ["snapkv", "adakv", "lava"])
def test_what_serving_reserves_for_a_prompt_covers_its_two_tiers(storage, name):
    """serving.prompt_bound_bytes (a request's admission) is at least the bytes a tiered cache holds after
    the prompt, for lengths around page and group boundaries."""
    from kvcompile.integrations.batching import prompt_bound_bytes

    d, h, g, layers = 16, 2, 2, 2
    config = SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    spec = dict(POLICIES[name])
    policy = kvcompile.load_spec(spec.pop("name"), per_head=9, storage=storage, **spec)
    gen = torch.Generator().manual_seed(0)
    for n in (5, 9, 16, 17, 33, 40):
        cache = KVCompileCache(policy, config, page_size=4)
        for layer in range(layers):
            q, k, v = torch.randn(1, h * g, n, d, generator=gen), *(torch.randn(1, h, n, d, generator=gen) for _ in "kv")
            torch.ops.kvcompile.attend(q, k, v, None, layer, cache.ref, cache.token, d ** -0.5)
        held = sum(s.nbytes for s in cache.stores)
        assert held <= prompt_bound_bytes(cache.plan, n, 4, h * g, chunked=False), n


@pytest.mark.parametrize("storage", ["int4", {"int8": {"group": 4}}, MIXED[0]], ids=str)
@settings(max_examples=8, deadline=None)
@given(key=st.sampled_from(sorted(MERGING)), b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 2),
       n=st.integers(8, 24), steps=st.integers(1, 8), per_head=st.integers(6, 12), page=st.sampled_from([2, 4]),
       d=st.sampled_from([8, 16]), seed=st.integers(0, 2 ** 16))
def test_merge_slots_beside_codes_equal_the_reference(storage, key, b, h, g, n, steps, per_head, page, d, seed):
    """A prompt merge (residual slots, ZSMerge's rule at prefill) with quantized tokens: the slots' running
    means stay in the model's dtype (the high tier, with the merge bias α·log w), the tokens as codes."""
    policy = policy_for(MERGING[key], storage, per_head)
    rand, (q, k, v) = random_heads(seed, b, h, g, n, d)
    cache, _, _ = token_by_token(policy, q, k, v, None, steps, rand, page)
    store = cache.stores[0]
    assert type(store).__name__ == "TieredStore" and torch.equal(store.slots, store.high.slots)


@pytest.mark.parametrize("storage", [{"kivi": {"bits": 8, "residual": 4, "tokens": 4}}, MIXED[0]], ids=str)
def test_decode_steps_replay_from_a_captured_graph(monkeypatch, storage):
    """A tiered layer's decode step (KIVI's flushes included: a group leaves the float tier every 4 steps) is
    a pure function of the cache's tensors: traced once (make_fx) and replayed for the next steps, it keeps
    what eager decoding keeps (tests/test_decode_graph.py's run), with no step needing the host."""
    import test_decode_graph as graph

    name = "kivi" if "kivi" in storage else "snapkv"
    policy = kvcompile.load_spec(name, storage=storage) if name == "kivi" else \
        kvcompile.load_spec(name, per_head=48, storage=storage, **SMALL)
    monkeypatch.setattr(graph, "small_budget", lambda _: policy)
    cache, eager, traced, replayed = graph.decode_replayed(tiny_model("llama", layers=2), name)
    assert eager[1:] == [] and (traced, replayed) == (1, graph.STEPS - 1)
    store = cache.stores[0]
    if name == "kivi":  # the groups left as the count says
        for n_h, low in zip(store.lengths.flatten().tolist(), store.low.lengths.flatten().tolist()):
            assert low == policy.storage.quantized_count(n_h) > 0
