"""Merges, quantized pages and a prompt compressed in chunks on models that soft-cap their attention logits
(Gemma 2: cap·tanh(s/cap) before the softmax) or have learned attention sinks (gpt-oss: one logit per query head
in the softmax's denominator). The semantics (reference.decode_attention): a merge slot's logit bias (α·log w)
is added after the cap, so a slot of w tokens weighs w^α·exp(capped logit), and the sinks only join the
denominator. The plan chooses the eager torch lowerings that apply them (no C++ or Triton kernel does); the
engine equals the reference (token by token, chunk by chunk) under a cap, under sinks and under both; at a
budget that keeps everything the tiny Gemma 2 and gpt-oss give the plain model's logits and tokens. What stays
refused (expected attention's closed form under a cap) is refused with its reason."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
import kvcompile.engine.op  # noqa: F401  registers torch.ops.kvcompile.attend
from kvcompile import cache as cache_arg, reference
from kvcompile.kernels.chunk_attention import ExplicitChunkAttention
from kvcompile.kernels.paged_attention import SoftcapPagedAttention
from kvcompile.kernels.paged_attention_quant import SoftcapQuantPagedAttention, _dequantized, check
from kvcompile.kernels.quantize import quantize
from kvcompile.store import SoftcapTieredPagedAttention
from test_chunked import chunked_policy, run_both
from test_decode import token_by_token
from test_hybrid import check_full_budget, padded_batch, tiny_gemma2, tiny_gpt_oss
from tiny import prompt

FEATURES = {  # (soft-cap, sinks?): Gemma 2's, gpt-oss's, both at once
    "cap": (5.0, False),
    "sinks": (None, True),
    "cap+sinks": (2.0, True),
}


def drawn_sinks(gen, hq: int) -> torch.Tensor:
    return torch.randn(hq, generator=gen) * 2


# --- the reference's semantics --------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(e=st.integers(1, 6), w=st.integers(1, 5), cap=st.sampled_from([None, 1.0, 4.0]), sinks=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_a_slot_under_the_cap_weighs_the_tokens_it_stands_for(e, w, cap, sinks, seed):
    """A slot holding w copies of one token, with the bias log w (α = 1), gives the attention over the w copies
    themselves: the bias goes after the cap (before it, cap·tanh((s + log w)/cap) would weigh it otherwise), and
    the sinks join the denominator once."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 1, 8, generator=gen) * 3
    keys, values = torch.randn(1, 1, e + 1, 8, generator=gen) * 3, torch.randn(1, 1, e + 1, 8, generator=gen)
    learned = drawn_sinks(gen, 2) if sinks else None
    bias = torch.zeros(1, 1, e + 1)
    bias[..., -1] = torch.tensor(float(w)).log()
    slot = reference.decode_attention(q, keys, values, bias, None, 0.3, softcap=cap, sinks=learned)
    copies = torch.cat([keys[:, :, :e], keys[:, :, e:].expand(1, 1, w, 8)], dim=2)
    copied = torch.cat([values[:, :, :e], values[:, :, e:].expand(1, 1, w, 8)], dim=2)
    assert_close(slot, reference.decode_attention(q, copies, copied, None, None, 0.3, softcap=cap, sinks=learned),
                 rtol=1e-5, atol=1e-6)
    if cap and w > 1:  # the cap matters: the same entries uncapped attend otherwise
        assert not torch.allclose(slot, reference.decode_attention(q, keys, values, bias, None, 0.3, sinks=learned),
                                  rtol=1e-4, atol=1e-4)


# --- the torch lowerings against the reference ---------------------------------------------------------------

def _pages(gen, b, h, pages, s, d):
    k_pages = torch.randn(b * h * pages, s, d, generator=gen) * 3
    v_pages = torch.randn(b * h * pages, s, d, generator=gen)
    block_table = torch.randperm(b * h * pages, generator=gen).view(b, h, pages)
    return k_pages, v_pages, block_table


def _gathered(pages, block_table, n):
    """(B, H, n, d) of each head's first n entries."""
    b, h, m = block_table.shape
    return pages[block_table].reshape(b, h, m * pages.shape[1], -1)[:, :, :n]


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=4, max_size=4), feature=st.sampled_from(sorted(FEATURES)),
       bits=st.sampled_from([None, 8, 4]), seed=st.integers(0, 2 ** 16))
def test_decode_attention_with_bias_equals_the_reference(lengths, feature, bits, seed):
    """The decode attention of a capped or sinked model over float pages (SoftcapPagedAttention) and over codes
    (SoftcapQuantPagedAttention: dequantized, then attended), with merge bias pages: reference.decode_attention
    over the same (dequantized) entries, each (sequence, KV head) its own length."""
    cap, sinks = FEATURES[feature]
    gen = torch.Generator().manual_seed(seed)
    b, h, s, d, pages = 2, 2, 4, 8, 8
    q = torch.randn(b, 2 * h, d, generator=gen) * 3
    k_pages, v_pages, block_table = _pages(gen, b, h, pages, s, d)
    bias_pages = torch.rand(b * h * pages, s, generator=gen) * 2
    learned = drawn_sinks(gen, 2 * h) if sinks else None
    length = torch.tensor(lengths).view(b, h)
    if bits is None:
        got = SoftcapPagedAttention(cap or 0.0, learned)(q, k_pages, v_pages, block_table, length, bias_pages, 0.3)
    else:
        qk, qv = (quantize(x.reshape(-1, d), bits, d) for x in (k_pages, v_pages))
        codes = [t.reshape(b * h * pages, s, -1) for t in (qk.codes, qk.scale, qk.zero, qv.codes, qv.scale, qv.zero)]
        got = SoftcapQuantPagedAttention(cap or 0.0, learned)(q, *codes, block_table, length, bias_pages, 0.3)
        k_pages, v_pages = _dequantized(*codes, check(q, *codes, block_table, length))
    n = int(length.max())
    keys, values = _gathered(k_pages, block_table, n), _gathered(v_pages, block_table, n)
    bias = _gathered(bias_pages[..., None], block_table, n)[..., 0]
    want = reference.decode_attention(q[:, :, None], keys, values, bias, length, 0.3, softcap=cap, sinks=learned)
    assert_close(got, want[:, :, 0], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(e=st.integers(0, 8), t=st.integers(1, 6), pads=st.integers(0, 3), feature=st.sampled_from(sorted(FEATURES)),
       merges=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_chunk_attention_equals_the_reference(e, t, pads, feature, merges, seed):
    """A chunk's attention over held entries (some heads holding fewer, merge slots with their bias) and itself
    (causal, left pads): ExplicitChunkAttention against reference.chunk_attention."""
    from kvcompile.selection import HeadEntries

    cap, sinks = FEATURES[feature]
    gen = torch.Generator().manual_seed(seed)
    b, h, g, d = 2, 2, 2, 8
    policy = kvcompile.load_spec("zsmerge" if merges else "snapkv")
    q = torch.randn(b, h * g, t, d, generator=gen) * 3
    k, v = torch.randn(b, h, t, d, generator=gen) * 3, torch.randn(b, h, t, d, generator=gen)
    hk, hv = torch.randn(b, h, e, d, generator=gen) * 3, torch.randn(b, h, e, d, generator=gen)
    counts = torch.randint(1, 5, (b, h, e), generator=gen).float()
    slots = e // 3 if merges else 0  # the first entries of a head are its slots
    counts[..., slots:] = 1.0
    held_n = torch.randint(0, e + 1, (b, h), generator=gen)
    stored = torch.arange(e) < held_n[..., None]
    real = torch.ones(b, t, dtype=torch.bool)
    real[1, :min(pads, t - 1)] = False
    learned = drawn_sinks(gen, h * g) if sinks else None
    bias = policy.merge.bias(counts) if policy.merges else None
    got, _ = ExplicitChunkAttention(cap or 0.0, learned)(q, k, v, (hk, hv, bias, stored), real, 0.3)
    heads = []
    for bi in range(b):
        row = []
        for hi in range(h):
            n = int(held_n[bi, hi])
            positions = torch.tensor([-1 - r if r < slots else r for r in range(n)], dtype=torch.long)
            row.append(HeadEntries(hk[bi, hi, :n], hv[bi, hi, :n], positions, torch.zeros(n), counts[bi, hi, :n]))
        heads.append(row)
    want = reference.chunk_attention(policy, heads, q, k, v, real, 0.3, softcap=cap, sinks=learned)
    assert_close(got[real[:, None, :, None].expand_as(got)], want[real[:, None, :, None].expand_as(want)],
                 rtol=1e-5, atol=1e-5)


# --- the engine against the reference ----------------------------------------------------------------------------

SMALL = {"ranking": {"by_score": {"window": 2}}, "scoring": {"window_attention": {"window": 2}}}
DECODE = {  # merges (online, at the prompt), running scores, pruning; codes, two tiers, codes beside merge slots
    "zsmerge": dict(name="zsmerge"),
    "lava_residual": dict(name="lava_residual", scoring={"lava": {"window": 2}}),
    "h2o_every": dict(name="h2o", ranking={"by_score": {"window": 3}}, schedule={"decode": {"every": {"n": 4}}}),
    "snapkv_int8": dict(name="snapkv", storage="int8", **SMALL),
    "snapkv_int4": dict(name="snapkv", storage={"int4": {"group": 4}}, **SMALL),
    "mixed": dict(name="snapkv", storage={"mixed": {"full": 0.5, "bits": 4}}, **SMALL),
    "kivi": dict(name="snapkv", storage={"kivi": {"bits": 4, "residual": 4, "tokens": 4}}, **SMALL),
    "int4_slots": dict(name="lava_residual", storage="int4", scoring={"lava": {"window": 2}}),
}


def decode_policy(key: str, per_head: int):
    spec = dict(DECODE[key])
    return kvcompile.load_spec(spec.pop("name"), per_head=per_head, **spec)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@settings(max_examples=8, deadline=None)
@given(key=st.sampled_from(sorted(DECODE)), b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 2),
       n=st.integers(8, 22), steps=st.integers(1, 12), per_head=st.integers(6, 12), page=st.sampled_from([2, 4]),
       d=st.sampled_from([8, 16]), seed=st.integers(0, 2 ** 16))
def test_engine_equals_reference_token_by_token(feature, key, b, h, g, n, steps, per_head, page, d, seed):
    """One layer through the op (the prompt, then decode steps) on a capped and/or sinked model: the pages hold
    the reference's entries (slots, counts, running scores) and the attention outputs agree after every token.
    d = 16 is a head dim the C++ kernels take: the plan still runs the torch lowerings."""
    cap, sinks = FEATURES[feature]
    policy = decode_policy(key, per_head)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    q, k, v = rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d)
    learned = drawn_sinks(gen, h * g) if sinks else None
    cache, _, _ = token_by_token(policy, q, k, v, None, steps, rand, page, softcap=cap, sinks=learned)
    plan = cache.plan
    assert plan.online_impl == "torch" and plan.decode_attention.softcap == (cap or 0.0)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@settings(max_examples=10, deadline=None)
@given(key=st.sampled_from(["zsmerge", "lava_residual", "snapkv", "h2o", "snapkv_every", "key_norm", "snapkv+int8",
                            "lava_residual+int4", "snapkv+mixed"]),
       b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 2), n=st.integers(5, 26), chunk=st.integers(2, 10),
       per_head=st.integers(4, 9), page=st.sampled_from([2, 4]), pad=st.integers(0, 10), steps=st.integers(0, 4),
       d=st.sampled_from([8, 16]), seed=st.integers(0, 2 ** 16))
def test_chunked_prefill_equals_reference(feature, key, b, h, g, n, chunk, per_head, page, pad, steps, d, seed):
    """schedule.prefill: chunk on a capped and/or sinked model, 2 layers with their own sinks: every chunk's
    attention (over held tokens and merge slots, with their bias after the cap), scores (the scorer's weights
    with the cap and each head's sinks) and selection equal reference.ChunkedPrefill's, then decode steps; held
    entries stored as codes (or in two tiers) attend as their x̂."""
    cap, sinks = FEATURES[feature]
    key, _, storage = key.partition("+")
    policy = chunked_policy(key, per_head, chunk)
    if storage:  # codes (held entries attend as x̂), codes beside merge slots, two tiers
        policy = kvcompile.load_spec(policy, storage={"mixed": {"full": 0.5, "bits": 4}} if storage == "mixed"
                                     else {storage: {"group": 4}})
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    learned = [drawn_sinks(gen, h * g) for _ in range(2)] if sinks else None
    mask = None
    if pad:
        mask = torch.ones(b, n, dtype=torch.bool)
        mask[0, :min(pad, n - 1)] = False
    cache = run_both(policy, 2, b, h, g, n, d, mask, page, rand, steps, softcap=cap, sinks=learned)
    assert isinstance(cache.plan.chunk_attention, ExplicitChunkAttention) and not cache.plan.chunk_scores


@pytest.mark.parametrize("feature", sorted(FEATURES))
@settings(max_examples=6, deadline=None)
@given(key=st.sampled_from(["snapkv", "lava"]), b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 2),
       n=st.integers(5, 20), chunk=st.integers(2, 6), per_head=st.integers(4, 8), page=st.sampled_from([2, 4]),
       pad=st.integers(1, 9), steps=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_mixed_tiers_on_a_left_padded_prompt_in_chunks_equal_the_reference(feature, key, b, h, g, n, chunk, per_head,
                                                                           page, pad, steps, seed):
    """Two tiers by score, a prompt compressed chunk by chunk on a left-padded batch, on a capped and/or sinked
    model: the attention and the entries in each tier are reference.ChunkedPrefill's, then decode steps."""
    cap, sinks = FEATURES[feature]
    policy = kvcompile.load_spec(chunked_policy(key, per_head, chunk), storage={"mixed": {"full": 0.5, "bits": 4}})
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    learned = [drawn_sinks(gen, h * g) for _ in range(2)] if sinks else None
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :min(pad, n - 1)] = False
    run_both(policy, 2, b, h, g, n, 8, mask, page, rand, steps, softcap=cap, sinks=learned)


@pytest.mark.parametrize("pad", [0, 3])
def test_chunked_expected_attention_under_sinks_equals_the_reference(pad):
    """Expected attention (gpt-oss's sinks in its softmax) on a prompt compressed in chunks of 5: each chunk's
    single-head scoring states carry their KV head's sinks; attention and kept entries are the reference's."""
    from types import SimpleNamespace

    from test_decode import assert_same_cache
    from test_query_agnostic import EA, rope_of

    policy = kvcompile.load_spec({"name": "ea_chunked", "scoring": EA, "budget": {"per_head": 6},
                                  "schedule": {"prefill": {"chunk": 5}}})
    b, h, g, n, d, layers = 2, 2, 2, 17, 8, 2
    gen = torch.Generator().manual_seed(5)
    learned = [drawn_sinks(gen, h * g) for _ in range(layers)]
    config = SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d, rope_theta=10000.0,
                             sinks=tuple(tuple(float(x) for x in s) for s in learned))
    cache = kvcompile.KVCompileCache(policy, config, page_size=4)
    cache.expect_prompt(n)
    ref = reference.ChunkedPrefill(policy, layers, rope=rope_of(d), sinks=learned)
    plain = reference.ChunkedPrefill(policy, layers, rope=rope_of(d))  # the sinks matter: without, other scores
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :pad] = False
    for start in range(0, n, 5):
        end = min(start + 5, n)
        for layer in range(layers):
            q, k, v = (torch.randn(b, x, end - start, d, generator=gen) for x in (h * g, h, h))
            got = torch.ops.kvcompile.attend(q, k, v, mask[:, :end], layer, cache.ref, cache.token, d ** -0.5)
            want = ref.step(layer, q, k, v, mask[:, start:end], d ** -0.5)
            plain.step(layer, q, k, v, mask[:, start:end], d ** -0.5)
            assert_close(got, want, rtol=1e-4, atol=1e-5)
    for layer in range(layers):
        assert_same_cache(cache.stores[layer].to_heads(), ref.heads[layer])
    assert any(not torch.equal(x.scores, y.scores) for layer in range(layers)
               for row_x, row_y in zip(ref.heads[layer], plain.heads[layer]) for x, y in zip(row_x, row_y)
               if len(x.scores) == len(y.scores))


def test_the_plan_chooses_the_torch_lowerings():
    """On a capped (or sinked) model the plan picks, once, the lowerings that apply the cap and the sinks where
    it picks C++ kernels for the plain model: decode over float pages, codes and two tiers, the decode step, a
    chunk's attention."""
    from types import SimpleNamespace

    from kvcompile.plan import build_plan

    def plan(spec, **config):
        dims = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4, head_dim=16,
                               hidden_size=64, **config)
        return build_plan(spec, dims, device="cpu", dtype=torch.float32)

    chunked = kvcompile.load_spec("snapkv", schedule={"prefill": {"chunk": 8}})
    cases = [("zsmerge", SoftcapPagedAttention), ("snapkv_int4", SoftcapQuantPagedAttention),
             ("lava_mixed", SoftcapTieredPagedAttention),
             (kvcompile.load_spec("lava_residual", storage="int4"), SoftcapTieredPagedAttention),
             (chunked, SoftcapPagedAttention)]
    for config in ({"attn_logit_softcapping": 5.0}, {"sinks": ((0.5,) * 4, (1.0,) * 4)}):
        for spec, backend in cases:
            spec = kvcompile.load_spec(spec)
            capped, plain = plan(spec, **config), plan(spec)
            assert type(capped.decode_attention) is backend and type(plain.decode_attention) is not backend
            assert capped.online_impl == "torch"
        assert isinstance(plan(chunked, **config).chunk_attention, ExplicitChunkAttention)
        sinks = plan(chunked, **config).chunk_backend(1, "cpu").sinks
        assert (sinks is None) == ("sinks" not in config)


# --- the tiny models at a budget that keeps everything -------------------------------------------------------------

MODELS = {"gemma2": (tiny_gemma2, "attn_logit_softcapping"), "gpt_oss": (tiny_gpt_oss, "sinks")}


def _remove(model, feature: str):
    def remove():
        for layer in model.model.layers:
            if feature == "sinks":
                layer.self_attn.sinks.zero_()
            else:
                layer.self_attn.attn_logit_softcapping = None
    return remove


@pytest.mark.parametrize("model_key", sorted(MODELS))
@pytest.mark.parametrize("spec", ["zsmerge", "lava_residual", "chunked_snapkv", "chunked_zsmerge"])
def test_full_budget_equals_the_plain_model(model_key, spec):
    """Merges (online eviction and prompt merging) and a prompt compressed in chunks of 8 on the hybrid tiny Gemma 2
    and gpt-oss: logits and greedy tokens of the plain (eager) model at a budget that keeps everything; the cap or
    the sinks matter (without them the logits move)."""
    build, feature = MODELS[model_key]
    model = build()
    policy = kvcompile.load_spec(spec.removeprefix("chunked_"))
    if spec.startswith("chunked_"):
        policy = kvcompile.load_spec(policy, schedule={"prefill": {"chunk": 8}})
        assert policy.schedule.chunk_tokens == 8 and policy.schedule.decode == kvcompile.load_spec(
            spec.removeprefix("chunked_")).schedule.decode
    check_full_budget(model, policy, _remove(model, feature))  # (its full_budget: per_head covers the prompt)


@pytest.mark.parametrize("model_key", sorted(MODELS))
def test_merges_evict_on_the_tiny_models(model_key):
    """Not vacuous: ZSMerge at 8 entries a head merges evicted tokens into slots on the tiny models (their
    global layers), and a chunked ZSMerge prompt keeps to the budget; both run where they were refused."""
    build, _ = MODELS[model_key]
    model = build()
    ids, mask = padded_batch()
    with torch.no_grad(), kvcompile.compiled(model, kvcompile.load_spec("zsmerge", per_head=8)):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             return_dict_in_generate=True)
    cache = out.past_key_values
    counts = [cache.stores[layer].to_heads() for layer in range(cache.plan.num_layers)]
    assert max(float(x.counts.max()) for layer in counts for row in layer for x in row) > 1


# --- KVzip reconstructing chunk by chunk ----------------------------------------------------------------------

@pytest.mark.parametrize("model_key", sorted(MODELS))
@pytest.mark.parametrize("variant", ["kvzip", "residual"])
def test_chunked_kvzip_equals_the_reference(model_key, variant):
    """scoring: kvzip under schedule.prefill: chunk on Gemma 2 and gpt-oss with every layer global (the reference
    runs no window): the chunk's attention and the reconstruction's softmax apply the cap and the sinks, and the
    engine's kept entries, scores, slots and logits equal reference.ChunkedKVzip's, which reads the cap and the
    sinks from the model's attention call."""
    from test_kvzip_chunked import assert_equals_reference, chunked_kvzip

    build, _ = MODELS[model_key]
    model = build()
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    for layer in model.model.layers:
        layer.attention_type, layer.self_attn.sliding_window = "full_attention", None
        if hasattr(layer.self_attn, "is_sliding"):
            layer.self_attn.is_sliding = False
    policy = chunked_kvzip(variant, 16, 8, chunk=24, sinks=2, overlap=3)
    assert_equals_reference(model, policy, prompt(60, batch=2, seed=5))


@pytest.mark.parametrize("model_key", sorted(MODELS))
def test_chunked_kvzip_on_the_hybrid_models_at_a_full_budget(model_key):
    """kvzip reconstructing chunk by chunk on the hybrid Gemma 2 and gpt-oss (local layers left to their window) at a
    budget that keeps everything: the plain model's greedy tokens."""
    from test_kvzip_chunked import REPEAT, chunked_kvzip

    build, _ = MODELS[model_key]
    model = build()
    ids = prompt(50, batch=2, seed=5)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)
        with kvcompile.compiled(model, chunked_kvzip("kvzip", 16, 200, chunk=24, sinks=2, overlap=3),
                                repeat_prompt=REPEAT):
            got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert got.tolist() == ref.tolist()


def test_expected_attention_stays_refused_under_the_cap_only():
    """Expected attention has no closed form under a cap (Gemma 2: refused with the reason); under sinks alone
    (gpt-oss) it runs."""
    with pytest.raises(kvcompile.CompileError, match="model type 'gemma2' soft-caps its attention logits .*scoring: "
                                                     "expected_attention .* has none under the cap"):
        kvcompile.compile(tiny_gemma2(), "expected_zsmerge")
    model = tiny_gpt_oss()
    with torch.no_grad(), kvcompile.compiled(model, "expected_zsmerge"):
        model.generate(prompt(20), max_new_tokens=3, do_sample=False)


# --- the compiled entry ----------------------------------------------------------------------------------------

def _compiled_against_plain_and_eager(model, feature: str, monkeypatch, inductor: bool) -> None:
    """mode='compiled' on a capped or sinked model (traced through kvcompile's call site, passes.site; the passes
    alone where `inductor` is False): at a budget that keeps everything the plain model's greedy tokens and each
    step's logits, and a forward without a cache the plain model's logits; at budgets that evict (merge slots
    after the cap or beside the sinks; int8 codes) the eager entry's tokens and kept entries. One prefill and one
    decode graph serve every policy, each with every layer's attention rewritten; the feature matters (without it
    the plain model's logits move)."""
    import functools

    import kvcompile.passes
    from kvcompile.passes.backend import COMPILES, compile_forward
    from test_hybrid import NEW
    from test_runtime import fresh_graphs_on_one_thread, full_budget

    if not inductor:
        monkeypatch.setattr(kvcompile.passes, "compile_forward", functools.partial(compile_forward, inductor=False))
    ids, mask = padded_batch()
    real = mask.bool()
    evicting = [kvcompile.load_spec("zsmerge", per_head=8), decode_policy("snapkv_int8", 10)]
    def run():  # (model.generate read at each call: compile() replaces it)
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)

    with fresh_graphs_on_one_thread(), torch.no_grad():
        ref, plain = run(), model(ids, attention_mask=mask, use_cache=False).logits
        eager = []
        for policy in evicting:
            with kvcompile.compiled(model, policy):
                eager.append(run())
        with kvcompile.compiled(model, full_budget("snapkv", ids.shape[1] + NEW, 4), mode="compiled"):
            assert model.config._attn_implementation == "kvcompile_site"
            full = run()
            uncached = model(ids, attention_mask=mask, use_cache=False).logits
        compiled = []
        for policy in evicting:
            with kvcompile.compiled(model, policy, mode="compiled"):
                compiled.append(run())
        _remove(model, feature)()
        without = model(ids, attention_mask=mask, use_cache=False).logits
    assert full.sequences.tolist() == ref.sequences.tolist()
    for got, want in zip(full.logits, ref.logits):
        assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_close(uncached[real], plain[real], rtol=1e-5, atol=1e-5)
    assert (without[real] - plain[real]).abs().max() > 1e-2
    for got, want in zip(compiled, eager):
        assert got.sequences.tolist() == want.sequences.tolist()
        assert torch.equal(cache_arg.of(got).kept(), cache_arg.of(want).kept())
    assert any(int(cache_arg.of(e).kept().max()) < ids.shape[1] for e in eager)  # the global layers evicted
    kinds = sorted((c["kind"], c["layers"], c["inductor"]) for c in COMPILES)
    assert kinds == [("decode", [0, 1, 2, 3], inductor), ("prefill", [0, 1, 2, 3], inductor)], COMPILES


@pytest.mark.parametrize("model_key", sorted(MODELS))
def test_the_compiled_entry_runs_the_capped_models_through_the_passes(model_key, monkeypatch):
    """The passes alone (the rewritten graphs run as Python code, no Inductor): see _compiled_against_plain_and_eager."""
    build, feature = MODELS[model_key]
    _compiled_against_plain_and_eager(build(), feature, monkeypatch, inductor=False)


@pytest.mark.slow
@pytest.mark.parametrize("model_key", sorted(MODELS))
def test_the_compiled_entry_runs_the_capped_models_with_inductor(model_key, monkeypatch):
    """Passes + Inductor (what mode='compiled' runs): see _compiled_against_plain_and_eager."""
    build, feature = MODELS[model_key]
    _compiled_against_plain_and_eager(build(), feature, monkeypatch, inductor=True)


def test_the_call_site_is_never_run_unrewritten():
    """kvcompile.attention_site only marks a layer's attention for the passes: a graph that kept it fails, naming
    the entry that rewrites it, rather than attending without the cap or the sinks."""
    import kvcompile.passes.site  # noqa: F401  registers torch.ops.kvcompile.attention_site

    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="placeholder .* mode='compiled'"):
        torch.ops.kvcompile.attention_site(q, k, k, None, 0, 0.3)
