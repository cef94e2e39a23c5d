"""scoring: kvzip under a chunked prefill (schedule: {prefill: {chunk: c}}, reference.ChunkedKVzip): each chunk
runs through the model over what the heads hold, is reconstructed (its scores a softmax over its own keys,
the sinks and the reconstruction's keys), and every layer selects among its held entries and the chunk. The
engine (compile()'s forward and generate()) equals the reference for every allocator family; a chunk
covering the prompt is one-pass KVzip exactly; KV memory is the budget plus one chunk whatever the prompt's
length; what cannot be exact is refused before it runs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from kvcompile.errors import CompileError
from kvcompile.kvzip import RepeatPrompt
from test_decode import assert_same_cache, contents
from tiny import left_pad, prompt, tiny_model

REPEAT = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12))  # token ids of a tiny vocabulary

# KVzip's scores with every allocator family: uniform heads, pooled heads (AdaKV), pyramid layers, LAVa's
# entropy layers (a cascade inside each chunk), a residual merge with a split, a threshold (DBudgetKV), int4 pages
VARIANTS = {
    "kvzip": dict(name="kvzip_uniform"),
    "kvzip_adakv": dict(name="kvzip_adakv"),
    "pyramid": dict(name="kvzip_uniform", budget={"layers": {"pyramid": {"beta": 4}}, "heads": "uniform"}),
    "entropy": dict(name="kvzip_uniform", budget={"layers": "entropy", "heads": "pooled"}),
    "residual": dict(name="kvzip_uniform", merge={"residual": {"alpha": 0.6}}, ranking={"by_score": {"sinks": 0, "window": 0}},
                     budget={"split": {"proximity": 0.1, "context": 0.8, "residual": 0.1}}),
    "threshold": dict(name="dbudgetkv", scoring={"kvzip": {}}, ranking={"by_score": {"sinks": 4, "window": 0}},
                      budget={"threshold": {"attention_norm": {"t": 0.05, "keep_layers": 0}}}),
    "int4": dict(name="kvzip_uniform", storage={"int4": {"group": 0}}),
}


def chunked_kvzip(key: str, c: int, per_head: int = 10, **scoring):
    """VARIANTS[key] with `schedule: {prefill: {chunk: c}}`; `scoring`: KVzip's fields."""
    spec = dict(VARIANTS[key])
    name = spec.pop("name")
    over = {"schedule": {"prefill": {"chunk": c}}, **spec}
    if "threshold" not in spec.get("budget", {}):
        over["per_head"] = per_head
    over["scoring"] = {"kvzip": scoring}
    return kvcompile.load_spec(name, **over)


def assert_same_entries(runtime_heads, reference_heads):
    """The same (head, position) tokens and slots, merge counts exact; keys, values and scores up to float
    noise (the model's layers above the first read attention outputs that the engine's kernels and the
    reference's loops round differently)."""
    for got, want in zip(contents(runtime_heads), contents(reference_heads), strict=True):
        assert torch.equal(got[0], want[0])  # the same tokens
        assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
        assert_close(got[2], want[2], rtol=1e-3, atol=1e-5)  # KVzip's scores
        assert torch.equal(got[3], want[3])  # the same slots
        assert_close(got[4], want[4], rtol=1e-4, atol=1e-4)
        assert_close(got[5], want[5], rtol=1e-4, atol=1e-4)
        assert torch.equal(got[6], want[6])  # merge counts


def run_engine(model, policy, ids, repeat=REPEAT):
    """compile()'s forward over the whole prompt: its cache and logits (B, N, V)."""
    with kvcompile.compiled(model, policy, repeat_prompt=repeat), torch.no_grad():
        out = model(ids, use_cache=True)
    return out.past_key_values, out.logits


def assert_equals_reference(model, policy, ids, repeat=REPEAT):
    """The engine's cache and logits equal the reference's. Quantized pages are compared in float64: a later
    chunk reads the earlier chunks' rounded codes, so float32 noise between the engine's kernels and the
    reference's loops (1e-7) that lands a value on the other side of a rounding step moves it by a whole
    step (1e-3 on a tiny model's keys), and every hidden state after it; in float64 the two agree to 1e-7."""
    if policy.storage.quantizes:
        model.double()
    ref, logits = reference.ChunkedKVzip.run(model, policy, ids, repeat)
    cache, got = run_engine(model, policy, ids, repeat)
    assert cache.seq_length == ids.shape[1] and cache.compressing is None and cache.reconstruction is None
    for layer in range(model.config.num_hidden_layers):
        assert_same_entries(cache.stores[layer].to_heads(), ref.heads[layer])
    assert_close(got, logits, rtol=1e-4, atol=1e-4)
    return cache


@settings(max_examples=24, deadline=None)
@given(key=st.sampled_from(sorted(VARIANTS)), kv_heads=st.sampled_from([1, 2]), n=st.integers(20, 70),
       batch=st.integers(1, 2), chunk=st.integers(6, 40), recon=st.integers(5, 45), sinks=st.integers(0, 5),
       overlap=st.integers(0, 6), per_head=st.integers(6, 14), arch=st.sampled_from(["llama", "qwen2"]))
def test_engine_equals_reference(key, kv_heads, n, batch, chunk, recon, sinks, overlap, per_head, arch):
    """Kept (layer, head, position) entries, their scores, merge slots and the prompt's logits: the engine's
    equal the reference's, for chunks smaller or larger than the reconstruction's spans."""
    assume(overlap <= recon)  # a larger overlap is refused at load (it would quote chunks before the previous one)
    model = tiny_model(arch, kv_heads=kv_heads)
    policy = chunked_kvzip(key, chunk, per_head, chunk=recon, sinks=sinks, overlap=overlap)
    assert_equals_reference(model, policy, prompt(n, batch=batch, seed=n + chunk))


PREFIXED = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12), prefix=(13, 14, 15, 16, 17, 18, 19))


@settings(max_examples=10, deadline=None)
@given(key=st.sampled_from(["kvzip", "kvzip_adakv", "entropy", "int4"]), n=st.integers(20, 60),
       batch=st.integers(1, 2), chunk=st.integers(8, 40), recon=st.integers(5, 30), sinks=st.integers(0, 5),
       overlap=st.integers(0, 6))
def test_reconstruct_context_in_chunks_skips_the_template_prefix_as_the_reference_does(key, n, batch, chunk, recon,
                                                                                      sinks, overlap):
    """reconstruct: context (the default: KVzip's Algorithm 1, kvpress's KVzipPress) under a chunked prefill: the
    first chunk's spans start after the chat template's prefix (its entries score 0, the first span reads
    `first`), later chunks' spans quote nothing of the prefix; the engine equals the reference, and with one
    chunk covering the prompt the reference is one-pass KVzip's scores (`kvzip_scores`) exactly."""
    assume(overlap <= recon)
    model = tiny_model("llama", kv_heads=2)
    policy = chunked_kvzip(key, chunk, 10, chunk=recon, sinks=sinks, overlap=overlap)
    assert policy.scoring.reconstruct == "context"
    p = len(PREFIXED.prefix)
    ids = torch.cat([torch.tensor([PREFIXED.prefix] * batch), prompt(n, batch=batch, seed=n + chunk)], dim=1)
    assert_equals_reference(model, policy, ids, PREFIXED)
    whole = kvcompile.load_spec(policy, schedule={"prefill": {"chunk": n + p}})
    scores, _ = reference.kvzip_scores(model, ids, PREFIXED, whole.scoring)
    ref, _ = reference.ChunkedKVzip.run(model, whole, ids, PREFIXED)
    for layer in range(model.config.num_hidden_layers):
        assert bool((scores[layer][..., :p] == 0).all()) and bool((scores[layer][..., p:] > 0).all())
        for b in range(batch):
            for h, held in enumerate(ref.heads[layer][b]):
                tok = held.tokens()
                assert_close(held.scores[tok], scores[layer][b, h, held.positions[tok]], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_every_variant_evicts_across_chunks(key):
    """Not vacuous: a 90-token prompt in chunks of 16 evicts tokens of earlier chunks, keeps some, and the
    engine still equals the reference; a sink that the ranking does not protect is left out of the softmax
    once evicted (ranking sinks 0, scoring sinks 4)."""
    model = tiny_model("llama")
    policy = chunked_kvzip(key, 16, 8, chunk=24, sinks=4, overlap=3)
    if key in ("kvzip", "kvzip_adakv"):
        policy = kvcompile.load_spec(policy, ranking={"by_score": {"sinks": 0, "window": 0}})
    cache = assert_equals_reference(model, policy, prompt(90, batch=2, seed=5))
    kept = cache.kept_positions(1)
    assert not bool(kept[..., :80].all()) and bool(kept[..., :64].any())


@pytest.mark.parametrize("spec", ["kvzip_uniform", "kvzip_adakv"])
def test_chunk_covering_the_prompt_is_one_pass_kvzip_exactly(spec):
    """c >= N: generate() and model() give one-pass KVzip's tokens, logits and kept entries (bit for bit),
    and the reference is reference.kvzip_scores + reference.compress."""
    model = tiny_model("qwen2")
    ids = prompt(60, batch=2, seed=3)
    one = kvcompile.load_spec(spec, per_head=12, scoring={"kvzip": {"chunk": 25}})
    chunked = kvcompile.load_spec(one, schedule={"prefill": {"chunk": 60}})
    runs = []
    for policy in (one, chunked):
        with kvcompile.compiled(model, policy, repeat_prompt=REPEAT), torch.no_grad():
            out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
            forward = model(ids)
        runs.append((out, forward))
    (a, fa), (b, fb) = runs
    assert a.sequences.tolist() == b.sequences.tolist()
    assert torch.equal(fa.logits, fb.logits)
    for layer in range(3):
        assert torch.equal(fa.past_key_values.kept_positions(layer), fb.past_key_values.kept_positions(layer))
    assert int(fb.past_key_values.kept().sum()) < 60 * 2 * 3 * 2  # compressed

    ref, _ = reference.ChunkedKVzip.run(model, chunked, ids, REPEAT)
    scores, states = reference.kvzip_scores(model, ids, REPEAT, one.scoring)
    whole = reference.compress(one, states, scores=scores)
    for layer in range(3):
        assert_same_entries(ref.heads[layer], reference.decode_heads(one, states[layer], whole.kept[layer],
                                                                     whole.merged[layer], whole.scores[layer]))


def test_generate_continues_from_the_chunked_cache():
    """generate() feeds the prompt c tokens per call (prefill_chunk_size = c), each chunk reconstructed before
    the next: the prompt entries it keeps are compile()'s forward's, and its tokens are greedy decoding from
    that cache."""
    model = tiny_model("llama")
    ids = prompt(75, batch=2, seed=9)
    policy = chunked_kvzip("kvzip_adakv", 20, 10, chunk=12)
    with kvcompile.compiled(model, policy, repeat_prompt=REPEAT), torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        first = model(ids, use_cache=True)
        cache, tokens = first.past_key_values, [first.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(5):
            logits = model(tokens[-1], past_key_values=cache, use_cache=True).logits[:, -1]
            tokens.append(logits.argmax(-1, keepdim=True))
    assert torch.cat(tokens, 1).tolist() == out.sequences[:, 75:].tolist()
    for layer in range(3):
        assert torch.equal(out.past_key_values.kept_positions(layer), first.past_key_values.kept_positions(layer))


def test_prompt_given_chunk_by_chunk_equals_in_one_call():
    """A cache told the prompt's length (expect_prompt) and given it one chunk per call holds what compile()'s
    forward over the whole prompt holds; the last call's logits are the same."""
    model = tiny_model("llama")
    ids = prompt(50, seed=2)
    policy = chunked_kvzip("kvzip", 16, 8, chunk=10)
    with kvcompile.compiled(model, policy, repeat_prompt=REPEAT), torch.no_grad():
        whole = model(ids)
        cache = KVCompileCache.from_plan(model.kvcompile_plan)
        cache.expect_prompt(50)
        for start in range(0, 50, 16):
            last = model(ids[:, start:start + 16], past_key_values=cache)
    assert cache.compressing is None and cache.seq_length == 50
    for layer in range(3):
        assert_same_cache(cache.stores[layer].to_heads(), whole.past_key_values.stores[layer].to_heads())
    assert_close(last.logits[:, -1], whole.logits[:, -1])


def test_refused_up_front():
    model = tiny_model("llama")
    policy = chunked_kvzip("kvzip", 16)
    with pytest.raises(CompileError, match="mode='eager'"):
        kvcompile.compile(model, policy, mode="compiled", repeat_prompt=REPEAT)
    with pytest.raises(CompileError, match="schedule.decode"):
        kvcompile.compile(model, kvcompile.load_spec(policy, schedule={"prefill": {"chunk": 16},
                                                                       "decode": {"every": 8}}), repeat_prompt=REPEAT)
    ids, mask = left_pad([prompt(40, seed=1)[0], prompt(30, seed=2)[0]])
    with kvcompile.compiled(model, policy, repeat_prompt=REPEAT), torch.no_grad():
        with pytest.raises(CompileError, match="unpadded"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2)
        with pytest.raises(CompileError, match="unpadded"):
            model(ids, attention_mask=mask)
        with pytest.raises(CompileError, match="prefill_chunk_size=8"):
            model.generate(prompt(40), max_new_tokens=2, prefill_chunk_size=8)
        with pytest.raises(CompileError, match="assist"):
            model.generate(prompt(40), max_new_tokens=2, prompt_lookup_num_tokens=3)
        cache = KVCompileCache.from_plan(model.kvcompile_plan)
        cache.expect_prompt(40)
        with pytest.raises(CompileError, match=r"next chunk, \[0, 16\)"):
            model(prompt(40)[:, :10], past_key_values=cache)
        assert all(s is None for s in cache.stores) and cache.reconstruction is None
    with kvcompile.compiled(model, "kvzip", repeat_prompt=REPEAT), torch.no_grad():  # one pass: no chunk size
        with pytest.raises(CompileError, match="prefill_chunk_size"):
            model.generate(prompt(40), max_new_tokens=2, prefill_chunk_size=8)


def test_peak_kv_memory_is_the_budget_plus_one_chunk_from_4k_to_32k_tokens():
    """A 2-layer model with long positions: the KV bytes held after every attention call (every layer's
    pages, spares included, and the chunk's keys and values held for its reconstruction) never exceed the
    budget plus one chunk at every layer, and peak the same for 4k and 32k-token prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, heads, d, per_head, c = 2, 1, 16, 64, 512
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=heads,
                                         head_dim=d, max_position_embeddings=40000,
                                         attn_implementation="sdpa")).eval()
    policy = kvcompile.load_spec("kvzip_uniform", per_head=per_head, schedule={"prefill": {"chunk": c}})
    entry = 2 * d * 4  # K and V, fp32
    peaks = {}
    for n in (4096, 32768):
        held = []
        cache = None

        def measure(module, args, out):
            pages = sum(s.k_pages.nbytes + s.v_pages.nbytes for s in cache.stores if s is not None)
            rec = cache.reconstruction
            held.append(pages + (0 if rec is None else rec.nbytes))

        hooks = [layer.self_attn.register_forward_hook(measure) for layer in model.model.layers]
        ids = torch.randint(13, 64, (1, n), generator=torch.Generator().manual_seed(n))
        try:
            with kvcompile.compiled(model, policy, repeat_prompt=REPEAT, page_size=1), torch.no_grad():
                cache = KVCompileCache.from_plan(model.kvcompile_plan)
                model(ids, past_key_values=cache)
        finally:
            for hook in hooks:
                hook.remove()
        assert cache.seq_length == n and int(cache.kept().sum()) == per_head * layers * heads
        assert len(held) == 2 * layers * n // c  # every chunk's forward and its reconstruction
        spares = layers * heads * cache.plan.spare_pages
        peaks[n] = max(held)
        assert peaks[n] <= (per_head * layers * heads + spares + c * layers * heads) * entry
    assert peaks[4096] == peaks[32768]
