"""Python-API paths beyond generate()'s arguments (docs/GENERATE.md): a deep copy of a compiled model,
concurrent calls, foreign caches, a checkpoint's cache_implementation, autocast, backward, every length
limit, masks with holes, caches of another model. Each is exact or refused before the prompt runs."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache, StaticCache

import kvcompile
from kvcompile.kvzip import RepeatPrompt
from kvcompile import CompileError, KVCompileCache
from kvcompile.spec import available_specs
from tiny import prompt, run_threads, tiny_model

N, NEW = 40, 5


def full(name: str, layers: int = 2):
    """A budget covering every sequence here: the compiled model must give the plain model's tokens."""
    if kvcompile.load_spec(name).budget.threshold is not None:
        return kvcompile.load_spec(name, budget={"threshold": {"attention_norm": {"keep_layers": layers}}},
                                   storage="model_dtype")
    # in the model's dtype: a quantizing storage part rounds entries by design (tests/test_storage*.py)
    return kvcompile.load_spec(name, per_head=400, storage="model_dtype")


def small(name: str):
    return kvcompile.load_spec(name, per_head=36)


def gen(model, ids, **kwargs):
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    kwargs.setdefault("max_new_tokens", NEW)
    with torch.no_grad():
        return model.generate(ids, do_sample=False, **kwargs)


class Calls:
    """Counts the decoder's forward calls: a refusal must come before the prompt runs."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.model.register_forward_pre_hook(self.hook)

    def hook(self, *args):
        self.n += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# --- copy.deepcopy of a compiled model ----------------------------------------------------------

def _flip(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
        model.model.layers[0].self_attn.k_proj.weight.mul_(0.5)


def check_deepcopy(entry: str):
    model = tiny_model("llama", layers=2)
    ids = prompt(N, seed=3)
    policy = small("snapkv")
    other = copy.deepcopy(model)
    _flip(other)
    with kvcompile.compiled(model, policy, mode=entry):
        want_own = gen(model, ids)
    with kvcompile.compiled(other, policy, mode=entry):
        want_other = gen(other, ids)
    assert want_own.tolist() != want_other.tolist()  # the weights matter
    kvcompile.compile(model, policy, mode=entry)
    twin = copy.deepcopy(model)
    _flip(twin)
    assert gen(twin, ids).tolist() == want_other.tolist()  # the copy runs its own weights
    assert gen(model, ids).tolist() == want_own.tolist()  # and the original its own
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, other(ids).logits)  # Inductor fuses: not bit-equal
    kvcompile.uncompile(twin)
    assert "forward" not in twin.__dict__


def test_deepcopy_runs_the_copys_weights():
    check_deepcopy("eager")


# --- concurrent generate() ---------------------------------------------------------------------

def check_threads(model, prompts, **kwargs):
    """Four threads, one prompt each (different lengths), on one model: each gets its sequential tokens
    (each thread generates twice, so calls of all threads overlap)."""
    want = [gen(model, ids, **kwargs).tolist() for ids in prompts]
    got = run_threads([lambda ids=ids: [gen(model, ids, **kwargs).tolist() for _ in range(2)][-1] for ids in prompts])
    assert got == want


def test_concurrent_generate_eager():
    model = tiny_model("llama", layers=2)
    prompts = [prompt(n, seed=n) for n in (30, 41, 52, 63)]
    with kvcompile.compiled(model, small("lava")):
        check_threads(model, prompts)


@pytest.mark.slow
def test_compiled_entry_deepcopy_and_concurrent_generate():
    """The compiled entry: four threads each get their sequential tokens (the cache binding is per
    thread, the compiled calls take turns step by step); a deep copy runs its own weights."""
    model = tiny_model("llama", layers=2)
    prompts = [prompt(n, seed=n) for n in (30, 41, 52, 63)]
    with kvcompile.compiled(model, small("snapkv"), mode="compiled"):
        check_threads(model, prompts)
    check_deepcopy("compiled")


# --- caches that are not this model's KVCompileCache ---------------------------------------------

@pytest.mark.parametrize("entry", ["eager", "compiled"])
def test_foreign_caches_are_refused_before_the_prompt(entry):
    model = tiny_model("llama", layers=2)
    ids = prompt(N, seed=4)
    other = tiny_model("llama", layers=2, kv_heads=1)
    with kvcompile.compiled(other, "snapkv"):
        theirs = other.generate(ids, max_new_tokens=2, return_dict_in_generate=True).past_key_values
    with kvcompile.compiled(model, small("snapkv"), mode=entry), Calls(model) as calls:
        for cache in (StaticCache(config=model.config, max_cache_len=64), DynamicCache(config=model.config)):
            with pytest.raises(CompileError, match=f"past_key_values={type(cache).__name__}.*not kvcompile's"):
                gen(model, ids, past_key_values=cache)
        with pytest.raises(CompileError, match="past_key_values=StaticCache"):
            model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=64))
        for call in (lambda: gen(model, ids, past_key_values=theirs),
                     lambda: gen(model, ids, past_key_values=KVCompileCache.from_plan(theirs.plan)),
                     lambda: model(ids, past_key_values=theirs)):
            with pytest.raises(CompileError, match="made for a model with 2 layers, 1 KV heads.*this model has "
                                                   "2 layers, 2 KV heads"):
                call()
        assert calls.n == 0


# --- a checkpoint's generation_config.cache_implementation ----------------------------------------

@pytest.mark.parametrize("entry", ["eager", "compiled"])
def test_checkpoint_cache_implementation_is_ignored_with_a_warning(entry):
    model = tiny_model("llama", layers=2)
    ids = prompt(N, seed=5)
    with kvcompile.compiled(model, small("snapkv"), mode=entry):
        want = gen(model, ids)
    model.generation_config.cache_implementation = "static"  # as from_pretrained loads generation_config.json
    with pytest.warns(UserWarning, match="cache_implementation='static'; ignored"):
        kvcompile.compile(model, small("snapkv"), mode=entry)
    try:
        assert model.generation_config.cache_implementation is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert gen(model, ids).tolist() == want.tolist()
        model.generation_config.cache_implementation = "static"  # set after compile(): refused, not ignored
        with Calls(model) as calls, pytest.raises(CompileError, match="set after compile"):
            gen(model, ids)
        assert calls.n == 0
        model.generation_config.cache_implementation = None
    finally:
        kvcompile.uncompile(model)
    assert model.generation_config.cache_implementation == "static"  # the checkpoint's, back


# --- torch.autocast ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", available_specs())
def test_autocast_bfloat16_every_spec(name):
    """An fp32 model under torch.autocast(bfloat16): the attention runs in bf16 as the model's SDPA does
    (kvcompile.attend casts q, k, v as autocast casts SDPA's); a budget covering the sequence gives the
    plain model's logits under the same autocast, up to bf16 rounding."""
    model = tiny_model("llama", layers=2)
    ids = prompt(N, seed=6)
    kwargs = dict(return_dict_in_generate=True, output_logits=True)
    policy = full(name)
    # a reconstruction scorer (kvzip) reads a repeat prompt: token ids of the tiny vocabulary
    extra = {"repeat_prompt": RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10,))} \
        if getattr(policy.scoring, "reconstructs", False) else {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = gen(model, ids, **kwargs)
        with kvcompile.compiled(model, policy, **extra):
            got = gen(model, ids, **kwargs)
    assert len(got.logits) == len(plain.logits) == NEW
    for a, b in zip(plain.logits, got.logits):
        torch.testing.assert_close(b.float(), a.float(), atol=0.1, rtol=0.05)
    assert got.past_key_values.stores[0].k_pages.dtype == torch.bfloat16


# --- backward ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["snapkv", "lava", "zsmerge", "tova"])
def test_backward_through_the_prompt_equals_the_plain_model(name):
    """Saliency: gradients of the prompt's logits, in eval mode, with respect to the input embeddings
    and the weights, equal the plain model's (the prompt's attention is plain causal attention)."""
    model = tiny_model("llama", layers=2)
    ids = prompt(N, seed=7)

    def grads():
        model.zero_grad()
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        out = model(inputs_embeds=embeds, attention_mask=torch.ones_like(ids))
        out.logits[0, -1, 5].backward()
        return embeds.grad, model.model.layers[0].self_attn.q_proj.weight.grad.clone(), out

    want_embeds, want_q, _ = grads()
    with kvcompile.compiled(model, small(name)):
        got_embeds, got_q, out = grads()
        assert isinstance(out.past_key_values, KVCompileCache)
        step = model(input_ids=ids[:, :1], past_key_values=out.past_key_values)  # a decode step
        with pytest.raises(RuntimeError, match="defined for a prompt's attention only"):
            step.logits.sum().backward()
    model.zero_grad()
    torch.testing.assert_close(got_embeds, want_embeds)
    torch.testing.assert_close(got_q, want_q)


def test_compiled_entry_refuses_gradients_before_running():
    model = tiny_model("llama", layers=2)
    ids = prompt(N, seed=8)
    with kvcompile.compiled(model, small("snapkv"), mode="compiled"), Calls(model) as calls:
        with pytest.raises(CompileError, match="needs gradients.*mode='eager'"):
            model(ids)
        assert calls.n == 0


# --- length limits, masks --------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["eager", "compiled"])
def test_sliding_window_checked_against_max_length(entry):
    model = tiny_model("mistral", layers=2, sliding_window=32)
    ids = prompt(20, seed=9)
    with kvcompile.compiled(model, small("snapkv"), mode=entry), Calls(model) as calls:
        with pytest.raises(CompileError, match="40 tokens is longer than the model's sliding window \\(32"):
            gen(model, ids, max_new_tokens=None, max_length=40)
        model.generation_config.max_length = 36
        with pytest.raises(CompileError, match="36 tokens is longer"):
            gen(model, ids, max_new_tokens=None)
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens = 13
        with pytest.raises(CompileError, match="33 tokens is longer"):
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert calls.n == 0


@pytest.mark.parametrize("entry", ["eager", "compiled"])
def test_a_mask_with_a_hole_names_the_hole(entry):
    model = tiny_model("llama", layers=2)
    ids = prompt(N, batch=2, seed=10)
    hole = torch.ones_like(ids)
    hole[1, 10:13] = 0
    right = torch.ones_like(ids)
    right[1, -3:] = 0
    with kvcompile.compiled(model, small("snapkv"), mode=entry), Calls(model) as calls:
        with pytest.raises(CompileError, match="a hole \\(a pad between real tokens, row 1\\)"):
            gen(model, ids, attention_mask=hole)
        with pytest.raises(CompileError, match="right-padded"):
            gen(model, ids, attention_mask=right)
        assert calls.n == 0


# --- memory_report on a sequence shorter than the budget -------------------------------------------

def test_memory_report_says_when_whole_pages_exceed_the_full_cache():
    model = tiny_model("llama", layers=2)
    with kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=64)):
        short = gen(model, prompt(6, seed=11), return_dict_in_generate=True).past_key_values.memory_report()
        long = gen(model, prompt(200, seed=12), return_dict_in_generate=True).past_key_values.memory_report()
    for report in (short, long):
        assert report["bytes_unused_slots"] == report["bytes_held"] - report["bytes_entries"] >= 0
    assert short["bytes_held"] > short["bytes_full"] and "whole pages of 16 entries" in short["note"]
    assert long["bytes_held"] < long["bytes_full"] and "note" not in long


def test_the_cache_is_taken_under_either_name_and_handed_on_under_the_installed_ones(monkeypatch):
    """transformers 5.24 renamed generate()/forward()'s `past_key_values` to `cache` (kvcompile.cache_arg): the
    entries take either name; two different caches at once are refused (transformers would drop one silently)."""
    from kvcompile import cache as cache_arg

    a, b = object(), object()
    for installed in ("cache", "past_key_values"):
        monkeypatch.setattr(cache_arg, "NAME", installed)
        assert cache_arg.given(a) == {installed: a}
        kwargs = {"past_key_values": a, "x": 1}
        assert cache_arg.take(kwargs) is a and kwargs == {"x": 1}
    monkeypatch.setattr(cache_arg, "NAME", "cache")
    kwargs = {"cache": a, "past_key_values": a}
    assert cache_arg.take(kwargs) is a and not kwargs
    with pytest.raises(ValueError, match="two caches"):
        cache_arg.take({"cache": a, "past_key_values": b})


def test_the_cache_says_no_layer_is_linear_so_a_continued_prompt_is_cut_to_its_new_tokens():
    """generate() (5.24 on) feeds only the tokens after a continued cache unless every layer is linear attention
    (`all(cache.is_linear)`); the cache keeps no transformers `layers`, so it says so per layer itself. The
    second turn must equal the plain model's (tests/test_generate_compat.py's continuation, on any version)."""
    model = tiny_model("llama", layers=2)
    ids = prompt(N, seed=2)
    with kvcompile.compiled(model, full("snapkv")):
        first = gen(model, ids, return_dict_in_generate=True)
        cache = first.past_key_values
        assert cache.is_linear == cache.is_sliding == cache.is_dummy == [False, False]
        turn = torch.cat([first.sequences, prompt(7, seed=3)], dim=1)
        got = gen(model, turn, past_key_values=cache)
    plain = gen(model, turn)
    assert got.tolist() == plain.tolist()
