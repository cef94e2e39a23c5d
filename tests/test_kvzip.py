"""scoring: kvzip (context reconstruction, arXiv:2505.23416): the runtime's scores and kept entries
equal the plain reference's; what it keeps of a context does not depend on a later question; what it
cannot run is refused before anything runs."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
from kvcompile import reference
from kvcompile.errors import CompileError
from kvcompile.kvzip import RepeatPrompt
from kvcompile.spec import SpecError, load_spec
from tiny import left_pad, prompt, tiny_model

REPEAT = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12))  # token ids of a tiny vocabulary


def run(model, policy, ids):
    """The cache a compiled model's forward leaves after the prompt `ids` (its reconstruction included)."""
    with kvcompile.compiled(model, policy, repeat_prompt=REPEAT), torch.no_grad():
        return model(ids, use_cache=True).past_key_values


def kept_scores(cache, layer):
    """(B, H, N) the scores the cache stored for its kept prompt entries, 0 elsewhere."""
    _, _, scores, pos, _, stored = cache.stores[layer].gather()
    b, h = pos.shape[:2]
    out = torch.zeros(b, h, cache.prompt_width)
    bi, hi, ei = (stored & (pos >= 0)).nonzero(as_tuple=True)
    out[bi, hi, pos[bi, hi, ei]] = scores[bi, hi, ei]
    return out


@settings(max_examples=6, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4]), n=st.integers(24, 80), batch=st.integers(1, 2),
       chunk=st.integers(9, 90), sinks=st.integers(0, 5), overlap=st.integers(0, 6),
       spec=st.sampled_from(["kvzip", "kvzip_adakv"]), arch=st.sampled_from(["llama", "qwen2"]))
def test_scores_and_kept_equal_the_reference(kv_heads, n, batch, chunk, sinks, overlap, spec, arch):
    model = tiny_model(arch, kv_heads=kv_heads)
    policy = load_spec(spec, per_head=12, scoring={"kvzip": {"chunk": chunk, "sinks": sinks, "overlap": overlap}})
    ids = prompt(n, batch=batch, seed=n)
    cache = run(model, policy, ids)
    scores, states = reference.kvzip_scores(model, ids, REPEAT, policy.scoring)
    expected = reference.compress(policy, states, scores=scores)
    assert cache.seq_length == n  # the reconstruction forwards added nothing
    for layer in range(model.config.num_hidden_layers):
        kept = cache.kept_positions(layer)
        assert torch.equal(kept, expected.kept[layer]), f"layer {layer}"
        assert_close(kept_scores(cache, layer), torch.where(kept, scores[layer], 0.0))
    assert torch.equal(cache.kept(), expected.budgets)



def test_reconstruction_scores_come_from_the_attentions_logits(monkeypatch):
    """Where the C++ attention kernel runs (fp32 CPU), a reconstruction forward's scores come from the logits its
    attention computes: no layer runs KVzip's score pass a second time, and the kept entries are the reference's."""
    from kvcompile.kernels.attention_column_sums import runs_here
    from kvcompile.policies.scoring import KVzip

    if not runs_here(torch.device("cpu"), torch.float32, 16):
        pytest.skip("no C++ toolchain: the scorer's own pass runs")
    calls = []
    original = KVzip.score_keys
    monkeypatch.setattr(KVzip, "score_keys", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    model = tiny_model("llama", kv_heads=2)
    policy = load_spec("kvzip", per_head=12, scoring={"kvzip": {"chunk": 20, "sinks": 4, "overlap": 3}})
    ids = prompt(50, seed=5)
    cache = run(model, policy, ids)
    assert calls == []
    scores, states = reference.kvzip_scores(model, ids, REPEAT, policy.scoring)
    expected = reference.compress(policy, states, scores=scores)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(cache.kept_positions(layer), expected.kept[layer]), f"layer {layer}"


def test_reconstruction_forwards_compute_one_position_of_logits():
    """The reconstruction forwards' logits are never read: the model's head runs at one position of each (the
    prompt's own forward keeps all its logits, as the model does)."""
    model = tiny_model("llama", kv_heads=2)
    policy = load_spec("kvzip", per_head=12, scoring={"kvzip": {"chunk": 20, "sinks": 4, "overlap": 3}})
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    try:
        run(model, policy, prompt(50, seed=5))
    finally:
        hook.remove()
    assert rows == [50, 1, 1, 1]  # the prompt, then its 3 chunks' reconstruction forwards

def test_every_entry_gets_a_score_from_its_own_chunk():
    """The scores are attention probabilities of every prompt entry (chunks cover the prompt once)."""
    model = tiny_model("llama")
    scorer = load_spec("kvzip", scoring={"kvzip": {"chunk": 16}}).scoring
    scores, _ = reference.kvzip_scores(model, prompt(50, seed=4), REPEAT, scorer)
    assert scorer.chunks(50) == [(0, 16), (16, 32), (32, 48), (48, 50)]
    for s in scores:
        assert bool((s > 0).all()) and bool((s <= 1).all())


@pytest.mark.parametrize("spec", ["kvzip", "kvzip_adakv"])
def test_kept_context_does_not_depend_on_the_question(spec):
    """Compress a context C, then append a question: whatever the question, the kept entries of C are
    the same (they are computed from C alone); a query-aware scorer over C + question is not."""
    model = tiny_model("llama")
    context = prompt(90, seed=7)
    questions = [prompt(12, seed=s) for s in (8, 9, 10)]
    policy = load_spec(spec, per_head=16)
    cache = run(model, policy, context)
    before = [cache.kept_positions(layer) for layer in range(3)]
    with kvcompile.compiled(model, policy, repeat_prompt=REPEAT), torch.no_grad():
        for q in questions:
            answer = copy.deepcopy(cache)
            model(q, past_key_values=answer, use_cache=True)
            assert answer.seq_length == 90 + 12
            for layer in range(3):
                assert torch.equal(answer.kept_positions(layer)[..., :90], before[layer])
    snap = load_spec("snapkv", per_head=16, ranking={"by_score": {"window": 8}},
                     scoring={"window_attention": {"window": 8}})
    with kvcompile.compiled(model, snap), torch.no_grad():
        aware = [model(torch.cat([context, q], 1), use_cache=True).past_key_values.kept_positions(1)[..., :90]
                 for q in questions]
    assert not all(torch.equal(aware[0], a) for a in aware[1:])  # the question moves a query-aware selection


def test_generate_with_everything_kept_is_the_model():
    """A budget covering the prompt: generate() equals the plain model's (the reconstruction changes nothing)."""
    model = tiny_model("llama")
    ids = prompt(40, batch=2, seed=11)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    with kvcompile.compiled(model, "kvzip", per_head=64, repeat_prompt=REPEAT), torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.tolist() == plain.tolist()
    assert out.past_key_values.seq_length == 40 + 7


def test_generate_equals_greedy_from_the_compressed_cache():
    """generate() under kvzip continues from the cache the prompt's forward compressed (the eager entry)."""
    model = tiny_model("qwen2")
    ids = prompt(70, seed=12)
    policy = load_spec("kvzip_adakv", per_head=16, scoring={"kvzip": {"chunk": 32}})
    with kvcompile.compiled(model, policy, repeat_prompt=REPEAT), torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        first = model(ids, use_cache=True)
        cache, tokens = first.past_key_values, [first.logits[:, -1].argmax(-1, keepdim=True)]
        assert int(cache.kept()[0].sum()) < 70 * 2  # compressed
        for _ in range(5):
            logits = model(tokens[-1], past_key_values=cache, use_cache=True).logits[:, -1]
            tokens.append(logits.argmax(-1, keepdim=True))
    assert torch.cat(tokens, 1).tolist() == out.sequences[:, 70:].tolist()


def test_refused_up_front():
    model = tiny_model("llama")
    with pytest.raises(CompileError, match="mode='eager'"):
        kvcompile.compile(model, "kvzip", mode="compiled", repeat_prompt=REPEAT)
    with pytest.raises(CompileError, match="tokenizer"):
        kvcompile.compile(model, "kvzip")
    with pytest.raises(CompileError, match="schedule"):
        kvcompile.compile(model, "kvzip", repeat_prompt=REPEAT, schedule={"decode": {"every": 8}})
    ids, mask = left_pad([prompt(30, seed=1)[0], prompt(20, seed=2)[0]])
    with kvcompile.compiled(model, "kvzip", repeat_prompt=REPEAT), torch.no_grad():
        with pytest.raises(CompileError, match="unpadded"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2)
        with pytest.raises(CompileError, match="prefill_chunk_size"):
            model.generate(prompt(30), max_new_tokens=2, prefill_chunk_size=8)
    assert not hasattr(model, "kvcompile_plan")


@pytest.mark.parametrize("field, value", [("chunk", 0), ("sinks", -1), ("overlap", 1.5)])
def test_fields_out_of_range_are_spec_errors(field, value):
    with pytest.raises(SpecError, match=field):
        load_spec("kvzip", scoring={"kvzip": {field: value}})


def test_repeat_prompt_from_smollm2_tokenizer():
    """KVzip's prompts in SmolLM2's chat template (the turn end and the assistant's start before the
    chunk), found by compile() in the model's checkpoint folder."""
    from transformers import AutoTokenizer

    from kvcompile.kvzip import repeat_prompt_for
    from kvcompile.tools.models import default_model_dir, is_converted, load_model

    if not is_converted():
        pytest.skip("SmolLM2 is not converted here (scripts/setup.sh)")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    repeat = RepeatPrompt.from_tokenizer(tokenizer)
    assert tokenizer.decode(list(repeat.first)) == "\n\nRepeat the previous context exactly."
    assert tokenizer.decode(list(repeat.suffix)) == "<|im_end|>\n<|im_start|>assistant\n"
    # the template's prefix (reconstruct: context skips it): its system prompt and the user turn's header,
    # which a chat prompt starts with (24 tokens, as kvpress's KVzipPress counts them)
    text = tokenizer.decode(list(repeat.prefix))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>user\n")
    assert len(repeat.prefix) == 24
    chat = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Some context."}],
                                                          add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    assert tuple(chat[:24]) == repeat.prefix
    model, _ = load_model()
    assert repeat_prompt_for(model) == repeat


def test_shipped_specs_say_what_kvzip_says():
    kvzip, hybrid, uniform = load_spec("kvzip"), load_spec("kvzip_adakv"), load_spec("kvzip_uniform")
    for policy in (kvzip, hybrid, uniform):
        assert (policy.scoring.chunk, policy.scoring.sinks, policy.scoring.overlap) == (2048, 4, 8)
        assert policy.ranking.sinks == 4 and policy.budget.per_head == 128
    # KVzip §4.1 "Eviction Structure": one ranking of every (layer, head, token) (kvpress KVzipPress(layerwise=False))
    assert kvzip.budget.layers.name == "global" and kvzip.budget.layers.floor == 0
    assert kvzip.budget.heads.name == "pooled" and kvzip.budget.heads.floor == 0
    assert uniform.budget.heads.name == "uniform" and uniform.budget.layers.name == "uniform"
    assert hybrid.budget.heads.name == "pooled" and hybrid.budget.heads.floor == 0.2


def test_a_layer_state_alone_cannot_score_it():
    """replay (prefill once, compress many) has no model to reconstruct with: refused with the reason."""
    from kvcompile.tools.sweep import capture, replay

    model = tiny_model("llama")
    states, _ = capture(model, prompt(30, seed=5))
    with pytest.raises(ValueError, match="cannot be replayed.*reconstruction"):
        replay(load_spec("kvzip", per_head=8), model.config, states)


def test_continuous_batching_is_refused():
    from kvcompile.integrations.batching import BatchingError, check_batching
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_model("llama")
    with kvcompile.compiled(model, "kvzip", repeat_prompt=REPEAT):
        with pytest.raises(BatchingError, match="kvzip"):
            check_batching(model, model.kvcompile_plan, GenerationConfig(), ContinuousBatchingConfig())


@settings(max_examples=5, deadline=None)
@given(kv_heads=st.sampled_from([1, 2]), n=st.integers(8, 40), t=st.integers(1, 30), rows=st.integers(1, 7),
       data=st.data())
def test_reconstruction_attention_and_scores_in_row_blocks(kv_heads, n, t, rows, data):
    """The reconstruction's attention equals SDPA over the cache and the own keys (causal), and its
    scores the plain softmax over KVzip's keys, whatever the row blocks."""
    from kvcompile.engine.reconstruction import _attention_after
    from kvcompile.policies.scoring import KVzip
    from kvcompile.engine.prefill import prompt_attention

    start = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(start + 1, n))
    scorer = KVzip(sinks=data.draw(st.integers(0, 5)))
    g = torch.Generator().manual_seed(n * 31 + t)
    hq, d = 4, 16
    q = torch.randn(2, hq, t, d, generator=g) * 2
    ck, cv = torch.randn(2, kv_heads, n, d, generator=g) * 2, torch.randn(2, kv_heads, n, d, generator=g)
    ok, ov = torch.randn(2, kv_heads, t, d, generator=g) * 2, torch.randn(2, kv_heads, t, d, generator=g)
    keys, values = torch.cat([ck, ok], 2), torch.cat([cv, ov], 2)
    best = scorer.score_reconstruction(q, ck, ok, start, end, 0.3, budget=2 * hq * (n + t) * rows)
    assert_close(_attention_after(q, keys, values, 0.3), prompt_attention(q, keys, values, None, 0.3, offset=n))
    sink = min(scorer.sinks, start)
    cols = torch.arange(n + t)
    seen = (cols < sink) | ((cols >= start) & (cols < end)) | ((cols >= n) & (cols - n <= torch.arange(t)[:, None]))
    logits = torch.einsum("bhtd,bhkd->bhtk", q, keys.repeat_interleave(hq // kv_heads, 1)) * 0.3
    probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1)[..., start:end].amax(2)
    assert_close(best, probs.view(2, kv_heads, hq // kv_heads, -1).amax(2))


PREFIXED = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12), prefix=(13, 14, 15, 16, 17, 18, 19))


@settings(max_examples=5, deadline=None)
@given(n=st.integers(30, 80), batch=st.integers(1, 2), chunk=st.integers(9, 40), sinks=st.integers(0, 5),
       overlap=st.integers(0, 6), spec=st.sampled_from(["kvzip", "kvzip_adakv"]))
def test_reconstruct_context_skips_the_template_prefix_as_the_reference_does(n, batch, chunk, sinks, overlap, spec):
    """reconstruct: context (KVzip's Algorithm 1, kvpress's KVzipPress): the chunks start after the chat
    template's prefix, the prefix's entries score 0; the runtime's scores and kept entries equal the reference's."""
    model = tiny_model("llama", kv_heads=2)
    policy = load_spec(spec, per_head=12, scoring={"kvzip": {"chunk": chunk, "sinks": sinks, "overlap": overlap,
                                                             "reconstruct": "context"}})
    p = len(PREFIXED.prefix)
    ids = torch.cat([torch.tensor([PREFIXED.prefix] * batch), prompt(n, batch=batch, seed=n)], dim=1)
    assert policy.scoring.context_start(ids, PREFIXED.prefix) == p
    assert policy.scoring.chunks(n + p, p)[0] == (p, min(p + chunk, n + p))
    with kvcompile.compiled(model, policy, repeat_prompt=PREFIXED), torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    scores, states = reference.kvzip_scores(model, ids, PREFIXED, policy.scoring)
    expected = reference.compress(policy, states, scores=scores)
    for layer in range(model.config.num_hidden_layers):
        assert bool((scores[layer][..., :p] == 0).all()) and bool((scores[layer][..., p:] > 0).all())
        kept = cache.kept_positions(layer)
        assert torch.equal(kept, expected.kept[layer]), f"layer {layer}"
        assert_close(kept_scores(cache, layer), torch.where(kept, scores[layer], 0.0))
    # reconstruct: prompt reconstructs the whole prompt: other scores
    whole, _ = reference.kvzip_scores(model, ids, PREFIXED, load_spec(spec, scoring={"kvzip": {
        "chunk": chunk, "sinks": sinks, "overlap": overlap, "reconstruct": "prompt"}}).scoring)
    assert bool((whole[0][..., :p] > 0).all())


def test_reconstruct_context_inputs_and_a_prompt_without_the_prefix():
    """The first span after the prefix gets `first` and quotes nothing; a later span quotes the previous span's
    last tokens, never the prefix's; a prompt that does not start with the prefix is reconstructed whole."""
    ids = torch.arange(100, 130)[None]
    first, later = PREFIXED.inputs(ids, [(7, 17), (17, 27)], overlap=4, origin=7)
    assert first[0].tolist() == [5, 6, 7, 8, 11, 12] + list(range(107, 117))
    assert later[0].tolist() == [9, 10, 113, 114, 115, 116, 11, 12] + list(range(117, 127))
    (short,) = PREFIXED.inputs(ids, [(9, 12)], overlap=4, origin=7)
    assert short[0].tolist() == [9, 10, 107, 108, 11, 12, 109, 110, 111]  # quotes from the origin on only
    scorer = load_spec("kvzip", scoring={"kvzip": {"reconstruct": "context"}}).scoring
    assert scorer.context_start(ids, PREFIXED.prefix) == 0  # no prefix at its start
    both = torch.cat([torch.tensor([PREFIXED.prefix]), ids[:, :5]], 1).expand(2, -1).clone()
    assert scorer.context_start(both, PREFIXED.prefix) == 7
    both[1, 0] = 99  # one row without it: the whole prompt, for every row
    assert scorer.context_start(both, PREFIXED.prefix) == 0
    assert load_spec("kvzip").scoring.context_start(both[:1], PREFIXED.prefix) == 7  # the default: context
    prompt_mode = load_spec("kvzip", scoring={"kvzip": {"reconstruct": "prompt"}}).scoring
    assert prompt_mode.context_start(both[:1], PREFIXED.prefix) == 0  # reconstruct: prompt
    model = tiny_model("llama")
    plain = load_spec("kvzip", per_head=8, scoring={"kvzip": {"reconstruct": "prompt"}})
    ctx = load_spec("kvzip", per_head=8)
    ids = prompt(40, seed=3)
    a, _ = reference.kvzip_scores(model, ids, PREFIXED, plain.scoring)
    b, _ = reference.kvzip_scores(model, ids, PREFIXED, ctx.scoring)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(SpecError, match=r"scoring\.kvzip\.reconstruct: 'template' .*allowed: prompt \| context"):
        load_spec("kvzip", scoring={"kvzip": {"reconstruct": "template"}})
