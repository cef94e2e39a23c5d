"""Layers that run on several devices: a pipeline over two accelerators (docs/INTERNALS.md "Several devices",
kvcompile/devices.py). On this CPU the two devices are simulated (tests/sim_devices.py: sim:0 and sim:1
refuse an op whose tensors live on both, as CUDA does); on a machine with two GPUs the same tests run on
cuda:0 and cuda:1. The model alternates its layers between the two devices; what it keeps and generates
equals the same weights on the first device alone, and each layer's pages live on its own device.

Not collected by the suite's own run (the name does not match test_*.py): tests/test_devices.py runs this
file in a process of its own, since the simulated devices register a torch backend for the whole process."""
from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile import CompileError
import sim_devices
from test_chunked import POLICIES, chunked_policy
from test_devices import LAYERS, assert_same, load, run, saved  # noqa: F401  (saved: the fixture)
from tp_run import NEW_TOKENS, PRUNING, inputs, small_budget, spec_names

PIPELINES = [pytest.param(("sim:0", "sim:1"), id="sim"),
             pytest.param(("cuda:0", "cuda:1"), id="cuda", marks=pytest.mark.skipif(
                 torch.cuda.device_count() < 2, reason="needs two CUDA devices: a pipeline over two GPUs"))]
EVERY_SPEC = spec_names() + list(PRUNING)

pytestmark = pytest.mark.skipif(sim_devices.available() is not None, reason=str(sim_devices.available()))
if sim_devices.available() is None:
    sim_devices.register()  # for this process (tests/test_devices.py runs this file in one of its own)


def pipeline_map(devices) -> dict:
    """Layers alternating between the devices (every layer boundary changes device: the state every layer
    reads moves at each), the embeddings on the first device and the head on the last."""
    out = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
           "lm_head": devices[-1]}
    out.update({f"model.layers.{i}": devices[i % len(devices)] for i in range(LAYERS)})
    return out


@pytest.fixture(scope="module")
def pipelines(saved):
    """The saved model dispatched over each pair of devices (loaded once per pair)."""
    models = {}

    def get(devices):
        if devices not in models:
            models[devices] = load(saved, device_map=pipeline_map(devices))
        return models[devices]
    return get


def test_simulated_devices_refuse_what_an_accelerator_refuses():
    a = torch.arange(6.0).to("sim:0")
    b = torch.ones(6, device="sim:1")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + b
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + torch.ones(6)  # a CPU tensor next to a device's
    assert (a + b.to("sim:0")).device == torch.device("sim", 0)
    assert (a * torch.tensor(2.0)).device == torch.device("sim", 0)  # a 0-dim CPU tensor is a scalar
    a[:2].add_(10)  # views alias
    assert a.tolist() == [10.0, 11.0, 2.0, 3.0, 4.0, 5.0] and a.cpu().device == torch.device("cpu")


@pytest.mark.parametrize("devices", PIPELINES)
@pytest.mark.parametrize("name", EVERY_SPEC)
def test_layers_on_two_devices_keep_what_one_device_keeps(saved, pipelines, devices, name):
    """Every shipped spec (and decode-time pruning): tokens, kept entries, residual slots, memory
    report and kept positions equal those of the same weights on the first device alone (the same
    kernels); each layer's pages on its layer's device."""
    model = pipelines(devices)
    want_devices = tuple(torch.device(devices[i % 2]) for i in range(LAYERS))
    ids, mask = (x.to(devices[0]) for x in inputs())
    want = run(load(saved).to(devices[0]), name, ids, mask)  # the same kernels, on one device
    got = run(model, name, ids, mask)
    assert got["plan"].layer_devices == want_devices and got["plan"].device == want_devices[0]
    assert got["layers"] == want_devices
    assert_same(got, want)


@pytest.mark.parametrize("devices", PIPELINES)
@pytest.mark.parametrize("key", list(POLICIES))
def test_a_prompt_compressed_in_chunks_on_two_devices(saved, pipelines, devices, key):
    """schedule.prefill: chunk, one policy per part family (tests/test_chunked.py's): a chunk's budget
    counts what the layers above hold from the previous chunk, on the other device; lava's cascade
    re-selects lower layers on theirs."""
    policy = chunked_policy(key, per_head=40, chunk=64)
    ids, mask = (x.to(devices[0]) for x in inputs())
    want = run(load(saved).to(devices[0]), policy, ids, mask)
    got = run(pipelines(devices), policy, ids, mask)
    assert got["layers"] == tuple(torch.device(devices[i % 2]) for i in range(LAYERS))
    assert_same(got, want)


@pytest.mark.parametrize("devices", PIPELINES)
def test_beam_search_on_two_devices(saved, pipelines, devices):
    """reorder_cache copies rows of pages on each layer's device."""
    ids, mask = (x.to(devices[0]) for x in inputs())

    def beams(model, ids, mask):
        with torch.no_grad(), kvcompile.compiled(model, small_budget("snapkv")):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=2)
        return out[:, -NEW_TOKENS:].tolist()
    assert beams(pipelines(devices), ids, mask) == beams(load(saved).to(devices[0]), ids, mask)


def test_continuous_batching_of_a_pipeline_is_refused(saved, pipelines):
    model = kvcompile.compile(pipelines(("sim:0", "sim:1")), "snapkv")
    try:
        with pytest.raises(CompileError, match="layers run on several devices is not supported yet"):
            model.init_continuous_batching()
    finally:
        kvcompile.uncompile(model)


@pytest.mark.parametrize("devices", PIPELINES)
@pytest.mark.parametrize("name", ["snapkv", "lava"])
def test_generate_paths_on_two_devices(saved, pipelines, devices, name):
    """generate() again from the returned cache with more tokens (a decode call of several tokens), prompt
    lookup (crop), a prompt given in chunks (prefill_chunk_size) and sampled return sequences (rows
    repeated): the tokens of the same weights on the first device alone."""
    one = load(saved).to(devices[0])
    ids = inputs()[0][:1, -60:].to(devices[0])
    extra = inputs()[0][1:, -7:].to(devices[0])

    def paths(model):
        out = {}
        with torch.no_grad(), kvcompile.compiled(model, small_budget(name)):
            def gen(x, **kwargs):
                kwargs.setdefault("do_sample", False)
                return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, **kwargs)
            first = gen(ids, return_dict_in_generate=True)
            turn = torch.cat([first.sequences, extra], dim=1)
            out["continued"] = gen(turn, past_key_values=first.past_key_values).tolist()
            if name == "snapkv":  # crop() is exact for policies that evict nothing while decoding
                out["lookup"] = gen(ids, prompt_lookup_num_tokens=3).tolist()
            out["chunks"] = gen(ids, prefill_chunk_size=16).tolist()
            torch.manual_seed(5)
            out["sampled"] = gen(ids, do_sample=True, top_k=20, num_return_sequences=2).tolist()
        return out
    assert paths(pipelines(devices)) == paths(one)


def test_a_cache_built_for_one_device_refuses_a_layer_on_another(saved, pipelines):
    """A KVCompileCache built from a policy and a config alone plans one device (where layer 0's first prompt
    runs): the layer on the other device is refused at its step, with what to do, before it touches pages."""
    from kvcompile import KVCompileCache

    model = pipelines(("sim:0", "sim:1"))
    ids, mask = (x.to("sim:0") for x in inputs())
    with torch.no_grad(), kvcompile.compiled(model, small_budget("snapkv")):
        cache = KVCompileCache(small_budget("snapkv"), model.config)
        with pytest.raises(RuntimeError, match=r"layer 1 runs on sim:1 but its pages live on sim:0: .*"
                                               r"KVCompileCache.from_plan\(model.kvcompile_plan\)"):
            model(ids, attention_mask=mask, past_key_values=cache)
        assert cache.stores[1] is None
        cache = KVCompileCache.from_plan(model.kvcompile_plan)
        model(ids, attention_mask=mask, past_key_values=cache)
        assert [s.k_pages.device.index for s in cache.stores] == [0, 1, 0, 1]
