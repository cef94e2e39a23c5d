"""The library's edges: `compress_context` and its answers leave the model as the user left it and run
from several threads; what compress_context and ctx.generate()/answer() accept and refuse up front."""
from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile import CompileError, KVCompileCache
from tiny import prompt, run_threads, tiny_model

NEW = 5


def gen(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                              **kwargs)


def is_plain(model) -> bool:
    return (not hasattr(model, "kvcompile_plan") and "forward" not in model.__dict__
            and "generate" not in model.__dict__ and model.config._attn_implementation == "sdpa")


# --- the model as the user left it ---------------------------------------------------------------

def test_compress_context_leaves_a_plain_model_plain():
    model = tiny_model("llama", layers=2)
    ids = prompt(20, seed=3)
    want = gen(model, ids).tolist()
    ctx = kvcompile.compress_context(model, prompt(30, seed=4), "knorm", per_head=12)
    assert is_plain(model)
    # the runner shares the model's weights (no copy of them), with modules and config of its own
    assert all(a is b for a, b in zip(ctx.runner.parameters(), model.parameters()))
    assert ctx.runner.config is not model.config and ctx.runner.kvcompile_policy is ctx.policy
    ctx.answer(prompt(4, seed=5), max_new_tokens=3)
    ctx.conversation().say(prompt(4, seed=6), max_new_tokens=3)
    assert is_plain(model)
    out = gen(model, ids, return_dict_in_generate=True)
    assert out.sequences.tolist() == want and not isinstance(out.past_key_values, KVCompileCache)


def test_compress_context_leaves_a_compiled_model_compiled_with_its_own_policy():
    model = tiny_model("llama", layers=2)
    ids = prompt(40, seed=3)
    mine = kvcompile.load_spec("snapkv", per_head=36)
    kvcompile.compile(model, mine)
    plan, forward, generate = model.kvcompile_plan, model.__dict__["forward"], model.__dict__["generate"]
    want = gen(model, ids).tolist()
    ctx = kvcompile.compress_context(model, prompt(30, seed=4), "knorm", per_head=12)
    ctx.answer(prompt(4, seed=5), max_new_tokens=3)
    ctx.generate(prompt(4, seed=5), max_new_tokens=3)
    ctx.conversation().say(prompt(4, seed=6), max_new_tokens=3)
    assert model.kvcompile_policy is mine and model.kvcompile_plan is plan
    assert model.__dict__["forward"] is forward and model.__dict__["generate"] is generate
    assert model.config._attn_implementation == "kvcompile"
    out = gen(model, ids, return_dict_in_generate=True)
    assert out.sequences.tolist() == want
    assert out.past_key_values.policy is mine  # the user's policy runs, in its own cache
    assert int(out.past_key_values.stores[0].lengths.max()) <= 36 + NEW


def test_a_context_on_a_compiled_model_answers_as_on_the_plain_model():
    plain, compiled = tiny_model("llama", layers=2), tiny_model("llama", layers=2)
    kvcompile.compile(compiled, "snapkv", per_head=36)
    context, question = prompt(30, seed=4), prompt(4, seed=5)
    want = kvcompile.compress_context(plain, context, "knorm", per_head=12).answer(question, max_new_tokens=4)
    got = kvcompile.compress_context(compiled, context, "knorm", per_head=12).answer(question, max_new_tokens=4)
    assert got.tolist() == want.tolist()


def test_answers_from_several_threads_equal_the_sequential_ones():
    """Four threads ask one context (each twice, so their calls overlap), while a fifth generates with the
    model the user compiled: every thread gets its sequential tokens, and the model keeps its policy."""
    model = tiny_model("llama", layers=2)
    kvcompile.compile(model, "snapkv", per_head=36)
    ctx = kvcompile.compress_context(model, prompt(40, seed=4), "expected_attention", per_head=12)
    questions = [prompt(n, seed=10 + n) for n in (3, 5, 7, 9)]
    ids = prompt(40, seed=3)
    want = [ctx.answer(q, max_new_tokens=6).tolist() for q in questions] + [gen(model, ids).tolist()]
    jobs = [lambda q=q: [ctx.answer(q, max_new_tokens=6).tolist() for _ in range(2)] for q in questions]
    jobs.append(lambda: [gen(model, ids).tolist() for _ in range(2)])
    got = run_threads(jobs)
    assert got == [[w, w] for w in want]
    assert model.kvcompile_policy.name == "snapkv"


# --- a reconstruction scorer's repeat prompt ------------------------------------------------------

class LetterTokenizer:
    """A tokenizer of a tiny vocabulary, no chat template: each character one id in 3 … 95."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [3 + ord(c) % 93 for c in text]


def test_compress_context_takes_a_repeat_prompt_or_a_tokenizer():
    from kvcompile.kvzip import RepeatPrompt

    model = tiny_model("llama", layers=2)
    policy = kvcompile.load_spec("kvzip", per_head=12, scoring={"kvzip": {"chunk": 16, "sinks": 2, "overlap": 4}})
    context = prompt(40, seed=4)
    with pytest.raises(CompileError, match="compress_context") as err:
        kvcompile.compress_context(model, context, policy)
    assert "tokenizer=" in str(err.value) and "repeat_prompt=" in str(err.value)
    assert is_plain(model)
    repeat = RepeatPrompt.from_tokenizer(LetterTokenizer())
    with kvcompile.compiled(model, policy, repeat_prompt=repeat), torch.no_grad():
        want = model(context, use_cache=True).past_key_values
    for given in ({"repeat_prompt": repeat}, {"tokenizer": LetterTokenizer()}):
        ctx = kvcompile.compress_context(model, context, policy, **given)
        for layer in range(model.config.num_hidden_layers):
            assert torch.equal(ctx.cache.kept_positions(layer), want.kept_positions(layer))
        assert ctx.answer(prompt(4, seed=5), max_new_tokens=3).shape == (1, 3)
    assert is_plain(model)
