"""Query-agnostic scoring (expected_attention, key_norm) and one compressed context reused across
questions and turns (kvcompile.integrations.context): the runtime against the eager references, how the parts
compose with every allocator, merge rule and schedule, and what is refused up front."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close
from transformers import DynamicCache

import kvcompile
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from kvcompile.layer_state import LayerState
from kvcompile.plan import PlanError, build_plan
from kvcompile.policies.scoring import ExpectedAttention, KeyNorm
from kvcompile.spec import SpecError, loads_spec
from kvcompile.tools.sweep import capture
from test_decode import assert_same_cache
from tiny import prompt, tiny_model


def rope_of(d: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def rotated(x: torch.Tensor, mask: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, d) pre-RoPE → post-RoPE at each real token's position (its index among real tokens)."""
    out = x.clone()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    for b in range(x.shape[0]):
        for i in range(x.shape[2]):
            out[b, :, i] = x[b, :, i].double() @ reference.rope_matrix(rope, int(positions[b, i])).T
    return out.float()


# --- the part against its eager reference ------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 3), n=st.integers(2, 14), pad=st.integers(0, 6),
       future=st.integers(1, 40), sinks=st.integers(0, 5), covariance=st.booleans(), value_norm=st.booleans(),
       epsilon=st.sampled_from([0.0, 0.02]), scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 999))
def test_expected_attention_equals_the_paper_written_out(b, h, g, n, pad, future, sinks, covariance, value_norm,
                                                         epsilon, scale, seed):
    """The part (queries moved to position n with relative rotations, post-RoPE) equals the reference
    (pre-RoPE queries by un-rotating at absolute positions, mean rotation over n … n+T−1 as kvpress builds it)."""
    d = 8
    gen = torch.Generator().manual_seed(seed)
    rope = rope_of(d)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :min(pad, n - 1)] = False
    q = rotated(torch.randn(b, h * g, n, d, generator=gen), mask, rope)
    k = rotated(torch.randn(b, h, n, d, generator=gen), mask, rope)
    v = torch.randn(b, h, n, d, generator=gen)
    part = ExpectedAttention(future=future, sinks=sinks, covariance=covariance, value_norm=value_norm,
                             epsilon=epsilon)
    state = LayerState(q, k, v, mask if pad else None, scale, rope)
    assert_close(part.score(state), reference.expected_attention(part, state), rtol=1e-4, atol=1e-5)


def test_padded_sequence_scores_as_if_alone():
    d, rope = 8, rope_of(8)
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 9, d, generator=gen), torch.randn(1, 2, 9, d, generator=gen), torch.randn(1, 2, 9, d)
    part = ExpectedAttention(future=16, sinks=2)
    alone = part.score(LayerState(q, k, v, None, None, rope))
    pad = lambda x: torch.cat([torch.randn(*x.shape[:2], 3, d, generator=gen), x], dim=2)  # noqa: E731
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 9, dtype=torch.bool)], dim=1)
    padded = part.score(LayerState(pad(q), pad(k), pad(v), mask, None, rope))
    assert_close(padded[..., 3:], alone, rtol=1e-5, atol=1e-6)
    assert bool(torch.isinf(padded[..., :3]).all())


def test_sinks_are_ranked_first_and_scores_are_attention_mass():
    d, rope = 8, rope_of(8)
    gen = torch.Generator().manual_seed(2)
    state = LayerState(torch.randn(1, 2, 12, d, generator=gen), torch.randn(1, 1, 12, d, generator=gen),
                       torch.randn(1, 1, 12, d, generator=gen), None, None, rope)
    s = ExpectedAttention(sinks=3, value_norm=False).score(state)[0, 0]
    assert bool((s[:3] > s[3:].max()).all())
    assert_close(s[3:].sum(), torch.tensor(1.0))  # a softmax over the non-sink keys, mean over the group
    assert bool((ExpectedAttention().score(state) >= 0).all())


def test_key_norm_of_the_context_does_not_change_when_a_question_follows():
    """key_norm reads each key alone: a context's scores are the same with or without what follows."""
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 20, 8, generator=gen), torch.randn(2, 2, 20, 8, generator=gen)
    q = torch.randn(2, 4, 20, 8, generator=gen)
    whole = KeyNorm().score(LayerState(q, k, v))
    context = KeyNorm().score(LayerState(q[:, :, :12], k[:, :, :12], v[:, :, :12]))
    assert torch.equal(whole[..., :12], context)


# --- composition: every allocator and merge rule through the runtime, equal to reference.compress -------

EA = {"expected_attention": {"future": 64, "sinks": 2, "epsilon": 0.01}}
COMPOSED = {
    "ea_uniform": dict(scoring=EA, budget={"per_head": 10}),
    "ea_pooled": dict(scoring=EA, budget={"per_head": 10, "heads": {"pooled": {"floor": 0.2}}}),
    "ea_pyramid": dict(scoring=EA, budget={"per_head": 10, "layers": {"pyramid": {"beta": 4}}}),
    "ea_entropy": dict(scoring=EA, budget={"per_head": 10, "layers": "entropy", "heads": "pooled"}),
    "ea_cascade": dict(scoring=EA, budget={"per_head": 10}, schedule="cascade"),
    "ea_threshold": dict(scoring=EA, budget={"threshold": {"attention_norm": {"t": 0.05, "keep_layers": 1}}}),
    "ea_zsmerge": dict(scoring=EA, budget={"per_head": 10, "split": {"proximity": 0.2, "context": 0.6,
                                                                     "residual": 0.2}}, merge="residual"),
    "knorm_pooled": dict(scoring="key_norm", budget={"per_head": 10, "heads": "pooled"}),
    "knorm_pyramid": dict(scoring="key_norm", budget={"per_head": 10, "layers": "pyramid"}),
    "knorm_zsmerge": dict(scoring="key_norm", budget={"per_head": 10, "split": {"proximity": 0.2, "context": 0.6,
                                                                                "residual": 0.2}},
                          merge="residual"),
}


@pytest.mark.parametrize("key", sorted(COMPOSED))
def test_generate_keeps_what_the_reference_keeps(key):
    policy = kvcompile.load_spec({"name": key, **COMPOSED[key]})
    model = tiny_model("llama")
    ids = prompt(40, batch=2, seed=3)
    cache = KVCompileCache(policy, model.config, record=True)
    with kvcompile.compiled(model, policy), torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=2,
                       do_sample=False)
    selection = reference.compress(policy, cache.states)
    evicted = 0
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(cache.kept_positions(layer), selection.kept[layer]), f"layer {layer}"
        evicted += int((~selection.kept[layer]).sum())
        if policy.merges:
            assert torch.equal(cache.stores[layer].slots, (selection.merged[layer].counts > 0).sum(-1))
    assert evicted > 0


CHUNKED_EA = {"name": "ea_chunked", "scoring": EA, "budget": {"per_head": 6}, "schedule": {"prefill": {"chunk": 5}}}


def chunks_equal_the_reference(cache: KVCompileCache, ref, pad: int) -> None:
    """A prompt of 17 random positions (2 rows, the first with `pad` left pads; 2 layers of 2 KV heads with groups of
    2, head dim 8) given chunk by chunk (5) to the op over `cache` and to reference.ChunkedPrefill `ref`: each
    chunk's outputs equal, and then every layer's kept entries."""
    b, h, g, n, d, layers = 2, 2, 2, 17, 8, 2
    cache.expect_prompt(n)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :pad] = False
    gen = torch.Generator().manual_seed(5)
    for start in range(0, n, 5):
        end = min(start + 5, n)
        for layer in range(layers):
            q, k, v = (torch.randn(b, x, end - start, d, generator=gen) for x in (h * g, h, h))
            got = torch.ops.kvcompile.attend(q, k, v, mask[:, :end], layer, cache.ref, cache.token, d ** -0.5)
            want = ref.step(layer, q, k, v, mask[:, start:end], d ** -0.5)
            assert_close(got, want, rtol=1e-4, atol=1e-5)
    for layer in range(layers):
        assert_same_cache(cache.stores[layer].to_heads(), ref.heads[layer])


@pytest.mark.parametrize("pad", [0, 3])
def test_chunked_prefill_equals_the_reference_chunk_by_chunk(pad):
    """schedule.prefill: chunk: each chunk's queries give the statistics; held entries and the chunk are scored."""
    policy = kvcompile.load_spec(CHUNKED_EA)
    h, g, d, layers = 2, 2, 8, 2
    config = SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d, rope_theta=10000.0)
    chunks_equal_the_reference(KVCompileCache(policy, config, page_size=4),
                               reference.ChunkedPrefill(policy, layers, rope=rope_of(d)), pad)


def test_tensor_parallel_ranks_gather_only_what_the_allocator_needs():
    """Per-head local scorers (a KV head reads its own keys, values and its group's queries): a rank scores
    its own heads; what its selection gathers is the allocator's (uniform: counts; pooled heads: scores)."""
    from kvcompile.plan import _heads_exchange

    for spec, exchange in (("expected_attention", "counts"), ("expected_adakv", "scores"), ("knorm", "counts"),
                           ("expected_zsmerge", "counts")):
        policy = kvcompile.load_spec(spec, per_head=8)
        assert policy.scoring.head_local
        assert _heads_exchange(policy, SimpleNamespace(num_heads=2), 2) == exchange


# --- refused up front ----------------------------------------------------------------------------

def test_bad_fields_and_combinations_name_file_line_and_field():
    good = "name: x\nscoring: {expected_attention: {future: 8}}\nbudget: {per_head: 8}\n"
    loads_spec(good)
    for text, field in (("future: 0", "scoring.expected_attention.future"),
                        ("sinks: -1", "scoring.expected_attention.sinks"),
                        ("epsilon: -0.5", "scoring.expected_attention.epsilon"),
                        ("covariance: 3", "scoring.expected_attention.covariance")):
        with pytest.raises(SpecError) as err:
            loads_spec(good.replace("future: 8", text))
        assert err.value.field == field and err.value.line == 2
    for budget in ("{per_head: 8, layers: entropy}", "{threshold: attention_norm}"):
        with pytest.raises(SpecError, match="negative scores") as err:
            loads_spec(f"name: x\nscoring: key_norm\nbudget: {budget}\n")
        assert err.value.line == 3
    with pytest.raises(SpecError, match="decode: every"):  # it would keep every query row cached
        loads_spec(good + "schedule: {decode: {every: 4}}\n")


def test_a_model_without_fixed_rotary_frequencies_is_refused_at_compile():
    policy = kvcompile.load_spec("expected_attention", per_head=8)
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4, head_dim=8,
                             hidden_size=32)
    with pytest.raises(PlanError, match="rotary"):
        build_plan(policy, config)
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(PlanError, match="change with length"):
        build_plan(policy, config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    assert_close(torch.tensor(build_plan(policy, config).rope), rope_of(8))
    model = tiny_model("llama")
    assert_close(torch.tensor(build_plan(policy, model.config).rope), model.model.rotary_emb.inv_freq)


# --- one compressed context, many questions and turns ---------------------------------------------

def plain_generate(model, ids, new):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)


@pytest.mark.parametrize("spec", ["expected_attention", "knorm"])
def test_budget_covering_everything_equals_the_plain_model(spec):
    model = tiny_model("llama")
    context, q1, q2, q3 = prompt(30, seed=3), prompt(5, seed=4), prompt(7, seed=5), prompt(3, seed=6)
    ctx = kvcompile.compress_context(model, context, spec, ratio=1.0)
    for question in (q1, q2, q1):
        got = ctx.generate(question, max_new_tokens=6, return_dict_in_generate=True, output_logits=True)
        want = plain_generate(model, torch.cat([context, question], 1), 6)
        assert got.sequences.tolist() == want.sequences.tolist()
        assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4)
    assert ctx.cache.seq_length == 30  # answers ran on copies
    chat = ctx.conversation()
    a1, a2 = chat.say(q2, max_new_tokens=4), chat.say(q3, max_new_tokens=5)
    w1 = plain_generate(model, torch.cat([context, q2], 1), 4).sequences
    w2 = plain_generate(model, torch.cat([w1, q3], 1), 5).sequences
    assert a1.tolist() == w1[:, -4:].tolist() and a2.tolist() == w2[:, -5:].tolist()
    assert chat.ids.tolist() == w2.tolist()


def reference_answer(model, policy, context, turns, new):
    """The reference semantics, eagerly: reference.compress keeps entries of the context (its captured
    states); a transformers DynamicCache holds them (uniform heads: the same count per head); each turn's
    tokens and then its greedy answer are fed one at a time at their positions, attending to every entry
    held; the fed tokens stay in the cache. Returns the answers and each answer's logits."""
    states, last = capture(model, context)
    states = [dataclasses.replace(state, rope=model.model.rotary_emb.inv_freq) for state in states]
    selection = reference.compress(policy, states)
    cache = DynamicCache(config=model.config)
    for layer, state in enumerate(states):
        kept = selection.kept[layer][0]  # (H, N)
        keys = torch.stack([state.keys[0, h, kept[h]] for h in range(kept.shape[0])])[None]
        values = torch.stack([state.values[0, h, kept[h]] for h in range(kept.shape[0])])[None]
        cache.update(keys, values, layer)
    position, logits, answers, rows = context.shape[1], last, [], []
    with torch.no_grad():
        for turn in turns:
            for token in turn[0].tolist():
                logits = model(torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                               past_key_values=cache, cache_position=torch.tensor([cache.get_seq_length()]),
                               use_cache=True).logits[:, -1]
                position += 1
            answer, turn_rows = [], []
            for step in range(new):
                turn_rows.append(logits)
                answer.append(int(logits.argmax(-1)))
                if step == new - 1:
                    break
                logits = model(torch.tensor([[answer[-1]]]), position_ids=torch.tensor([[position]]),
                               past_key_values=cache, cache_position=torch.tensor([cache.get_seq_length()]),
                               use_cache=True).logits[:, -1]
                position += 1
            # the last answer token is fed with the next turn (as generate() leaves it)
            turns_next = answer[-1:]
            for token in turns_next:
                logits = model(torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                               past_key_values=cache, cache_position=torch.tensor([cache.get_seq_length()]),
                               use_cache=True).logits[:, -1]
                position += 1
            answers.append(answer)
            rows.append(torch.cat(turn_rows))
    return answers, rows


@pytest.mark.parametrize("spec", ["expected_attention", "knorm"])
def test_compressed_context_answers_and_turns_equal_the_reference_semantics(spec):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None  # answers of max_new_tokens, as the reference generates them
    policy = kvcompile.load_spec(spec, per_head=12, ranking={"by_score": {"sinks": 0, "window": 0}})
    context, q1, q2 = prompt(40, seed=7), prompt(4, seed=8), prompt(6, seed=9)
    ctx = kvcompile.compress_context(model, context, policy)
    for question in (q1, q2):
        got = ctx.generate(question, max_new_tokens=5, return_dict_in_generate=True, output_logits=True)
        answers, rows = reference_answer(model, policy, context, [question], 5)
        assert got.sequences[0, -5:].tolist() == answers[0]
        assert_close(torch.cat(got.logits), rows[0], rtol=1e-4, atol=1e-4)
    chat = ctx.conversation()
    got = [chat.say(q1, max_new_tokens=4)[0].tolist(), chat.say(q2, max_new_tokens=4)[0].tolist()]
    answers, _ = reference_answer(model, policy, context, [q1, q2], 4)
    assert got == answers
    # the context was compressed before any question, as reference.compress compresses it alone
    states, _ = capture(model, context)
    selection = reference.compress(policy, [dataclasses.replace(x, rope=model.model.rotary_emb.inv_freq)
                                            for x in states])
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(ctx.cache.kept_positions(layer), selection.kept[layer])
    assert int(ctx.cache.stores[0].lengths.max()) == 12  # far fewer entries than the context's 40


@pytest.mark.parametrize("spec", ["expected_adakv", "knorm"])
def test_continuous_batching_equals_generate(spec):
    """Concurrent requests through transformers' engine, prompts split over forwards: each request's
    tokens equal generate()'s (the engine's prompt compression runs the same per-layer code, with the
    plan's rotary frequencies)."""
    from test_serving import prompts, serve
    from test_serving import reference as generate_alone

    model = kvcompile.compile(tiny_model(), spec, per_head=24)
    ids = prompts([70, 40, 110])
    tokens, _ = serve(model, ids, max_batch_tokens=64)
    assert tokens == [generate_alone(model, x) for x in ids]
