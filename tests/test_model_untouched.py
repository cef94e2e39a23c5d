"""No helper changes the user's model: everything observable about a model (its config and generation config, its
attention implementation, every module's class, forward and hooks, training mode, every parameter's and buffer's
storage, values and requires_grad, its instance attributes, torch's global random state) is the same before and
after each of kvcompile's helpers that take a model and leave it as it was: `kvcompile.compiled` (compile() for a
block), `compress_context` and its answers, the capture / replay / decode utilities (kvcompile.tools.sweep) the
eval and RULER harnesses run on, RULER's plain-cache answers, tune's Evaluator, the reference's captured states,
the continuous-batching engine (`generate_batch`) on a compiled model; on a plain model and on a model the user
compiled with a policy of their own (the helper leaves it compiled with that policy). `compile()` changes the model
by design: only what it documents (its attention, forward, generate and init_continuous_batching, the
kvcompile_policy and kvcompile_plan attributes), `uncompile()` gives every other observable back, and a refused
compile() (bad spec, bad options) changes nothing, on a plain model or a compiled one.
"""
from __future__ import annotations

import pytest
import torch

import kvcompile
from tests.tiny import prompt, tiny_model

NEW = 3
SPEC = dict(per_head=12, ranking={"by_score": {"window": 4}}, scoring={"window_attention": {"window": 4}})


def snapshot(model) -> dict:
    """Everything observable about `model` (and torch's global random state), in comparable values."""
    modules = dict(model.named_modules())
    return {
        "config": model.config.to_dict(),
        "attn": model.config._attn_implementation,
        "sub attn": {name: getattr(model.config, name)._attn_implementation
                     for name in getattr(model.config, "sub_configs", {}) if getattr(model.config, name, None)},
        "generation_config": model.generation_config.to_dict(),
        "instance": {k: v for k, v in model.__dict__.items() if not k.startswith("_modules")
                     and k not in ("_parameters", "_buffers", "config", "generation_config")},
        "classes": {n: type(m) for n, m in modules.items()},
        "forwards": {n: m.__dict__.get("forward") for n, m in modules.items()},
        "hooks": {n: tuple(tuple(getattr(m, h).items()) for h in
                           ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                            "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
                            "_load_state_dict_pre_hooks"))
                  for n, m in modules.items()},
        "training": {n: m.training for n, m in modules.items()},
        "tensors": {n: (t.data_ptr(), t.dtype, t.device, t.shape, t.requires_grad, t.detach().clone())
                    for n, t in [*model.named_parameters(), *model.named_buffers()]},
        "rng": torch.get_rng_state(),
    }


def assert_same(before: dict, after: dict, what: str) -> None:
    for key in before:
        a, b = before[key], after[key]
        if key == "tensors":
            assert a.keys() == b.keys(), what
            for name in a:
                assert a[name][:5] == b[name][:5], (what, name, a[name][:5], b[name][:5])
                assert torch.equal(a[name][5], b[name][5]), (what, name, "values changed")
        elif key == "rng":
            assert torch.equal(a, b), (what, "torch's global random state changed")
        elif key == "instance":
            assert a.keys() == b.keys(), (what, a.keys() ^ b.keys())
            for name in a:
                assert a[name] is b[name] or a[name] == b[name], (what, name, a[name], b[name])
        else:
            assert a == b, (what, key, _diff(a, b))


def _diff(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    return a, b


def user_model(compiled_with: str | None):
    """A tiny model as a user holds it: plain (with SDPA, or "eager": transformers' eager attention), or compiled
    with a policy of their own."""
    model = tiny_model("llama", layers=2)
    if compiled_with == "eager":
        model.set_attn_implementation("eager")
    elif compiled_with is not None:
        kvcompile.compile(model, compiled_with, per_head=20)  # (knorm, snapkv with SPEC's windows)
    return model


# --- the helpers that leave the model as it was ----------------------------------------------------------------

def _compiled_block(model):
    with kvcompile.compiled(model, "snapkv", **SPEC):
        model.generate(prompt(30), attention_mask=torch.ones(1, 30, dtype=torch.long), max_new_tokens=NEW,
                       do_sample=False)


def _compiled_block_that_raises(model):
    with pytest.raises(KeyError, match="inside the block"):
        with kvcompile.compiled(model, "snapkv", **SPEC):
            raise KeyError("inside the block")


def _context(model):
    ctx = kvcompile.compress_context(model, prompt(30, seed=4), "knorm", **SPEC)
    ctx.answer(prompt(4, seed=5), max_new_tokens=NEW)
    ctx.conversation().say(prompt(4, seed=6), max_new_tokens=NEW)


def _sweep(model):
    from kvcompile.tools.sweep import capture, feed, greedy, prefilled, replay, teacher_forced

    ids = prompt(40, seed=7)
    states, logits = capture(model, ids)
    policy = kvcompile.load_spec("snapkv", **SPEC)
    cache = replay(policy, model.config, states, headroom=8)
    greedy(model, cache, logits, NEW)
    cache = replay(policy, model.config, states, headroom=8)
    last = feed(model, cache, prompt(3, seed=8))
    teacher_forced(model, cache, last, prompt(3, seed=9))
    chunked = kvcompile.load_spec("snapkv", **SPEC, schedule={"prefill": {"chunk": 16}})
    prefilled(model, chunked, ids)


class _Tokens:
    """What the eval harness reads of a tokenizer: pad and eos ids, and decode."""

    pad_token_id, eos_token_id = 0, 1

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def _eval_run(model):
    from kvcompile.tools.cli import run_policy

    run_policy(model, _Tokens(), prompt(30, seed=4)[0].tolist(), kvcompile.load_spec("snapkv", **SPEC), NEW)


def _ruler_plain(model):
    from kvcompile.tools.ruler import plain_answers

    plain_answers(model, prompt(30, seed=4)[0].tolist(), [prompt(3, seed=5)[0].tolist()], NEW)


def _tune(model):
    from kvcompile.tools.tune import Budget, Candidate, Evaluator, Sample

    sample = Sample(0, prompt(40, seed=4)[0].tolist(), prompt(3, seed=5)[0].tolist(), prompt(2, seed=6)[0].tolist())
    evaluator = Evaluator(model, [sample], Budget(kv_fraction=0.3), max_new_tokens=NEW)
    candidate = Candidate("knorm", {"name": "knorm", "scoring": "key_norm", "budget": {"per_head": 1}})
    evaluator.proxy(candidate, 0)
    evaluator.confirm(candidate, 0)


def _reference(model):
    from kvcompile.reference import captured_states

    captured_states(model, prompt(20, seed=4))


HELPERS = {"compiled() block": _compiled_block, "compiled() block that raises": _compiled_block_that_raises,
           "compress_context": _context, "sweep": _sweep, "RULER plain answers": _ruler_plain,
           "eval run_policy": _eval_run, "tune Evaluator": _tune,
           "reference captured_states": _reference}


@pytest.mark.parametrize("user", [None, "eager", "knorm"], ids=["plain", "eager", "compiled"])
@pytest.mark.parametrize("helper", list(HELPERS))
def test_a_helper_leaves_the_users_model_as_it_was(helper, user):
    model = user_model(user)
    before = snapshot(model)
    HELPERS[helper](model)
    assert_same(before, snapshot(model), helper)


def test_generate_batch_on_a_compiled_model_leaves_it_as_it_was():
    """transformers' continuous batching on a compiled model (kvcompile's engine, its manager kept by transformers
    until destroyed): once the manager is destroyed, the model is as it was."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = kvcompile.compile(tiny_model("llama", layers=2), "snapkv", **SPEC)
    before = snapshot(model)
    model.generate_batch([prompt(40, seed=s)[0].tolist() for s in (1, 2)],
                         generation_config=GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1,
                                                            pad_token_id=0),
                         continuous_batching_config=ContinuousBatchingConfig(num_blocks=32, page_size=16),
                         warmup=False)
    model.destroy_cached_continuous_batching_manager()
    after = snapshot(model)
    # transformers' engine itself draws from torch's global generator (generate_batch on a plain model does too)
    before.pop("rng"), after.pop("rng")
    assert_same(before, after, "generate_batch")


# --- compile(): what it documents, and nothing on a refusal --------------------------------------------------

COMPILE_CHANGES = {"forward", "generate", "init_continuous_batching", "kvcompile_policy", "kvcompile_plan",
                   "_kvcompile"}


@pytest.mark.parametrize("user", [None, "eager"], ids=["sdpa", "eager"])
def test_compile_changes_only_what_it_documents_and_uncompile_gives_everything_back(user):
    model = user_model(user)
    before = snapshot(model)
    kvcompile.compile(model, "snapkv", **SPEC)
    during = snapshot(model)
    assert during["attn"] == "kvcompile"
    assert set(during["instance"]) - set(before["instance"]) == COMPILE_CHANGES
    for key in ("generation_config", "classes", "hooks", "training", "rng"):
        assert_same({key: before[key]}, {key: during[key]}, f"compile(): {key}")
    assert_same({"tensors": before["tensors"]}, {"tensors": during["tensors"]}, "compile(): weights")
    config = {k: v for k, v in during["config"].items() if k != "_attn_implementation_autoset"}
    assert config == {k: v for k, v in before["config"].items() if k != "_attn_implementation_autoset"}
    kvcompile.uncompile(model)
    assert_same(before, snapshot(model), "compile() then uncompile()")


REFUSED = {
    "unknown spec": (("no_such_spec",), {}),
    "bad override": (("snapkv",), {"per_head": -3}),
    "bad mode": (("snapkv",), {"mode": "fastest"}),
    "bad page size": (("snapkv",), {"page_size": 0}),
    "unknown kernels": (("snapkv",), {"kernels": "no_such_kernels"}),
    "kvzip without a tokenizer": (("kvzip",), {"per_head": 12}),
}


@pytest.mark.parametrize("user", [None, "knorm"], ids=["plain", "compiled"])
@pytest.mark.parametrize("refused", list(REFUSED))
def test_a_refused_compile_changes_nothing(refused, user):
    model = user_model(user)
    before = snapshot(model)
    args, kwargs = REFUSED[refused]
    with pytest.raises((kvcompile.CompileError, kvcompile.SpecError, ValueError, FileNotFoundError)):
        kvcompile.compile(model, *args, **kwargs)
    assert_same(before, snapshot(model), f"compile() refused: {refused}")


# --- the same when the helper fails midway ---------------------------------------------------------------------

def _out_of_vocab(n: int = 20) -> torch.Tensor:
    ids = prompt(n, seed=3)
    ids[0, n // 2] = 10_000  # past the tiny vocabulary: the forward raises on the way (the embedding's lookup)
    return ids


def _capture_fails(model):
    from kvcompile.tools.sweep import capture

    capture(model, _out_of_vocab())


def _greedy_fails(model):
    from kvcompile.tools.sweep import capture, greedy, replay

    states, logits = capture(model, prompt(30, seed=7))
    cache = replay(kvcompile.load_spec("snapkv", **SPEC), model.config, states, headroom=8)
    first = torch.zeros(1, 10_001).index_fill(-1, torch.tensor([10_000]), 1.0)  # its first token past the vocabulary
    greedy(model, cache, first, NEW)


def _reference_fails(model):
    from kvcompile.reference import captured_states

    captured_states(model, _out_of_vocab())


def _tune_fails(model):
    from kvcompile.tools.tune import Budget, Candidate, Evaluator, Sample

    sample = Sample(0, _out_of_vocab(40)[0].tolist(), prompt(3, seed=5)[0].tolist(), prompt(2, seed=6)[0].tolist())
    Evaluator(model, [sample], Budget(kv_fraction=0.3)).proxy(
        Candidate("knorm", {"name": "knorm", "scoring": "key_norm", "budget": {"per_head": 1}}), 0)


def _generate_fails(model):
    model.generate(_out_of_vocab(), attention_mask=torch.ones(1, 20, dtype=torch.long), max_new_tokens=NEW,
                   do_sample=False)


FAILING = {"sweep capture": _capture_fails, "sweep greedy": _greedy_fails, "reference captured_states":
           _reference_fails, "tune Evaluator": _tune_fails, "generate": _generate_fails}


@pytest.mark.parametrize("user", [None, "knorm"], ids=["plain", "compiled"])
@pytest.mark.parametrize("helper", list(FAILING))
def test_a_helper_that_fails_midway_leaves_the_users_model_as_it_was(helper, user):
    model = user_model(user)
    before = snapshot(model)
    with pytest.raises((IndexError, RuntimeError)):
        FAILING[helper](model)
    assert_same(before, snapshot(model), f"{helper} failing")


@pytest.mark.filterwarnings("ignore:.*cache_implementation")
def test_a_compiled_block_on_a_model_with_a_cache_implementation_leaves_it_as_it_was():
    """A checkpoint's generation_config.cache_implementation (compile() sets it aside, uncompile() puts it back): a
    compiled() block on the model its user compiled leaves it as compile() left it, and uncompile() then gives
    the checkpoint's value back."""
    model = tiny_model("llama", layers=2)
    model.generation_config.cache_implementation = "static"
    plain = snapshot(model)
    kvcompile.compile(model, "knorm", per_head=20)
    before = snapshot(model)
    _compiled_block(model)
    assert_same(before, snapshot(model), "compiled() block")
    kvcompile.uncompile(model)
    assert_same(plain, snapshot(model), "uncompile()")


@pytest.mark.parametrize("user", [None, "knorm"], ids=["plain", "compiled"])
def test_the_ruler_harness_leaves_the_users_model_as_it_was(user):
    """`kvcompile eval --suite ruler`'s run (run_ruler: the full cache, replayed specs, kvzip's reconstruction over
    the captured context, a chunked prefill through the compiled model) on the user's model."""
    from kvcompile.tools import ruler
    from tests.test_ruler import TOK, sample, tiny_for

    model = tiny_for(TOK, seed=1)
    if user is not None:
        kvcompile.compile(model, user, per_head=20)
    before = snapshot(model)
    s = {**sample("niah_single_1", length=600), "max_new_tokens": 3}
    chunked = kvcompile.load_spec("expected_attention", name="ea_chunked", schedule={"prefill": {"chunk": 128}})
    ruler.run_ruler(model, TOK, [s], ["snapkv", "kvzip", chunked], modes=("agnostic", "aware"), fractions=[0.5],
                    quiet=True)
    assert_same(before, snapshot(model), "run_ruler")


def test_an_engine_refused_on_a_compiled_model_changes_nothing():
    """init_continuous_batching (generate_batch, the server's engine) refuses a policy the engine cannot run before
    anything changes: the model keeps its attention and its generation config (an unset eos_token_id included)."""
    from kvcompile.integrations.batching import BatchingError

    model = tiny_model("llama", layers=2)
    model.generation_config.eos_token_id = None
    kvcompile.compile(model, "snapkv", **SPEC, schedule={"cascade": False, "decode": {"every": {"n": 4}}})
    before = snapshot(model)
    with pytest.raises(BatchingError, match="prunes every 4"):
        model.init_continuous_batching()
    assert_same(before, snapshot(model), "init_continuous_batching refused")
