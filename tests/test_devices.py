"""Several devices (docs/INTERNALS.md "Several devices"): a model dispatched by accelerate, with some
layers' weights offloaded to disk or CPU memory ("meta" weights that accelerate's hooks move in when
the layer runs), compiled with snapkv, adakv, zsmerge and lava: the hooks keep running, every layer's
pages live on the device the layer runs on, and the generated tokens and kept entries equal those of
the same saved weights loaded without accelerate. Layers that run on several devices (a pipeline over
two accelerators, simulated here by tests/sim_devices.py with an accelerator's rules) keep what one device
keeps, every layer's pages on its own device. The compiled entry and layers on devices of several types
are refused before anything runs. On a CUDA machine: layers split between the GPU and the CPU, and
(with two GPUs) a pipeline over two."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcompile
from kvcompile import CompileError
from tiny import tiny_model
from tp_run import NEW_TOKENS, entries, inputs, small_budget

accelerate = pytest.importorskip("accelerate", reason="accelerate is a test dependency (pyproject [test])")

SPECS = ["snapkv", "adakv", "zsmerge", "lava"]
LAYERS = 4

# Only stops a simulation that hangs: each runs every spec in a process of its own, about 50 s of one core
# (sim_pipeline.py; 80 s sim_decode_sync.py) on a loaded machine, many times that on one loaded 10-fold (once
# 1,237 s, failing a fixed 1,200); no speed is checked here.
HANG_GUARD_S = 3600


def device_map(offloaded: str, main="cpu") -> dict:
    """Layers 1 and 3 offloaded (to "disk" or "cpu"), the rest on `main`."""
    out = {"model.embed_tokens": main, "model.norm": main, "model.rotary_emb": main, "lm_head": main}
    out.update({f"model.layers.{i}": offloaded if i % 2 else main for i in range(LAYERS)})
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("devices")
    tiny_model("llama", layers=LAYERS, heads=4, kv_heads=2).save_pretrained(path / "model")
    return path


def load(saved, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved / "model", **kwargs).eval()
    model.generation_config.pad_token_id = 0
    return model


def dispatched(saved, how: str):
    """The saved model under accelerate: loaded with a device_map that offloads layers 1 and 3 to disk
    (offload_folder) or to CPU memory, or wrapped whole by accelerate's cpu_offload / disk_offload."""
    if how == "device_map:disk":
        return load(saved, device_map=device_map("disk"), offload_folder=str(saved / "offload"))
    model = load(saved)
    if how == "cpu_offload":
        return accelerate.cpu_offload(model, execution_device="cpu")
    if how == "disk_offload":
        return accelerate.disk_offload(model, str(saved / f"disk-{id(model)}"), execution_device="cpu")
    raise ValueError(how)


def run(model, name, ids, mask):
    """generate() with a spec name (at small_budget) or a Policy; what it kept (`described`)."""
    with torch.no_grad(), kvcompile.compiled(model, small_budget(name) if isinstance(name, str) else name):
        plan = model.kvcompile_plan
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True)
    return described(out.past_key_values, plan, out.sequences)


def described(cache, plan, sequences) -> dict:
    """What a run kept, on the CPU (its pages may live on several devices)."""
    return {"tokens": sequences[:, -NEW_TOKENS:].tolist(), "entries": entries(cache), "plan": plan,
            "pages": {s.device for s in cache.stores}, "kept": cache.kept().cpu(),
            "layers": tuple(s.device for s in cache.stores),
            "positions": [cache.kept_positions(layer).cpu() for layer in range(len(cache.stores))],
            "bytes": {k: v for k, v in cache.memory_report().items() if k.startswith("bytes")}}


def assert_same(got: dict, want: dict):
    assert got["tokens"] == want["tokens"]
    assert torch.equal(got["kept"], want["kept"])
    assert got["bytes"] == want["bytes"]
    assert all(torch.equal(a, b) for a, b in zip(got["positions"], want["positions"], strict=True))
    assert got["entries"].keys() == want["entries"].keys()
    for key, (tokens, slots, slot_keys) in want["entries"].items():
        assert got["entries"][key][0] == tokens, key  # kept prompt and generated positions
        assert got["entries"][key][1] == slots, key  # residual slots and their counts
        assert torch.equal(got["entries"][key][2].cpu(), slot_keys.cpu()), key


@pytest.fixture(scope="module")
def reference(saved):
    ids, mask = inputs()
    model = load(saved)
    results = {name: run(model, name, ids, mask) for name in SPECS}
    for name, r in results.items():  # the budgets evict: the comparison is not between two full caches
        assert any(len(t) < 97 for t, _, _ in r["entries"].values()), name
    return results


@pytest.mark.parametrize("how", ["device_map:disk", "cpu_offload", "disk_offload"])
def test_offloaded_layers_keep_what_the_plain_model_keeps(saved, reference, how):
    model = dispatched(saved, how)
    offloaded = model.model.layers[1].self_attn.q_proj.weight
    assert offloaded.device.type == "meta"  # weights that accelerate's hooks move in
    ids, mask = inputs()
    for name in SPECS:
        got = run(model, name, ids, mask)
        assert got["plan"].device == torch.device("cpu"), "the plan's device is where the layers run, not 'meta'"
        assert got["pages"] == {torch.device("cpu")}
        assert_same(got, reference[name])
    # the hooks are still there after uncompile(): the weights stay offloaded, the model still runs
    assert hasattr(model, "_hf_hook") and model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    with torch.no_grad():
        assert torch.isfinite(model(ids, attention_mask=mask).logits).all()


def test_the_compiled_entry_refuses_accelerate_hooks(saved):
    model = dispatched(saved, "device_map:disk")
    before = dict(model.__dict__)
    with pytest.raises(CompileError, match="compiled entry cannot trace accelerate's hooks"):
        kvcompile.compile(model, "snapkv", mode="compiled")
    assert model.__dict__.keys() == before.keys() and model.forward is before["forward"]
    # hooks on a layer only (none on the model itself) are refused too
    plain = tiny_model("llama", layers=2)
    accelerate.hooks.add_hook_to_module(plain.model.layers[1], accelerate.hooks.ModelHook())
    with pytest.raises(CompileError, match="compiled entry cannot trace accelerate's hooks"):
        kvcompile.compile(plain, "snapkv", mode="compiled")


class RunsElsewhere(accelerate.hooks.ModelHook):
    """A hook that says its module runs on another device (never run here: compile() refuses first)."""

    def __init__(self, device):
        self.execution_device = device


def test_layers_on_devices_of_several_types_are_refused_before_anything_changes():
    from kvcompile.devices import layer_devices

    model = tiny_model("llama", layers=4)
    accelerate.hooks.add_hook_to_module(model.model.layers[1], RunsElsewhere(torch.device("cuda", 1)))
    accelerate.hooks.add_hook_to_module(model.model.layers[3], RunsElsewhere(1))  # accelerate's int: a GPU index
    assert layer_devices(model) == (torch.device("cpu"), torch.device("cuda:1"), torch.device("cpu"),
                                    torch.device("cuda:1"))
    with pytest.raises(CompileError, match=r"layers run on devices of several types \(cpu: layers 0, 2; cuda:1: layers "
                                           r"1, 3\); the plan chooses one set of kernels"):
        kvcompile.compile(model, "snapkv")
    assert "forward" not in model.__dict__ and model.config._attn_implementation == "sdpa"


def test_the_execution_device_is_read_off_the_hooks(saved):
    from kvcompile.devices import execution_devices, layer_devices

    model = dispatched(saved, "cpu_offload")
    assert model.device.type == "meta"  # where the first weight is stored
    assert layer_devices(model) == (torch.device("cpu"),) * LAYERS
    assert execution_devices(model) == (torch.device("cpu"), None)  # one device: no per-layer list
    with torch.device("meta"):
        empty = tiny_model("llama", layers=2)
    assert execution_devices(empty) == (None, None)  # no weights, no hooks: decided by the first prompt


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: layers split between GPU and CPU")
@pytest.mark.parametrize("offloaded", ["cpu", "disk"])
def test_layers_split_between_the_gpu_and_the_cpu(saved, offloaded):
    """device_map puts layers 1 and 3 in CPU memory (or on disk) and the rest on GPU 0: accelerate runs
    them all on GPU 0 (their weights streamed in), so every layer's pages live on the GPU, and what is
    kept equals the same weights wholly on the GPU."""
    ids, mask = (x.cuda() for x in inputs())
    whole = load(saved).cuda()
    split = load(saved, device_map=device_map(offloaded, main=0), offload_folder=str(saved / f"gpu-{offloaded}"))
    assert split.model.layers[1].self_attn.q_proj.weight.device.type in ("cpu", "meta")
    for name in SPECS:
        want, got = run(whole, name, ids, mask), run(split, name, ids, mask)
        assert got["plan"].device == torch.device("cuda", 0) and got["pages"] == {torch.device("cuda", 0)}
        assert_same(got, want)


def test_layers_that_run_on_meta_are_refused():
    model = tiny_model("llama", layers=2)
    for layer in model.model.layers:
        accelerate.hooks.add_hook_to_module(layer, RunsElsewhere("meta"))
    with pytest.raises(CompileError, match="layers run on the 'meta' device"):
        kvcompile.compile(model, "snapkv")


def test_a_layer_on_another_device_than_its_cache_is_refused_at_its_step():
    """The runtime's own check (kvcompile.engine.op.attend): once the prompt fixed the cache's device,
    a step on another device raises before it touches the pages."""
    import dataclasses

    from tiny import prompt

    model = tiny_model("llama", layers=2)
    ids = prompt(60)
    with torch.no_grad(), kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=40)):
        cache = model(ids).past_key_values
        assert cache.plan.device == torch.device("cpu")
        lengths = cache.kept().clone()
        # as if layer 0 ran elsewhere
        cache = cache.copy_with(dataclasses.replace(cache.plan, device=torch.device("meta")))
        with pytest.raises(RuntimeError, match="layer 0 runs on cpu but its pages live on meta"):
            model(ids[:, :1], past_key_values=cache)
    assert torch.equal(cache.kept(), lengths)


def test_a_plan_names_a_device_of_one_type_for_every_layer():
    from kvcompile.plan import PlanError, build_plan

    policy, config = kvcompile.load_spec("snapkv"), tiny_model("llama", layers=2).config
    plan = build_plan(policy, config, device="cpu", layer_devices=("cpu", "cpu"))
    assert plan.layer_devices is None and plan.layer_device(1) == torch.device("cpu")  # one device: no per-layer list
    for bad in [("cpu",), ("cpu", "cpu", "cpu"), ("meta", "cpu"), ("cpu", "meta")]:
        with pytest.raises(PlanError, match="layer_devices must name a device of cpu's type for each of the 2"):
            build_plan(policy, config, device="cpu", layer_devices=bad)


SIMULATIONS = {"test_pipelines_on_simulated_devices": "sim_pipeline.py",
               "test_decode_steps_on_a_simulated_device_read_nothing_back": "sim_decode_sync.py"}


@pytest.fixture(scope="module")
def simulations(request, tmp_path_factory):
    """The simulations this session selects, started together, each in a process of its own (its simulated
    devices register torch's PrivateUse1 backend for the whole process, after which torch.get_device_module()
    names it, and transformers' continuous batching reads that) with one torch thread: they share the machine's
    cores while this process waits on the first (on two cores about a minute less than one after the
    other). Output goes to files, not pipes, so a process that prints much never blocks on the one not read."""
    import sim_devices  # available() registers nothing

    if sim_devices.available() is not None:
        pytest.skip(sim_devices.available())
    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    here, logs = Path(__file__).resolve().parent, tmp_path_factory.mktemp("simulations")
    procs = {}
    for test, file in SIMULATIONS.items():
        if test in selected:
            out = open(logs / f"{file}.log", "w+")
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                     str(here / file)], stdout=out, stderr=subprocess.STDOUT, text=True,
                                    cwd=here.parent, env=dict(os.environ, OMP_NUM_THREADS="1"))
            procs[test] = (proc, out)
    yield procs
    for proc, out in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()


def check_simulation(procs, test: str) -> None:
    proc, out = procs[test]
    proc.wait(timeout=HANG_GUARD_S)
    out.seek(0)
    text = out.read()
    assert proc.returncode == 0, text[-10000:]
    summary = text.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


def test_pipelines_on_simulated_devices(simulations):
    """tests/sim_pipeline.py, in a process of its own (`simulations`): layers alternating between two
    simulated accelerators keep what one device keeps."""
    check_simulation(simulations, "test_pipelines_on_simulated_devices")


def test_decode_steps_on_a_simulated_device_read_nothing_back(simulations):
    """tests/sim_decode_sync.py, in a process of its own (`simulations`): every spec's decode steps after the
    first read nothing back to the host and keep their shapes, but for the plan's named exceptions."""
    check_simulation(simulations, "test_decode_steps_on_a_simulated_device_read_nothing_back")
