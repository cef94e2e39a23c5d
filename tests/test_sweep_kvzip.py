"""Prefill once, compress many, with KVzip's reconstruction scorer: a kvzip policy replayed over a captured prefill
keeps exactly the entries (with the same scores) and gives exactly the logits of the compiled model's own prefill
of the prompt, whatever its allocation, ranking, storage or merge; its reconstruction runs once per sample and
scorer configuration; what still cannot be replayed is refused with the reason."""
from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile import kvzip
from kvcompile.kvzip import RepeatPrompt
from kvcompile.spec import load_spec
from kvcompile.tools.sweep import capture, not_replayable, prefilled, replay, teacher_forced
from tiny import left_pad, prompt, tiny_model

REPEAT = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12), prefix=(13, 14, 15))
CHUNKED = {"kvzip": {"chunk": 32, "sinks": 4, "overlap": 8}}  # 3 reconstruction forwards over 90 tokens

CASES = {
    "kvzip (global)": ("kvzip", {}),
    "kvzip_adakv": ("kvzip_adakv", {}),
    "kvzip_uniform": ("kvzip_uniform", {}),
    "reconstruct context, int4": ("kvzip_adakv", {"scoring": {"kvzip": {"chunk": 24, "overlap": 4, "reconstruct":
                                                                        "context"}}, "storage": "int4"}),
    "entropy layers, cascade": ("kvzip", {"budget": {"layers": "entropy", "heads": "uniform"},
                                          "schedule": "cascade", "ranking": {"by_score": {"sinks": 2, "window": 6}}}),
    "residual merge": ("kvzip_uniform", {"budget": {"split": {"proximity": 0.1, "context": 0.8, "residual": 0.1}},
                                         "merge": {"residual": {"alpha": 0.6}}}),
}


def kept_scores(cache, layer):
    """(B, H, N) the scores the cache stored for its kept prompt entries, 0 elsewhere."""
    _, _, scores, pos, _, stored = cache.stores[layer].gather()
    b, h = pos.shape[:2]
    out = torch.zeros(b, h, cache.prompt_width)
    bi, hi, ei = (stored & (pos >= 0)).nonzero(as_tuple=True)
    out[bi, hi, pos[bi, hi, ei]] = scores[bi, hi, ei]
    return out


def assert_same_as_prefilled(model, policy, ids, states, last):
    cache = replay(policy, model.config, states, headroom=8, model=model, repeat_prompt=REPEAT)
    own, own_last = prefilled(model, policy, ids, headroom=8, repeat_prompt=REPEAT)
    assert torch.equal(last, own_last)
    assert torch.equal(cache.kept(), own.kept())
    for layer in range(cache.num_layers):
        assert torch.equal(cache.kept_positions(layer), own.kept_positions(layer)), f"layer {layer}"
        assert torch.equal(kept_scores(cache, layer), kept_scores(own, layer)), f"layer {layer}"
    assert int(cache.kept().sum()) < ids.shape[1] * int(cache.kept()[0].numel())  # something was evicted
    continuation = prompt(6, batch=ids.shape[0], seed=9)
    replayed = teacher_forced(model, cache, last, continuation, repeat_prompt=REPEAT)
    direct = teacher_forced(model, own, own_last, continuation, repeat_prompt=REPEAT)
    assert torch.equal(replayed, direct)


@pytest.fixture(scope="module")
def captured():
    model = tiny_model("llama")
    ids = torch.cat([torch.tensor([REPEAT.prefix]), prompt(87, seed=3)], dim=1)  # a prompt in the "template"
    states, last = capture(model, ids)
    return model, ids, states, last


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_kvzip_is_the_compiled_prefill(captured, case):
    model, ids, states, last = captured
    spec, overrides = CASES[case]
    policy = load_spec(load_spec(spec, scoring=CHUNKED), per_head=20, **overrides)
    assert not_replayable(policy) is None
    assert_same_as_prefilled(model, policy, ids, states, last)


def test_replayed_kvzip_of_an_unpadded_batch_is_the_compiled_prefill():
    model = tiny_model("qwen2", kv_heads=1)
    ids = prompt(60, batch=2, seed=8)
    states, last = capture(model, ids)
    for spec in ("kvzip", "kvzip_adakv"):
        assert_same_as_prefilled(model, load_spec(load_spec(spec, scoring=CHUNKED), per_head=14), ids, states, last)


def test_replayed_kvzip_on_a_hybrid_model_reads_the_captured_windows():
    from test_hybrid import tiny_gemma3

    model = tiny_gemma3()
    ids = prompt(70, seed=5)
    states, last = capture(model, ids)
    for spec in ("kvzip", "kvzip_adakv"):
        assert_same_as_prefilled(model, load_spec(load_spec(spec, scoring=CHUNKED), per_head=16), ids, states, last)


def test_the_reconstruction_runs_once_per_scorer_configuration(captured, monkeypatch):
    """Allocation, ranking, storage and merge do not change KVzip's scores: one reconstruction per scorer
    configuration (its chunk, sinks, overlap, what it reconstructs) for a captured prompt, each of them the
    spans of the prompt; the scores are kept with the states."""
    model, ids, _, _ = captured
    states, _ = capture(model, ids)
    spans = []
    real = kvzip._reconstruct
    monkeypatch.setattr(kvzip, "_reconstruct", lambda *a, **k: (spans.append(list(a[4])), real(*a, **k))[1])
    for spec, overrides in [("kvzip", {}), ("kvzip_adakv", {}), ("kvzip_uniform", {"storage": "int4"}),
                            ("kvzip", {"ranking": {"by_score": {"sinks": 0, "window": 8}}}),
                            ("kvzip_uniform", {"budget": {"split": {"proximity": 0.1, "context": 0.8, "residual": 0.1}},
                                               "merge": {"residual": {"alpha": 0.6}}})]:
        replay(load_spec(load_spec(spec, scoring=CHUNKED), per_head=20, **overrides), model.config, states,
               model=model, repeat_prompt=REPEAT)
    # (the captured prompt starts with REPEAT's prefix: reconstruct: context, the default, starts after it)
    assert spans == [[(3, 35), (35, 67), (67, 90)]] and len(states.scores) == 1
    replay(load_spec("kvzip", per_head=20, scoring={"kvzip": {"chunk": 50}}), model.config, states, model=model,
           repeat_prompt=REPEAT)
    assert spans[1:] == [[(3, 53), (53, 90)]] and len(states.scores) == 2


def test_what_still_cannot_be_replayed_is_refused_with_the_reason():
    model = tiny_model("llama")
    chunked = load_spec("kvzip_adakv", per_head=16, schedule={"prefill": {"chunk": 40}})
    assert "schedule.prefill" in not_replayable(chunked)  # each chunk's forward reads what the earlier ones kept
    states, _ = capture(model, prompt(60, seed=6))
    with pytest.raises(ValueError, match="cannot be replayed.*schedule.prefill"):
        replay(chunked, model.config, states, model=model, repeat_prompt=REPEAT)
    policy = load_spec("kvzip", per_head=16)
    with pytest.raises(ValueError, match="without its model.*replay\\(..., model=model\\)"):
        replay(policy, model.config, states)
    with pytest.raises(ValueError, match="token ids"):  # states without the capture's ids
        replay(policy, model.config, list(states), model=model, repeat_prompt=REPEAT)
    with pytest.raises(kvcompile.CompileError, match="schedule.decode"):  # what compile() refuses, replay does
        replay(load_spec("kvzip_adakv", per_head=16, schedule={"decode": {"every": 8}}), model.config, states,
               model=model, repeat_prompt=REPEAT)
    ids, mask = left_pad([prompt(30, seed=1)[0], prompt(20, seed=2)[0]])
    padded, _ = capture(model, ids, mask)
    with pytest.raises(ValueError, match="unpadded"):
        replay(policy, model.config, padded, model=model, repeat_prompt=REPEAT)


def test_the_needle_eval_replays_kvzip_as_its_compiled_generate():
    """`kvcompile eval` (prefill once, compress many) replays kvzip over the captured prompt with the model and its
    tokenizer's repeat prompt: the answer is the compiled model's own generate()."""
    from kvcompile.tools.cli import eval_records
    from kvcompile.tools.data import needle_suite
    from kvcompile.tools.models import generate
    from test_ruler import FILLER, TOK, tiny_for

    model = tiny_for(TOK)
    prompts = needle_suite(TOK, FILLER, [300], [0.5])
    records = eval_records(model, TOK, prompts, ["kvzip", "kvzip_adakv"], [40], 6, full=False, quiet=True)
    assert [r["spec"] for r in records] == ["kvzip", "kvzip_adakv"] and all(r["replay_s"] for r in records)
    for r in records:
        with kvcompile.compiled(model, load_spec(r["spec"], per_head=40), tokenizer=TOK):
            own = generate(model, TOK, prompts[0].input_ids, 6)
        assert r["answer"] == own.text and len(own.new_tokens) == 6
