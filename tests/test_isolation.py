"""Nothing one model call leaves behind reaches another: two compiled models in one process, two
threads each driving its own cache (one model or two, both entries; one compiled model's graphs run on
two threads at once), caches copied, pickled and collected, and what the op declares it writes
(docs/INTERNALS.md "The op and its two entries")."""
from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile.cache import KVCompileCache
from kvcompile.cache_ref import CacheRef
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


def join(threads, timeout):
    for thread in threads:
        thread.join(timeout)
    return [thread for thread in threads if thread.is_alive()]


@pytest.mark.slow
def test_one_compiled_model_runs_its_graphs_on_two_threads_at_once(monkeypatch):
    """One compiled model, two threads each generating with its own cache: their graphs run at the same
    time (both threads inside the op at once: a barrier there times out if the calls take turns), without
    the compiled entry's one lock (TRACING, held by this thread meanwhile), and give the tokens of the same
    calls made one after the other. New caches and a second model of the same class compile nothing, and
    the graphs keep no cache alive. Only a call that traces takes TRACING: a cold model's first call waits
    for it."""
    from kvcompile.passes.backend import COMPILES, TRACING

    model = tiny_model("llama", layers=2, seed=13)
    policy = kvcompile.load_spec("h2o", per_head=72)
    prompts = [prompt(90, seed=14), prompt(110, seed=15)]
    with kvcompile.compiled(model, policy):
        eager = [gen(model, ids)[0] for ids in prompts]
    torch._dynamo.reset()  # no graph of this model's shape from an earlier test: its first call traces
    with kvcompile.compiled(model, policy, mode="compiled"):
        cold = {}
        thread = threading.Thread(target=lambda: cold.update(out=gen(model, prompts[0])))
        with TRACING:
            thread.start()
            assert join([thread], 3) and not cold  # tracing waits for TRACING
        assert not join([thread], 600) and cold["out"][0] == eager[0]
        first_cache = weakref.ref(cold.pop("out")[1])
        gc.collect()
        assert first_cache() is None  # the graphs (and dynamo's example inputs) hold its reference weakly
        compiled, graphs = len(COMPILES), counters["stats"]["unique_graphs"]
        assert [c["kind"] for c in COMPILES[-2:]] == ["prefill", "decode"]
        assert [gen(model, ids)[0] for ids in prompts] == eager  # new caches, one after the other

        barrier, met = threading.Barrier(2, timeout=60), set()
        plain = CacheRef.cache

        def meeting(ref):  # the op reads its cache: the first time per cache, wait for the other thread
            cache = plain.fget(ref)
            if id(cache) not in met:
                met.add(id(cache))
                barrier.wait()
            return cache

        monkeypatch.setattr(CacheRef, "cache", property(meeting))
        got = [None, None]

        def job(i):
            got[i] = gen(model, prompts[i])[0]

        threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
        with TRACING:  # held all along: a call with a compiled graph that fits never takes it
            for thread in threads:
                thread.start()
            stuck = join(threads, 300)
        join(threads, 600)
        monkeypatch.undo()
        assert not stuck and not barrier.broken and got == eager
        assert (len(COMPILES), counters["stats"]["unique_graphs"]) == (compiled, graphs)

    other = tiny_model("llama", layers=2, seed=16)  # a second model of the same class and shape
    with kvcompile.compiled(other, policy):
        want = gen(other, prompts[1])[0]
    with kvcompile.compiled(other, policy, mode="compiled"):
        assert gen(other, prompts[1])[0] == want
    assert (len(COMPILES), counters["stats"]["unique_graphs"]) == (compiled, graphs)


def test_copied_pickled_and_collected_caches_are_never_reached_by_another_call():
    """A deep copy (and an unpickled cache) has its own `ref` and `token`: the op writes the copy, not the
    original. A cache's reference holds it weakly: once collected, a call through its reference is
    refused, never given to another cache."""
    model = tiny_model("llama", layers=2, seed=10)
    ids = prompt(50, seed=11)
    with kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=40)):
        _, cache = gen(model, ids)
        before, token = cache.kept().tolist(), int(cache.token)
        twin = copy.deepcopy(cache)
        assert twin.ref is not cache.ref and twin.ref.cache is twin and cache.ref.cache is cache
        assert twin.token is not cache.token
        more = torch.cat([ids, torch.tensor([[5, 6, 7]])], dim=1)
        with torch.no_grad():
            model(more[:, -3:], past_key_values=twin, position_ids=torch.arange(twin.get_seq_length(),
                                                                                twin.get_seq_length() + 3)[None])
        assert cache.kept().tolist() == before and twin.kept().tolist() != before
        assert int(cache.token) == token and int(twin.token) == 2  # two layers, one call each
        thawed = pickle.loads(pickle.dumps(cache))
        assert thawed.ref.cache is thawed and thawed.kept().tolist() == before
        assert pickle.loads(pickle.dumps(cache.ref))._cache is None  # a pickled reference names nothing
        ref, alive = twin.ref, weakref.ref(twin)
        del twin
        gc.collect()
        assert alive() is None
        with pytest.raises(RuntimeError, match="names no live KVCompileCache"):
            torch.ops.kvcompile.attend(*(torch.randn(1, 2, 1, 16) for _ in range(3)), None, 0, ref,
                                       torch.zeros(1, dtype=torch.long), 0.25)


def test_the_op_declares_that_it_writes_its_cache():
    """The op's schema takes the cache itself (an opaque reference) and declares one write, the cache's
    token: q, k, v and the mask are read only. So a compiler keeps every call, in order, even one whose
    output nothing reads and two that share no data: under torch.compile (AOTAutograd's
    functionalization, then Inductor) the second call takes the first's token and the graph writes the
    token back; both calls run, in order."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._library.opaque_object import get_opaque_type_name

    schema = torch.ops.kvcompile.attend.default._schema
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "mask", "layer", "cache", "token", "scale"]
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == ["token"]
    assert not schema.returns[0].alias_info  # a new tensor, no view of an input
    assert get_opaque_type_name(CacheRef) == "kvcompile.cache_ref.CacheRef"

    dims = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)
    cache = KVCompileCache(kvcompile.load_spec("snapkv", per_head=64), dims)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g)
    k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(2))

    def two_layers(q, k, v, ref, token):
        torch.ops.kvcompile.attend(q, k, v, None, 0, ref, token, 0.3)  # output unused
        return torch.ops.kvcompile.attend(q * 2, k * 2, v * 2, None, 1, ref, token, 0.3)  # no data from layer 0

    seen = {}

    def capture(gm, example_inputs, **kwargs):  # the functionalized forward graph, before Inductor
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.auto_functionalized_v2]
        (write_back,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
        first, second = (call.kwargs["_all_bases"][0] for call in calls)
        seen.update(layers=[call.kwargs["layer"] for call in calls], first=first.op,
                    second=second.op == "call_function" and second.args[0] is calls[0],
                    write_back=write_back.args[0] is first and write_back.args[1].args[0] is calls[1])
        return compile_fx_inner(gm, example_inputs, **kwargs)

    fn = torch.compile(two_layers, backend=aot_autograd(fw_compiler=capture, keep_inference_input_mutations=True),
                       fullgraph=True)  # as Inductor: the write-back of an input stays in the graph
    with torch.no_grad():
        fn(q, k, v, cache.ref, cache.token)
    assert cache.seq_length == 6 and all(store is not None for store in cache.stores) and int(cache.token) == 2
    # layer 0 writes the cache's token (a graph input), layer 1 writes what layer 0 wrote, and the graph
    # writes layer 1's token back into the input
    assert seen == {"layers": [0, 1], "first": "placeholder", "second": True, "write_back": True}


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
