"""Hybrid attention models (Gemma 3: most layers see a sliding window, some every token), on tiny random models
from transformers' own config class: a policy compresses the full_attention layers and leaves each local layer to
its window, where it attends as transformers' sliding-window attention does and holds what transformers' own
cache holds (its last window - 1 positions). At a budget that keeps everything a compiled model is the plain
model (logits and greedy tokens, on every generate() path it runs here); at a budget that evicts, the local layers
still equal a windowed reference; what cannot run exactly is refused up front, with the reason. Gemma 2's
soft-capped logits and gpt-oss's learned sinks go through the op exactly: property tests against written-out
references, and their tiny models at a full budget against the plain (eager) model."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

import kvcompile
from kvcompile import cache as cache_arg
from kvcompile.cache import KVCompileCache
from test_runtime import full_budget
from tiny import left_pad, peaked, prompt

WINDOW = 12
KINDS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
         "sliding_attention"]  # the last layer local: the cache's length advances at the last compressed layer
LOCAL = [i for i, k in enumerate(KINDS) if k == "sliding_attention"]
NEW = 20  # decode steps: the window slides past the prompt's last entries


def tiny_gemma3(seed: int = 0, **extra) -> Gemma3ForCausalLM:
    """6 layers (4 local with a 12-token window, 2 global), 4 query / 2 KV heads of dim 16, Gemma's query
    scaling by query_pre_attn_scalar = 24 (not the head dim's 16)."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=len(KINDS),
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=WINDOW, layer_types=KINDS, max_position_embeddings=1024,
                              attn_implementation="sdpa", pad_token_id=0, eos_token_id=1, bos_token_id=2, **extra)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # peaked attention (Gemma's norms scale by 1 + weight, initialised to 0)
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(2.0)
            layer.self_attn.k_norm.weight.fill_(2.0)
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3()


def padded_batch():
    return left_pad([prompt(30, seed=3)[0], prompt(22, seed=4)[0]])


def test_the_tiny_model_is_a_hybrid_with_gemma_query_scaling(model):
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.sliding_window for a in attn] == [WINDOW if k == "sliding_attention" else None for k in KINDS]
    assert attn[0].scaling == 24 ** -0.5 != attn[0].head_dim ** -0.5


@pytest.mark.parametrize("name", ["snapkv", "h2o", "lava", "streamingllm"])
def test_full_budget_equals_the_plain_model(model, name):
    """Logits of a left-padded batch longer than the window, and greedy tokens past it."""
    ids, mask = padded_batch()
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask).logits
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        policy = full_budget(name, ids.shape[1] + NEW, len(KINDS))
        with kvcompile.compiled(model, policy):
            logits = model(ids, attention_mask=mask).logits
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    real = mask.bool()
    assert_close(logits[real], ref_logits[real], rtol=1e-5, atol=1e-5)
    assert got.tolist() == ref.tolist()


def test_every_generate_path_equals_the_plain_model(model):
    """Beam search (rows reordered), sampling, a cache continued by a second call, generate's chunked prefill and
    a forward without a cache (use_cache=False: the windowed attention without any cache)."""
    ids, mask = padded_batch()
    policy = full_budget("snapkv", 80, len(KINDS))
    runs = {
        "beams": dict(num_beams=3, max_new_tokens=8, do_sample=False),
        "sample": dict(do_sample=True, top_k=10, max_new_tokens=10),
        "prefill chunks": dict(prefill_chunk_size=8, max_new_tokens=10, do_sample=False),
    }
    with torch.no_grad():
        for label, kwargs in runs.items():
            torch.manual_seed(5)
            ref = model.generate(ids, attention_mask=mask, **kwargs)
            with kvcompile.compiled(model, policy):
                torch.manual_seed(5)
                got = model.generate(ids, attention_mask=mask, **kwargs)
            assert got.tolist() == ref.tolist(), label
        # a second turn on the cache of the first
        first = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               return_dict_in_generate=True)
        more = torch.cat([first.sequences, prompt(5, batch=2, seed=9)], dim=1)
        more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
        ref = model.generate(more, attention_mask=more_mask, max_new_tokens=8, do_sample=False,
                             **cache_arg.given(first.past_key_values))
        ref_plain = model(ids, attention_mask=mask, use_cache=False).logits
        with kvcompile.compiled(model, policy):
            first = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   return_dict_in_generate=True)
            got = model.generate(more, attention_mask=more_mask, max_new_tokens=8, do_sample=False,
                                 **cache_arg.given(first.past_key_values))
            plain = model(ids, attention_mask=mask, use_cache=False).logits
    assert got.tolist() == ref.tolist()
    real = mask.bool()
    assert_close(plain[real], ref_plain[real], rtol=1e-5, atol=1e-5)


def test_local_layers_hold_what_transformers_cache_holds(model):
    """After a prompt and decode steps, each local layer holds transformers' sliding-window layer's keys and
    values (its last window - 1 positions), in tensors of that size (what left the window is freed)."""
    ids = prompt(30, batch=2, seed=6)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
        with kvcompile.compiled(model, full_budget("snapkv", 30 + NEW, len(KINDS))):
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    theirs, ours = cache_arg.of(ref), cache_arg.of(out)
    assert isinstance(ours, KVCompileCache) and ours.plan.num_layers == 2 and ours.plan.model_layers == len(KINDS)
    for layer in LOCAL:
        held = ours.windows[layer]
        assert held.keys.shape[2] == WINDOW - 1 and held.keys.untyped_storage().nbytes() == held.keys.nbytes
        assert_close(held.keys, theirs.layers[layer].keys, rtol=1e-4, atol=1e-4)
        assert_close(held.values, theirs.layers[layer].values, rtol=1e-4, atol=1e-4)
    assert all(ours.windows[i] is None for i, k in enumerate(KINDS) if k == "full_attention")


def _windowed_reference(q, keys, values, valid, scale, offset):
    """softmax(q·kᵀ·scale) over the real keys at positions p with i - WINDOW < p <= i, written out."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    logits = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(q.shape[2])[:, None] + offset
    p = torch.arange(keys.shape[2])[None, :]
    sees = (p <= i) & (p > i - WINDOW) & valid[:, None, None, :]
    return torch.softmax(logits.masked_fill(~sees, float("-inf")), dim=-1) @ v


def test_an_evicting_policy_leaves_local_layers_to_their_window(model, monkeypatch):
    """snapkv at a budget that evicts most of the prompt: the full_attention layers keep the budget, and every
    call of every local layer equals windowed attention over all the keys the layer has seen (the reference,
    written out), pads masked."""
    calls = []
    attend_window = KVCompileCache.attend_window

    def record(cache, layer, q, k, v, mask, scale):
        out = attend_window(cache, layer, q, k, v, mask, scale)
        calls.append((layer, q.clone(), k.clone(), v.clone(), None if mask is None else mask.clone(), scale,
                      out.clone()))
        return out

    monkeypatch.setattr(KVCompileCache, "attend_window", record)
    ids, mask = left_pad([prompt(80, seed=7)[0], prompt(67, seed=8)[0]])
    with torch.no_grad(), kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=40)):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True)
    report = cache_arg.of(out).memory_report()
    assert report["kept"].max() < 60  # the full_attention layers evicted (40 kept + decoded ones)
    seen = {layer: [] for layer in LOCAL}
    for layer, q, k, v, m, scale, got in calls:
        assert scale == 24 ** -0.5
        seen[layer].append((k, v))
        keys = torch.cat([x for x, _ in seen[layer]], dim=2)
        values = torch.cat([y for _, y in seen[layer]], dim=2)
        valid = torch.ones(2, keys.shape[2], dtype=torch.bool) if m is None else m[:, -keys.shape[2]:].bool()
        want = _windowed_reference(q, keys, values, valid, scale, keys.shape[2] - q.shape[2])
        real = valid[:, -q.shape[2]:]  # a pad query's output is never read
        assert_close(got.transpose(1, 2)[real], want.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)
    assert sorted(seen) == LOCAL and all(len(s) == NEW for s in seen.values())  # the prompt + NEW - 1 steps


def test_memory_report_by_layer_kind_matches_transformers_hybrid_cache(model):
    """At a full budget (pages of one entry: nothing partly filled), the bytes each kind of layer holds are those
    of transformers' own hybrid cache (DynamicCache(config=...)) after the same prompt and decode steps."""
    ids = prompt(30, batch=2, seed=10)
    with torch.no_grad():
        theirs = DynamicCache(config=model.config)
        model.generate(ids, max_new_tokens=8, do_sample=False, **cache_arg.given(theirs))
        with kvcompile.compiled(model, full_budget("snapkv", 38, len(KINDS)), page_size=1):
            out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    report = cache_arg.of(out).memory_report()
    expected = {}
    for kind, layer in zip(KINDS, theirs.layers):
        expected[kind] = expected.get(kind, 0) + layer.keys.nbytes + layer.values.nbytes
    assert report["bytes_by_kind"] == expected
    assert report["bytes_full_by_kind"] == expected
    assert report["bytes_held"] == report["bytes_full"] == sum(expected.values())


def test_compile_leaves_the_model_unchanged_on_a_refusal():
    model = tiny_gemma3(use_bidirectional_attention=True)
    with pytest.raises(kvcompile.CompileError, match="use_bidirectional_attention=True attends to later tokens"):
        kvcompile.compile(model, "snapkv")
    assert "forward" not in model.__dict__ and model.config._attn_implementation == "sdpa"


def test_a_policy_for_local_layers_or_a_kind_the_model_lacks_is_refused(model):
    sliding = {"budget": {"per_head": 64, "layers": {"uniform": {"kinds": ["full_attention", "sliding_attention"]}}}}
    with pytest.raises(kvcompile.CompileError, match="applies to sliding_attention layers .*window already bounds"):
        kvcompile.compile(model, "snapkv", **sliding)
    assert "forward" not in model.__dict__
    from tiny import tiny_model

    llama = tiny_model("llama")
    with pytest.raises(kvcompile.CompileError, match="applies to sliding_attention layers \\(layers: kinds\\), "
                                                     "which this model does not have; its layers are 3 full_attention"):
        kvcompile.compile(llama, "snapkv", budget={"per_head": 64, "layers": {"uniform": {"kinds": ["sliding_attention"]}}})


@pytest.mark.parametrize("spec", ["kvzip", "kvzip_adakv"])
def test_kvzip_reconstructs_through_the_windows(model, spec):
    """KVzip's reconstruction forwards run through the local layers as the plain model runs the prompt followed by
    the repeat input (reference.kvzip_scores: the windows as the prompt left them, the input's own keys), and
    leave the windows as the prompt left them: the kept entries and their scores are the reference's at a budget
    that evicts, and a full budget generates the plain model's tokens."""
    from kvcompile import reference
    from test_kvzip import REPEAT, kept_scores

    ids = prompt(40, batch=2, seed=11)
    policy = kvcompile.load_spec(spec, per_head=12, scoring={"kvzip": {"chunk": 16, "sinks": 2, "overlap": 3}})
    with torch.no_grad():
        with kvcompile.compiled(model, policy, repeat_prompt=REPEAT):
            cache = model(ids, use_cache=True).past_key_values
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        full = kvcompile.load_spec(spec, per_head=40 + NEW + 64)
        with kvcompile.compiled(model, full, repeat_prompt=REPEAT):
            got = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
        with kvcompile.compiled(model, kvcompile.load_spec("snapkv")):
            plain = model(ids, use_cache=True).past_key_values  # the windows a prompt leaves
    scores, states = reference.kvzip_scores(model, ids, REPEAT, policy.scoring)
    expected = reference.compress(policy, states, scores=scores)
    assert cache.seq_length == 40  # the reconstruction forwards added nothing, to the windows neither
    for i in LOCAL:
        assert cache.windows[i].seen == 40 and torch.equal(cache.windows[i].keys, plain.windows[i].keys)
    for layer in range(cache.plan.num_layers):
        kept = cache.kept_positions(layer)
        assert torch.equal(kept, expected.kept[layer]), f"layer {layer}"
        assert_close(kept_scores(cache, layer), torch.where(kept, scores[layer], 0.0))
    assert got.sequences.tolist() == ref.tolist()


def test_assisted_and_prompt_lookup_decoding_crop_inside_the_windows(model, monkeypatch):
    """generate() records the local layers' past before it decodes with candidates (activate_past_recording) and
    crops the rejected ones, past the window: at a full budget the plain model's tokens, at a budget that evicts
    the compiled model's own greedy tokens; the windows end back at their last window - 1 positions. A crop
    without the recording, once a window has slid, is refused (the entries it would need are gone)."""
    crops = []
    crop = KVCompileCache.crop

    def record(cache, n):
        crops.append((n, cache.windows[LOCAL[0]].seen))
        return crop(cache, n)

    monkeypatch.setattr(KVCompileCache, "crop", record)
    ids, long_ids = prompt(20, batch=1, seed=2), prompt(80, batch=1, seed=7)
    assistant = copy.deepcopy(model)
    lookup = dict(max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=2)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        with kvcompile.compiled(model, full_budget("snapkv", 20 + NEW, len(KINDS))):
            out = model.generate(ids, return_dict_in_generate=True, **lookup)
            assisted = model.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=assistant)
        with kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=40)):
            greedy = model.generate(long_ids, max_new_tokens=NEW, do_sample=False)
            evicting = model.generate(long_ids, **lookup)
            assisted_evicting = model.generate(long_ids, max_new_tokens=NEW, do_sample=False,
                                               assistant_model=assistant)
    assert out.sequences.tolist() == assisted.tolist() == ref.tolist()
    assert evicting.tolist() == assisted_evicting.tolist() == greedy.tolist()
    assert any(n < 0 and seen > WINDOW for n, seen in crops)  # candidates rejected after a window slid
    cache = cache_arg.of(out)
    assert all(cache.windows[i].keys.shape[2] <= WINDOW - 1 + 2 for i in LOCAL)  # (the last call's candidates)
    with torch.no_grad(), kvcompile.compiled(model, full_budget("snapkv", 40, len(KINDS))):
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(NotImplementedError, match=r"call activate_past_recording\(\) before the tokens to crop"):
        crop(cache_arg.of(plain), -2)


def test_the_compiled_entry_equals_the_plain_model_and_the_eager_entry(model):
    """mode='compiled' (torch.compile with kvcompile's passes: each local layer's captured attention becomes
    kvcompile.attend_window, each global layer's kvcompile.attend under its number among the compressed layers): at
    a budget that keeps everything the plain model's logits and greedy tokens; at a budget that evicts, the eager
    entry's tokens, with the local layers holding what the eager entry's hold. One prefill and one decode graph
    serve both policies and every prompt length (they do not depend on the policy)."""
    from kvcompile.passes.backend import COMPILES

    ids, mask = padded_batch()
    long_ids, long_mask = left_pad([prompt(80, seed=7)[0], prompt(67, seed=8)[0]])
    evicting = kvcompile.load_spec("snapkv", per_head=40)
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask).logits
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        with kvcompile.compiled(model, evicting):
            eager = model.generate(long_ids, attention_mask=long_mask, max_new_tokens=NEW, do_sample=False,
                                   return_dict_in_generate=True)
        before = len(COMPILES)
        with kvcompile.compiled(model, full_budget("snapkv", ids.shape[1] + NEW, len(KINDS)), mode="compiled"):
            logits = model(ids, attention_mask=mask).logits
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        with kvcompile.compiled(model, evicting, mode="compiled"):
            compiled = model.generate(long_ids, attention_mask=long_mask, max_new_tokens=NEW, do_sample=False,
                                      return_dict_in_generate=True)
    real = mask.bool()
    assert_close(logits[real], ref_logits[real], rtol=1e-5, atol=1e-5)
    assert got.tolist() == ref.tolist()
    assert compiled.sequences.tolist() == eager.sequences.tolist()
    ours, theirs = cache_arg.of(compiled), cache_arg.of(eager)
    assert ours.memory_report()["kept"].max() < 60  # the full_attention layers evicted
    for layer in LOCAL:  # (Inductor fuses the projections and RoPE in front of them: float rounding differs)
        assert ours.windows[layer].keys.shape == theirs.windows[layer].keys.shape
        assert_close(ours.windows[layer].keys, theirs.windows[layer].keys, rtol=1e-3, atol=1e-3)
    kinds = [(r["kind"], r["layers"]) for r in COMPILES[before:]]
    assert {kind for kind, _ in kinds} == {"prefill", "decode"} and all(layers == list(range(len(KINDS)))
                                                                      for _, layers in kinds)


def test_cuda_graphs_of_a_hybrid_model_are_refused():
    """A CUDA graph would not replay a local layer's window, made afresh at every step. (The compiled entry runs
    Gemma 2 and gpt-oss, which transformers runs without SDPA, through kvcompile's call site:
    tests/test_hybrid_capped_paths.py.)"""
    from kvcompile import graphs

    plan = dataclasses.replace(KVCompileCache(kvcompile.load_spec("snapkv"), tiny_gemma3().config).plan,
                               device=torch.device("cuda"))
    assert "hybrid model's local layers" in graphs.refusal(plan)


def test_continuous_batching_equals_the_plain_engine_and_generate(model):
    """generate_batch (transformers' continuous batching, kvcompile's per-request caches): at a full budget the
    plain engine's tokens; at a budget that evicts, each request's generate() tokens with the same spec. The
    requests' caches hold their windows, counted in what the pool reserves for them."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=1, pad_token_id=0)
    # a pool of a fixed size: left unset, transformers sizes it from the machine's free memory (gigabytes)
    pool = dict(continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, page_size=16))
    inputs = [prompt(30, seed=3)[0].tolist(), prompt(22, seed=4)[0].tolist(), prompt(50, seed=5)[0].tolist()]
    with torch.no_grad():
        ref = model.generate_batch(inputs=inputs, generation_config=config, **pool)
        with kvcompile.compiled(model, full_budget("snapkv", 50 + NEW, len(KINDS))):
            full = model.generate_batch(inputs=inputs, generation_config=config, **pool)
        with kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=40)):
            evicting = model.generate_batch(inputs=inputs, generation_config=config, **pool)
            alone = [model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
                     for ids in inputs]
    assert [r.generated_tokens for r in full.values()] == [r.generated_tokens for r in ref.values()]
    assert [r.generated_tokens for r in evicting.values()] == alone
    assert alone != [r.generated_tokens for r in ref.values()]  # the 50-token prompt lost entries


def test_a_request_reserves_its_windows():
    """What the pool reserves for a prompt covers the local layers' windows: window - 1 positions each (at
    most the prompt), every KV head's key and value."""
    from kvcompile.integrations.batching import prompt_bound_bytes, window_bytes

    plan = kvcompile.KVCompileCache(full_budget("snapkv", 64, len(KINDS)), tiny_gemma3().config).plan
    per_token = 2 * 2 * 16 * 4
    assert window_bytes(plan, 5, 4) == len(LOCAL) * 5 * per_token
    assert window_bytes(plan, 500, 4) == len(LOCAL) * (WINDOW - 1) * per_token
    without = dataclasses.replace(plan, layer_kinds=None)
    assert prompt_bound_bytes(plan, 40, 4, 4, False) - prompt_bound_bytes(without, 40, 4, 4, False) == \
        len(LOCAL) * (WINDOW - 1) * per_token


# --- Gemma 2: soft-capped logits (cap·tanh(s/cap) before the softmax), hybrid like Gemma 3 -----------------------

CAP = 5.0  # small enough that the cap bends most logits of the peaked tiny model (Gemma 2 itself: 50)


def tiny_gemma2(seed: int = 0):
    """4 layers alternating local (12-token window) and global, logits soft-capped at CAP, the plain model in
    transformers' eager attention (its SDPA path does not apply the cap)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                          sliding_window=WINDOW, attn_logit_softcapping=CAP, max_position_embeddings=1024,
                          attn_implementation="eager", pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = Gemma2ForCausalLM(config)
    peaked(model)
    model.generation_config.pad_token_id = 0
    return model.eval()


def _softcapped_reference(q, k, v, sees, scale, cap):
    """softmax(cap·tanh(q·kᵀ·scale / cap)) · v over the keys `sees` allows, written out (GQA: KV heads
    repeated)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = cap * torch.tanh((q @ k.transpose(-1, -2)) * scale / cap)
    return torch.softmax(logits.masked_fill(~sees, float("-inf")), dim=-1) @ v


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 9), past=st.integers(0, 20), pads=st.integers(0, 3), cap=st.sampled_from([2.0, 5.0, 50.0]),
       window=st.sampled_from([None, 4, 12]), seed=st.integers(0, 2 ** 16))
def test_softcapped_prompt_and_window_attention_equal_the_reference(t, past, pads, cap, window, seed):
    """The prompt's attention and a local layer's window attention apply the cap before the softmax, as the
    written-out reference does, for any lengths, left pads (row 1) and cap."""
    from kvcompile.engine.prefill import prompt_attention
    from kvcompile.engine.window import window_attention

    g = torch.Generator().manual_seed(seed)
    n = past + t
    q = torch.randn(2, 4, t, 8, generator=g) * 3
    k, v = torch.randn(2, 2, n, 8, generator=g) * 3, torch.randn(2, 2, n, 8, generator=g)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :min(pads, n - 1)] = False
    i, p = torch.arange(t)[:, None] + past, torch.arange(n)[None, :]
    sees = (p <= i) & (p > i - (window or n + 1)) & valid[:, None, None, :]
    want = _softcapped_reference(q, k, v, sees, 0.3, cap)
    got = window_attention(q, k, v, valid, 0.3, window, past, cap) if window else \
        prompt_attention(q, k, v, None if bool(valid.all()) else valid, 0.3, past, softcap=cap)
    real = valid[:, None, past:, None].expand_as(got)  # a pad query's output is never read
    assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=4, max_size=4), cap=st.sampled_from([2.0, 5.0, 50.0]),
       seed=st.integers(0, 2 ** 16))
def test_softcapped_decode_attention_equals_the_reference(lengths, cap, seed):
    """The decode attention of a soft-capped model (the eager lowering with the cap) over paged entries: each
    (sequence, KV head) its own length, the reference over the same entries."""
    from kvcompile.kernels.paged_attention import SoftcapPagedAttention

    g = torch.Generator().manual_seed(seed)
    b, h, s, d, pages = 2, 2, 4, 8, 10
    q = torch.randn(b, 2 * h, d, generator=g) * 3
    k_pages, v_pages = torch.randn(b * h * pages, s, d, generator=g) * 3, torch.randn(b * h * pages, s, d, generator=g)
    block_table = torch.randperm(b * h * pages, generator=g).view(b, h, pages)
    length = torch.tensor(lengths).view(b, h)
    got = SoftcapPagedAttention(cap)(q, k_pages, v_pages, block_table, length, None, 0.3)
    for bi in range(b):
        for hi in range(h):
            n = int(length[bi, hi])
            if n == 0:
                continue
            keys = k_pages[block_table[bi, hi]].reshape(-1, d)[:n]
            values = v_pages[block_table[bi, hi]].reshape(-1, d)[:n]
            rows = q[bi, 2 * hi:2 * hi + 2]
            want = torch.softmax(cap * torch.tanh(rows @ keys.T * 0.3 / cap), dim=-1) @ values
            assert_close(got[bi, 2 * hi:2 * hi + 2], want, rtol=1e-5, atol=1e-5)


def check_full_budget(model, name: str, remove_feature) -> None:
    """At a budget that keeps everything, the compiled model's logits and greedy tokens are the plain
    (eager) model's; and the feature matters: the plain model's logits move once `remove_feature()` ran."""
    ids, mask = padded_batch()
    real = mask.bool()
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask).logits
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        with kvcompile.compiled(model, full_budget(name, ids.shape[1] + NEW, 4)):
            logits = model(ids, attention_mask=mask).logits
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        remove_feature()
        without = model(ids, attention_mask=mask).logits
    assert_close(logits[real], ref_logits[real], rtol=1e-5, atol=1e-5)
    assert got.tolist() == ref.tolist()
    assert (without[real] - ref_logits[real]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["streamingllm", "knorm"])
def test_gemma2_full_budget_equals_the_plain_model(name):
    """Soft-capped logits through the op (prompt, local windows, decode): logits and greedy tokens of the plain
    (eager) Gemma 2 at a budget that keeps everything; the cap matters here (without it the logits differ)."""
    model = tiny_gemma2()

    def uncap():
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None

    check_full_budget(model, name, uncap)


@pytest.mark.parametrize("name", ["expected_attention", "expected_zsmerge"])
def test_gemma2_expected_attention_is_refused(name):
    """Expected attention's closed form has none under the cap: refused with the reason, the model unchanged. (The
    attention-reading scorers apply the cap: tests/test_hybrid_scorers.py; merges, quantized pages and a chunked
    prompt run under it: tests/test_hybrid_capped_paths.py.)"""
    model = tiny_gemma2()
    with pytest.raises(kvcompile.CompileError, match="model type 'gemma2' soft-caps its attention logits "
                                                     "\\(attn_logit_softcapping=5.0: cap·tanh\\(s/cap\\) before the "
                                                     "softmax\\), and scoring: expected_attention scores entries by "
                                                     "the expected attention of future queries, whose closed form .* "
                                                     "has none under the cap"):
        kvcompile.compile(model, name)
    assert "forward" not in model.__dict__


# --- gpt-oss: learned sinks (one logit per query head in the softmax's denominator), hybrid too -----------------

def tiny_gpt_oss(seed: int = 0):
    """4 layers alternating local (12-token window) and global, 4 experts, sinks drawn with spread (the default
    init leaves them near 0), the plain model in transformers' eager attention (the one that adds the sinks)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=1024,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          attn_implementation="eager", pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = GptOssForCausalLM(config)
    peaked(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.generation_config.pad_token_id = 0
    return model.eval()


def _sink_reference(q, k, v, sees, scale, sinks):
    """softmax over [q·kᵀ·scale, sink] with the sink's column dropped, · v, written out."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~sees, float("-inf"))
    weights = torch.exp(logits)
    return (weights / (weights.sum(-1, keepdim=True) + torch.exp(sinks).view(1, -1, 1, 1))) @ v


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 9), past=st.integers(0, 20), pads=st.integers(0, 3), window=st.sampled_from([None, 4, 12]),
       seed=st.integers(0, 2 ** 16))
def test_prompt_and_window_attention_with_sinks_equal_the_reference(t, past, pads, window, seed):
    from kvcompile.engine.prefill import prompt_attention
    from kvcompile.engine.window import window_attention

    g = torch.Generator().manual_seed(seed)
    n = past + t
    q = torch.randn(2, 4, t, 8, generator=g)
    k, v = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
    sinks = torch.randn(4, generator=g) * 2
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :min(pads, n - 1)] = False
    i, p = torch.arange(t)[:, None] + past, torch.arange(n)[None, :]
    sees = (p <= i) & (p > i - (window or n + 1)) & valid[:, None, None, :]
    want = _sink_reference(q, k, v, sees, 0.3, sinks)
    got = window_attention(q, k, v, valid, 0.3, window, past, sinks=sinks) if window else \
        prompt_attention(q, k, v, None if bool(valid.all()) else valid, 0.3, past, sinks=sinks)
    real = valid[:, None, past:, None].expand_as(got)
    assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=4, max_size=4), seed=st.integers(0, 2 ** 16))
def test_decode_attention_with_sinks_equals_the_reference(lengths, seed):
    from kvcompile.kernels.paged_attention import SoftcapPagedAttention

    g = torch.Generator().manual_seed(seed)
    b, h, s, d, pages = 2, 2, 4, 8, 10
    q = torch.randn(b, 2 * h, d, generator=g)
    k_pages, v_pages = torch.randn(b * h * pages, s, d, generator=g), torch.randn(b * h * pages, s, d, generator=g)
    block_table = torch.randperm(b * h * pages, generator=g).view(b, h, pages)
    length = torch.tensor(lengths).view(b, h)
    sinks = torch.randn(2 * h, generator=g) * 2
    got = SoftcapPagedAttention(0.0, sinks)(q, k_pages, v_pages, block_table, length, None, 0.3)
    for bi in range(b):
        for hi in range(h):
            n = int(length[bi, hi])
            keys = k_pages[block_table[bi, hi]].reshape(-1, d)[:n]
            values = v_pages[block_table[bi, hi]].reshape(-1, d)[:n]
            rows = q[bi, 2 * hi:2 * hi + 2]
            w = torch.exp(rows @ keys.T * 0.3)
            want = (w / (w.sum(-1, keepdim=True) + torch.exp(sinks[2 * hi:2 * hi + 2])[:, None])) @ values
            assert_close(got[bi, 2 * hi:2 * hi + 2], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["streamingllm", "knorm"])
def test_gpt_oss_full_budget_equals_the_plain_model(name):
    """The sinks through the op (prompt, local windows, decode): logits and greedy tokens of the plain (eager)
    gpt-oss at a budget that keeps everything; the sinks matter here (other sinks give other logits)."""
    model = tiny_gpt_oss()

    def zero_sinks():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()

    check_full_budget(model, name, zero_sinks)


def test_a_cache_planned_without_the_sinks_is_refused_on_gpt_oss():
    """A cache whose plan came from the config alone (no sinks read off the model) refuses the sinked attention."""
    model = tiny_gpt_oss()
    policy = full_budget("streamingllm", 60, 4)
    cache = KVCompileCache(policy, model.config)  # a plan from the config alone: no sinks
    with torch.no_grad(), kvcompile.compiled(model, policy):
        with pytest.raises(RuntimeError, match="learned attention sinks .* the cache's plan has none"):
            model(prompt(10), **cache_arg.given(cache))


def test_a_prompt_compressed_chunk_by_chunk_leaves_local_layers_to_their_window(model):
    """schedule.prefill: chunk (the prompt runs in forwards of 8 tokens, compressed after each) at a budget that
    keeps everything: the local layers see the prompt chunk after chunk and give the plain model's tokens."""
    ids, mask = padded_batch()
    policy = kvcompile.load_spec("snapkv", per_head=120, schedule={"prefill": {"chunk": 8}})
    assert policy.schedule.chunk_tokens == 8
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        with kvcompile.compiled(model, policy):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert got.tolist() == ref.tolist()


def test_prefill_once_compress_many_carries_the_local_layers(model):
    """kvcompile.tools.sweep (the needle and RULER evals' prefill once, compress many): the captured prompt's local
    layers go with every replayed policy, so a replayed cache decodes the tokens of the compiled model's own
    prefill; states without them are refused on a hybrid model."""
    from kvcompile.tools.sweep import capture, greedy, replay

    ids = prompt(40, seed=12)
    policy = kvcompile.load_spec("snapkv", per_head=36)
    with torch.no_grad():
        states, logits = capture(model, ids)
        cache = replay(policy, model.config, states, headroom=NEW)
        tokens = greedy(model, cache, logits, NEW)
        with kvcompile.compiled(model, policy):
            own = model.generate(ids, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1]:]
    assert own.shape[1] >= 5 and tokens[:, :own.shape[1]].tolist() == own.tolist()  # (generate stops at eos)
    assert [w is not None for w in cache.windows] == [k == "sliding_attention" for k in KINDS]
    with pytest.raises(ValueError, match="hybrid model .* needs its local layers' windows"):
        replay(policy, model.config, list(states))


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with the gloo backend is not available in this torch build")
def test_tensor_parallelism_on_hybrid_models_equals_one_process(tmp_path):
    """transformers' tp_plan="auto" on 2 gloo processes, tiny Gemma 3 and Gemma 2 (soft-capped) in float64, at
    budgets that evict: each rank holds its own KV head's pages and windows, and the kept entries, the windows'
    keys and the generated tokens are a one-process run's. (gpt-oss: transformers' tensor-parallel plan does not
    split its attention by heads, which compile() refuses with the reason.)"""
    from transformers import AutoModelForCausalLM
    from tp_run import run_specs, spawn

    names = ["snapkv", "lava", "h2o"]
    jobs = []
    for key, build in (("gemma3", tiny_gemma3), ("gemma2", tiny_gemma2)):
        build().save_pretrained(tmp_path / key)
        jobs.append((key, str(tmp_path / key), names))
    gpt_oss = tiny_gpt_oss()
    gpt_oss.save_pretrained(tmp_path / "gpt_oss")
    jobs.append(("refuse:gpt_oss", str(tmp_path / "gpt_oss"), "knorm"))
    ranks = spawn(2, jobs, tmp_path, 1800)  # (a hang guard only: ~1 min)
    assert all("q_proj, k_proj and v_proj split 'colwise'" in r["refuse:gpt_oss"] for r in ranks)
    for key, _, _ in jobs[:2]:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / key, dtype=torch.float64).eval()
        model.generation_config.pad_token_id = 0
        one = run_specs(model, names)
        for name in names:
            for rank, r in enumerate(ranks):
                got = r[key][name]
                assert got["kv_heads"] == (rank,) and got["tokens"] == one[name]["tokens"], (key, name)
                assert {k: v[:2] for k, v in got["entries"].items()} == \
                    {k: v[:2] for k, v in one[name]["entries"].items() if k[2] == rank}, (key, name)
                assert sorted(got["windows"]) == sorted(one[name]["windows"]) != []
                for field in ("bytes_by_kind", "bytes_full_by_kind"):  # over all ranks: one process's
                    assert got["gathered"][field] == one[name]["report"][field], (key, name, field)
                    assert set(got["report"][field]) == {"full_attention", "sliding_attention"}
                for layer, keys in got["windows"].items():
                    assert keys.shape[1] == 1
                    assert_close(keys, one[name]["windows"][layer][:, rank:rank + 1], rtol=1e-9, atol=1e-9)
