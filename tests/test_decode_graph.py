"""A decode step captured as a graph and replayed, on the CPU: what a CUDA graph (mode="reduce-overhead",
kvcompile.graphs) does with it on a GPU, proven without one.

For every shipped spec (and decode-time pruning), on a tiny model: the prompt and the first decode step run
eagerly; then one decode step is traced into an FX graph of aten ops (`make_fx`, real tensors: the step
runs while it is traced) with the cache's tensors (`KVCompileCache.decode_tensors()`) as the graph's inputs,
and the graph is replayed for the next steps on the same tensors, the cache's host bookkeeping done by
`KVCompileCache.replayed` alone (the op's Python does not run in a replay: whatever host state a step
changes, and a replay would skip, makes the comparison fail). A copy of the cache decodes the same tokens
eagerly, with generate()'s growing 2-D mask, and after every step both hold the same entries (positions,
residual slots, keys), the same logits and the same host state (length, room in the pages, counted host
reads). A step the cache says needs the host (`host_step()`) runs eagerly instead, and is one of the plan's
named exceptions (`Plan.host_syncs`), counted on the cache (`KVCompileCache.host_syncs`); a plan that names
none replays every step after the capture.

Tracing also proves the step reads nothing back: make_fx refuses `.item()` / `bool()` on a traced tensor
(data-dependent Python), and the test checks that the step keeps every tensor of the cache in its storage.
The backends are the torch lowerings (kernels="torch"): the C++ kernels are opaque to make_fx, and on a GPU
the plan runs Triton or torch."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

import kvcompile
from kvcompile import KVCompileCache
from tiny import tiny_model
from kvcompile.kvzip import RepeatPrompt
from tp_run import PRUNING, SPECS_DIR, entries, inputs, small_budget, spec_names

PAGE = 4  # entries per page: the replayed steps cross page boundaries into the pages reserved up front
STEPS = 12  # decode steps after the first
REPEAT = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12))  # a reconstruction scorer's (kvzip)
RECONSTRUCTING = sorted(p.stem for p in SPECS_DIR.glob("*.yaml")
                        if getattr(kvcompile.load_spec(p.stem).scoring, "reconstructs", False))
SPECS = spec_names() + RECONSTRUCTING + list(PRUNING)  # every shipped spec, and decode-time pruning
# the specs whose decode may need the host at some step of this generation, and for what (Plan.host_syncs):
# ZSMerge's eviction budget may outgrow its pages; pruning every n tokens re-selects on the host, and its
# spare pages are only what a head grows by between two prunings (plan.spare_pages)
PRUNES = ("page allocation", "decode: every")
NAMED = {"zsmerge": ("page allocation",), "adakv_every": PRUNES, "lava_every": PRUNES, "h2o_every": PRUNES}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2)


def state(cache: KVCompileCache) -> dict:
    """The host state a decode step keeps: length, room in each layer's pages, the counted host reads."""
    return {"length": cache.seq_length, "room": [s.room for s in cache.stores], "syncs": dict(cache.host_syncs),
            "device length": int(cache.decoding.length)}


def assert_same(got: KVCompileCache, want: KVCompileCache, step: int):
    assert state(got) == state(want), step
    a, b = entries(got), entries(want)
    assert a.keys() == b.keys()
    for key, (tokens, slots, keys) in b.items():
        assert a[key][0] == tokens, (step, key)  # kept positions, prompt and generated
        assert a[key][1] == slots, (step, key)  # residual slots and their counts
        assert_close(a[key][2], keys, rtol=1e-5, atol=1e-6)


class Captured:
    """One decode step traced by make_fx into an aten graph whose inputs are the step's tokens, positions and
    cache position, then the cache's tensors."""

    def __init__(self, model, cache: KVCompileCache, tokens, positions, where):
        self.tensors = cache.decode_tensors()
        before = [(t, t.data_ptr(), t.shape) for t in self.tensors]

        def step(tokens, positions, where, *tensors):
            return model(tokens, position_ids=positions, cache_position=where, past_key_values=cache,
                         use_cache=True).logits

        self.graph = make_fx(step, tracing_mode="real")(tokens, positions, where, *self.tensors)
        opaque = {str(n.target) for n in self.graph.graph.nodes if str(n.target).startswith("kvcompile")}
        assert not opaque, f"the graph calls {opaque}: a replay would run its Python, not replay its kernels"
        after = cache.decode_tensors()
        assert len(after) == len(before) and all(
            a is t and a.data_ptr() == p and a.shape == s for a, (t, p, s) in zip(after, before)), \
            "the step replaced or moved a tensor of the cache: a replay would write into the old one"

    def fits(self, cache: KVCompileCache) -> bool:
        """The cache still holds the tensors the graph was traced on."""
        now = cache.decode_tensors()
        return len(now) == len(self.tensors) and all(a is b for a, b in zip(now, self.tensors))

    def __call__(self, cache: KVCompileCache, tokens, positions, where):
        logits = self.graph(tokens, positions, where, *self.tensors)
        cache.replayed(tokens.shape[1])
        return logits


@torch.no_grad()  # as generate(): the eager entry runs the op's body, whose aten ops make_fx records
def decode_replayed(model, name: str, steps: int = STEPS):
    """The run described in the module doc; returns (the plan, the reasons of the steps that ran eagerly,
    how many steps were traced and replayed)."""
    ids, mask = inputs()
    options = {}
    if name in RECONSTRUCTING:  # its prompt runs unpadded (tests/test_kvzip.py), with its repeat prompt
        ids, mask, options = ids[:1], mask[:1], dict(repeat_prompt=REPEAT)
    kvcompile.compile(model, small_budget(name), kernels="torch", page_size=PAGE, **options)
    try:
        plan = model.kvcompile_plan.with_headroom(steps + 1)
        cache = KVCompileCache.from_plan(plan)
        out = model(ids, attention_mask=mask, past_key_values=cache)
        positions = mask.sum(-1, keepdim=True) - 1
        tokens = out.logits[:, -1:].argmax(-1)
        eager, traced, replayed, graph, other = [], 0, 0, None, None
        for step in range(steps + 1):
            positions = positions + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            where = torch.tensor([cache.seq_length])
            reason = cache.host_step()
            if other is None:  # the first decode step, eagerly; then the eager copy starts
                eager.append(reason)
                logits = model(tokens, attention_mask=mask, position_ids=positions, past_key_values=cache).logits
                other, tokens = copy.deepcopy(cache), logits[:, -1:].argmax(-1)
                continue
            want = model(tokens, attention_mask=mask, position_ids=positions, past_key_values=other).logits
            if reason is not None:
                eager.append(reason)
                logits = model(tokens, attention_mask=mask, position_ids=positions, past_key_values=cache).logits
            elif graph is None or not graph.fits(cache):
                graph, logits = Captured(model, cache, tokens, positions, where), None  # it ran while traced
                traced += 1
            else:
                logits = graph(cache, tokens, positions, where)
                replayed += 1
            assert_same(cache, other, step)
            if logits is not None:
                assert_close(logits, want, rtol=1e-4, atol=1e-5)
            tokens = want[:, -1:].argmax(-1)
        return cache, eager, traced, replayed
    finally:
        kvcompile.uncompile(model)


@pytest.mark.parametrize("name", SPECS)
def test_a_decode_step_replays_from_its_captured_graph(model, name):
    cache, eager, traced, replayed = decode_replayed(model, name)
    plan = cache.plan
    assert eager[0].startswith("not a decode step after the first")  # the first sets up the decode state
    exceptions = set(eager[1:])
    assert exceptions <= set(plan.host_syncs), exceptions  # every other eager step is a named exception
    assert set(cache.host_syncs) == exceptions  # and the cache counted its host reads under that name
    # the plans that name host reads while decoding are exactly these, for exactly these reasons
    assert sorted(kind for kind in NAMED.get(name, ()) for key in plan.host_syncs if key.startswith(kind)) == \
        sorted(NAMED.get(name, ())) and len(plan.host_syncs) == len(NAMED.get(name, ())), plan.host_syncs
    if not plan.host_syncs:  # a host-free decode: one capture, then every step replays
        assert not exceptions and (traced, replayed) == (1, STEPS - 1)
    else:  # the steps between the exceptions ran from a graph
        assert traced + replayed == STEPS - len(eager) + 1 and traced + replayed >= 3, (traced, replayed, eager)


def record_fx(run, buffers: list, tensors: list):
    """kvcompile.graphs' recorder on the CPU: the step traced by make_fx into an aten graph (it runs while
    traced), the static buffers and the cache's tensors as its inputs; its replay runs the graph on them."""
    held = {}

    def step(*inputs):
        held["logits"] = run(*inputs).logits
        return held["logits"]

    graph = make_fx(step, tracing_mode="real")(*buffers, *tensors)
    opaque = {str(n.target) for n in graph.graph.nodes if str(n.target).startswith("kvcompile")}
    assert not opaque, opaque
    return held["logits"], lambda: graph(*buffers, *tensors)


@pytest.mark.parametrize("name", ["snapkv", "h2o", "zsmerge", "h2o_every"])
def test_generate_replays_its_decode_steps_through_the_graph_runner(model, name):
    """kvcompile.graphs.DecodeGraphs, what mode="reduce-overhead" puts on a compiled model's forward, driven by
    generate() with the FX recorder above in place of a CUDA graph: the same tokens and kept entries as
    generate() without it; every step after the first, the warm-up and the recording replays, but the plan's
    named exceptions (run as without graphs, and counted by reason)."""
    from kvcompile.graphs import DecodeGraphs

    ids, mask = inputs()
    run = dict(attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
               return_dict_in_generate=True)
    with torch.no_grad(), kvcompile.compiled(model, small_budget(name), kernels="torch", page_size=PAGE):
        want = model.generate(ids, **run)
        graphs = model.forward.graphs = DecodeGraphs(record_fx, "cpu")
        got = model.generate(ids, **run)
    assert torch.equal(got.sequences, want.sequences)
    cache = got.past_key_values
    assert_same(cache, want.past_key_values, STEPS)
    calls = STEPS - 1  # decode calls: the prompt's call gives the first token
    named = sum(n for reason, n in graphs.eager.items() if reason in cache.plan.host_syncs)
    assert set(graphs.eager) - set(cache.plan.host_syncs) == {"warm-up", next(iter(graphs.eager))}
    assert graphs.eager["warm-up"] == graphs.captures and graphs.replays + graphs.captures + named + 1 + \
        graphs.eager["warm-up"] == calls, (graphs.eager, graphs.captures, graphs.replays)
    if not cache.plan.host_syncs:
        assert (graphs.captures, graphs.replays) == (1, calls - 3)
    else:
        assert graphs.replays >= 1


def test_reduce_overhead_is_refused_with_the_reason_where_decode_cannot_be_replayed(model):
    """Off CUDA, compile(mode="reduce-overhead") is refused before the model changes; so are the plans whose
    decode a CUDA graph cannot replay (a pipeline over devices, a tensor-parallel rank, pruning after every
    token); the others are not (tests/test_gpu.py runs the mode on CUDA)."""
    import dataclasses

    from kvcompile import CompileError
    from kvcompile.graphs import refusal
    from kvcompile.plan import build_plan

    with pytest.raises(CompileError, match=r"replays decode steps as CUDA graphs, which needs a CUDA device \(the "
                                           r"model is on cpu\): here mode must be 'eager' or 'compiled'"):
        kvcompile.compile(model, "snapkv", mode="reduce-overhead")
    assert "forward" not in model.__dict__ and not hasattr(model, "kvcompile_plan")
    cuda = dict(device="cuda", dtype=torch.float32)
    for name in SPECS:
        assert refusal(build_plan(small_budget(name), model.config, **cuda)) is None, name
    plan = build_plan(small_budget("snapkv"), model.config, **cuda)
    pipeline = dataclasses.replace(plan, layer_devices=(torch.device("cuda", 0), torch.device("cuda", 1)))
    assert "the layers run on several devices" in refusal(pipeline)
    assert "a tensor-parallel rank" in refusal(dataclasses.replace(plan, shard=object()))
    every = kvcompile.load_spec("h2o", per_head=48, ranking={"by_score": {"window": 3}},
                                schedule={"decode": {"every": {"n": 1}}})
    assert "decode: every 1" in refusal(build_plan(every, model.config, **cuda))
