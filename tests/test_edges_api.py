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


# --- what ctx.generate() / answer() / say() accept, and what they refuse up front --------------------

class Calls:
    """Counts the decoder's forward calls: a refusal must come before anything runs."""

    def __init__(self, model):
        self.n = 0
        model.model.register_forward_pre_hook(self.hook)

    def hook(self, *args):
        self.n += 1


@pytest.fixture(scope="module")
def ctx():
    model = tiny_model("llama", layers=2)
    model.generation_config.eos_token_id = None
    return kvcompile.compress_context(model, prompt(30, seed=4), "knorm", per_head=12)


def test_generate_options_that_cannot_run_on_a_compressed_context_are_refused_up_front(ctx):
    from transformers import GenerationConfig

    calls, question = Calls(ctx.runner), prompt(4, seed=5)
    chat = ctx.conversation()
    for call in (ctx.generate, ctx.answer, chat.say):
        for kwargs, error, match in (
                ({"num_beams": 2}, CompileError, "num_beams=2"),
                ({"num_return_sequences": 2, "do_sample": True}, CompileError, "num_return_sequences=2"),
                ({"generation_config": GenerationConfig(num_beams=3, max_new_tokens=4)}, CompileError,
                 "num_beams=3"),
                ({"prompt_lookup_num_tokens": 2}, CompileError, "prompt-lookup decoding on a cache that already"),
                ({"use_cache": False}, TypeError, "use_cache"),
                ({"past_key_values": ctx.copy_cache()}, TypeError, "past_key_values"),
                ({"inputs_embeds": torch.zeros(1, 4, 64)}, TypeError, "inputs_embeds")):
            with pytest.raises(error, match=match):
                call(question, **kwargs)
    assert calls.n == 0
    assert chat.ids.shape[1] == 30 and chat.cache.seq_length == 30  # the conversation is as it was


def test_beams_and_candidates_on_any_continued_cache_are_refused_before_the_turn_runs():
    model = kvcompile.compile(tiny_model("llama", layers=2), "knorm", per_head=12)
    first = gen(model, prompt(30, seed=4), return_dict_in_generate=True)
    turn = torch.cat([first.sequences, prompt(4, seed=5)], dim=1)
    calls = Calls(model)
    with pytest.raises(CompileError, match="num_beams=2"):
        gen(model, turn, past_key_values=first.past_key_values, num_beams=2)
    with pytest.raises(CompileError, match="prompt-lookup decoding on a cache that already holds a sequence"):
        gen(model, turn, past_key_values=first.past_key_values, prompt_lookup_num_tokens=2)
    assert calls.n == 0
    assert gen(model, prompt(30, seed=4), num_beams=2).shape == (1, 30 + NEW)  # a fresh cache: beams run


def test_the_options_a_compressed_context_takes_run(ctx):
    question = prompt(4, seed=5)
    want = ctx.answer(question, max_new_tokens=4)
    assert ctx.answer(question, max_new_tokens=4, prefill_chunk_size=2).tolist() == want.tolist()
    out = ctx.generate(question, max_new_tokens=4, return_dict_in_generate=True, output_scores=True)
    assert len(out.scores) == 4 and out.sequences[:, -4:].tolist() == want.tolist()
    torch.manual_seed(0)
    sampled = ctx.answer(question, max_new_tokens=4, do_sample=True, top_k=5)
    torch.manual_seed(0)
    assert ctx.answer(question, max_new_tokens=4, do_sample=True, top_k=5).tolist() == sampled.tolist()


def test_an_attention_mask_is_the_new_tokens_or_the_whole_sequences(ctx):
    question = prompt(4, seed=5)
    want = ctx.answer(question, max_new_tokens=4).tolist()
    ones = torch.ones_like(question)
    assert ctx.answer(question, max_new_tokens=4, attention_mask=ones).tolist() == want
    whole = torch.cat([ctx.attention_mask, ones], dim=1)
    assert ctx.answer(question, max_new_tokens=4, attention_mask=whole).tolist() == want
    assert ctx.conversation().say(question, max_new_tokens=4, attention_mask=ones).tolist() == want
    for mask, match in ((torch.ones(1, 3), r"attention_mask has shape \(1, 3\)"),
                        (torch.ones(1, 33), r"attention_mask has shape \(1, 33\)"),
                        (torch.tensor([[0, 1, 1, 1]]), "pad in question_ids"),
                        (torch.cat([torch.zeros(1, 30), ones], 1), "differ from the compressed context's"),
                        (torch.full((1, 4), 2), "1 .* or 0 .* only")):
        with pytest.raises(ValueError, match=match):
            ctx.answer(question, max_new_tokens=4, attention_mask=mask)


def test_token_ids_must_be_integers_of_the_vocabulary(ctx):
    question = prompt(4, seed=5)
    for bad, error, match in ((question.float(), TypeError, "question_ids must be integer token ids, got torch.float32"),
                              ([[5.7, 6.0]], TypeError, "integer token ids"),
                              (torch.tensor([[5, 96]]), ValueError, r"\[0, 96\)"),
                              (torch.tensor([[-1, 5]]), ValueError, r"\[0, 96\)"),
                              (torch.zeros(1, 0, dtype=torch.long), ValueError, "N >= 1")):
        with pytest.raises(error, match=match):
            ctx.answer(bad)
    model = ctx.model
    with pytest.raises(TypeError, match="context_ids must be integer"):
        kvcompile.compress_context(model, prompt(30, seed=4).double(), "knorm", per_head=12)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 29\), and context_ids have \(1, 30\)"):
        kvcompile.compress_context(model, prompt(30, seed=4), "knorm", attention_mask=torch.ones(1, 29),
                                   per_head=12)


# --- the supported transformers range ------------------------------------------------------------

def test_another_transformers_is_refused_with_the_pip_command_of_the_supported_range(monkeypatch):
    from importlib import metadata

    import transformers
    from packaging.requirements import Requirement

    required = [r for r in map(Requirement, metadata.requires("kvcompile")) if r.name == "transformers" and not r.marker]
    assert len(required) == 1
    specifier = required[0].specifier
    model = tiny_model("llama", layers=1)
    for outside in ("4.57.0", "99.0.0"):
        assert outside not in specifier
        monkeypatch.setattr(transformers, "__version__", outside)
        with pytest.raises(CompileError, match=f"has transformers {outside}") as err:
            kvcompile.compile(model, "knorm", per_head=8)
        assert f'pip install "transformers{specifier}"' in str(err.value)
    assert is_plain(model)


# --- a compiled model cast afterwards (docs/GENERATE.md) -------------------------------------------

def test_a_model_cast_after_compile_is_refused_as_generate_md_says_and_compiling_after_runs():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "GENERATE.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| casting or moving a compiled model"))
    quoted = re.search(r'"(the prompt runs in .*?) … (compile the model again after moving or casting it)"', row)
    model = kvcompile.compile(tiny_model("llama", layers=1), "snapkv", per_head=36)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError) as err:
        gen(model, prompt(40, seed=3))
    assert quoted and all(part in str(err.value) for part in quoted.groups())
    kvcompile.compile(model, "snapkv", per_head=36)  # compiled again after the cast, as the row says
    assert gen(model, prompt(40, seed=3)).shape == (1, 40 + NEW)


def test_a_conversation_refuses_a_turn_while_another_runs_and_conversations_run_together(ctx):
    import threading

    chat, other = ctx.conversation(), ctx.conversation()
    want = ctx.conversation().say(prompt(4, seed=5), max_new_tokens=3).tolist()
    inside, release = threading.Event(), threading.Event()

    class Hold:  # a stopping criterion that holds the first turn in generation until released
        def __call__(self, input_ids, scores, **kwargs):
            inside.set()
            release.wait(30)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    from transformers import StoppingCriteriaList

    results = {}
    first = threading.Thread(target=lambda: results.setdefault(
        "first", chat.say(prompt(4, seed=5), max_new_tokens=3, stopping_criteria=StoppingCriteriaList([Hold()]))))
    first.start()
    assert inside.wait(30)
    with pytest.raises(RuntimeError, match="previous turn is still running"):
        chat.say(prompt(4, seed=6), max_new_tokens=3)
    assert other.say(prompt(4, seed=5), max_new_tokens=3).tolist() == want  # another conversation runs
    release.set()
    first.join(30)
    assert results["first"].tolist() == want and chat.ids.shape[1] == 30 + 4 + 3
