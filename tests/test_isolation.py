"""Nothing one model call leaves behind reaches another: two compiled models in one process, two
threads each driving its own cache (one model or two, both entries), caches copied and collected,
and the op's declared effect (docs/INTERNALS.md "The op and its two entries")."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

import kvcompile
from kvcompile.cache import lookup_cache
from tiny import prompt, run_threads, tiny_model

NEW = 5


def gen(model, ids, cache=None):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             past_key_values=cache, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), out.past_key_values


def two_models():
    """Two models of other configurations and policies: a budget that evicts in each (their caches differ
    in shape, layers, heads and pages, so a cache reaching the wrong model's call could not pass)."""
    a = tiny_model("llama", layers=2, seed=1)
    b = tiny_model("qwen2", layers=3, heads=6, kv_heads=3, head_dim=8, seed=2)
    return (a, kvcompile.load_spec("snapkv", per_head=40)), (b, kvcompile.load_spec("lava", per_head=40))


def alone(model, policy, mode, ids):
    with kvcompile.compiled(model, policy, mode=mode):
        tokens, cache = gen(model, ids)
    return tokens, cache.kept().tolist()


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_two_compiled_models_in_one_process(mode):
    """Two models compiled at once: calls interleaved on one thread, then one thread per model; each
    model's tokens and kept entries equal its run alone."""
    (a, pa), (b, pb) = two_models()
    ids_a, ids_b = prompt(70, seed=3), prompt(90, seed=4)
    want_a, want_b = alone(a, pa, mode, ids_a), alone(b, pb, mode, ids_b)
    kvcompile.compile(a, pa, mode=mode)
    kvcompile.compile(b, pb, mode=mode)
    try:
        for _ in range(2):  # interleaved on one thread
            tokens_a, cache_a = gen(a, ids_a)
            tokens_b, cache_b = gen(b, ids_b)
            assert (tokens_a, cache_a.kept().tolist()) == want_a
            assert (tokens_b, cache_b.kept().tolist()) == want_b

        def job(model, ids):
            return lambda: [(tokens, cache.kept().tolist()) for tokens, cache in (gen(model, ids), gen(model, ids))]

        got_a, got_b = run_threads([job(a, ids_a), job(b, ids_b)])
        assert got_a == [want_a, want_a] and got_b == [want_b, want_b]
    finally:
        kvcompile.uncompile(a)
        kvcompile.uncompile(b)


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_two_threads_each_continue_their_own_cache(mode):
    """One model, two threads, each prefilling its own prompt and then continuing its own returned cache
    (a second generate() on it): each equals the same two calls made alone."""
    model = tiny_model("llama", layers=2, seed=5)
    policy = kvcompile.load_spec("h2o", per_head=72)
    prompts = [prompt(90, seed=6), prompt(110, seed=7)]
    follow = [prompt(6, seed=8), prompt(9, seed=9)]

    def conversation(i):
        first, cache = gen(model, prompts[i])
        ids = torch.cat([prompts[i], torch.tensor([first]), follow[i]], dim=1)
        second, cache = gen(model, ids, cache)
        return first, second, cache.kept().tolist()

    with kvcompile.compiled(model, policy, mode=mode):
        want = [conversation(0), conversation(1)]
        got = run_threads([lambda: conversation(0), lambda: conversation(1)])
    assert got == want


def test_copied_and_collected_caches_are_never_reached_by_another_call():
    """A deep copy has its own handle (the op writes the copy, not the original); a collected cache's
    handle names nothing afterwards (a stale handle is refused, never given to another cache)."""
    model = tiny_model("llama", layers=2, seed=10)
    ids = prompt(50, seed=11)
    with kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=40)):
        _, cache = gen(model, ids)
        before = cache.kept().tolist()
        twin = copy.deepcopy(cache)
        assert twin.handle != cache.handle and lookup_cache(twin.handle) is twin
        more = torch.cat([ids, torch.tensor([[5, 6, 7]])], dim=1)
        with torch.no_grad():
            model(more[:, -3:], past_key_values=twin, position_ids=torch.arange(twin.get_seq_length(),
                                                                                twin.get_seq_length() + 3)[None])
        assert cache.kept().tolist() == before and twin.kept().tolist() != before
        handle = twin.handle
        del twin
        gc.collect()
        with pytest.raises(RuntimeError, match=f"no live KVCompileCache with handle {handle}"):
            lookup_cache(handle)
        _, fresh = gen(model, ids)
        assert fresh.handle > handle  # handles are never reused


def test_the_op_mutates_no_argument_and_its_calls_are_ordered_by_data():
    """The op writes the cache its handle names, none of its tensor arguments, and its schema says so;
    it declares no effect (an effect token costs Inductor's graph cache), because its calls are ordered
    by data: in a rewritten graph of two layers, the second call's query descends from the first call's
    output, so no compiler pass can reorder the two or drop the first."""
    from kvcompile.passes.backend import run_passes
    from test_passes import ATTEND, H, Stack, inputs, traced

    op = torch.ops.kvcompile.attend.default
    assert not any(arg.alias_info is not None and arg.alias_info.is_write for arg in op._schema.arguments)
    args = inputs()
    gm = traced(Stack(2, scale=0.3), args)
    run_passes(gm, kv_heads=H, num_layers=2)
    first, second = [n for n in gm.graph.nodes if n.target is ATTEND]

    def ancestors(node):
        seen, todo = set(), list(node.all_input_nodes)
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(n.all_input_nodes)
        return seen

    assert first in ancestors(second.args[0]) and second not in ancestors(first)


@pytest.mark.slow
def test_models_of_one_class_with_other_head_dims_compile_in_one_process():
    """Two Qwen2 models, head dims 16 and 8, compiled one after the other: the second recompiles the
    class's shared forward, and its attention scale must stay a constant of its graph (it once became a
    graph input, which the op's rewrite refused: "computed scale"). Each equals its eager run."""
    ids = prompt(50, seed=12)
    policy = kvcompile.load_spec("snapkv", per_head=40)
    for head_dim in (16, 8):
        model = tiny_model("qwen2", layers=2, heads=6, kv_heads=3, head_dim=head_dim, seed=head_dim)
        assert alone(model, policy, "compiled", ids) == alone(model, policy, "eager", ids), head_dim
