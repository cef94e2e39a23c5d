"""A decode step with no host synchronisation and static shapes, on a simulated accelerator
(tests/sim_devices.py: its HostReads records every device-to-host read: item()/int()/bool(), tolist(),
nonzero, masked_select, boolean-mask indexing, copies to the CPU, and the shapes of every op).

For every shipped spec (and decode-time pruning), generate() on sim:0: the decode steps after the
first must read nothing back to the host inside kvcompile's attend op, and every op there must see the
same tensor shapes at every step and leave every page tensor, length and count in its storage (what a
captured CUDA graph replays into), unless the plan names the step's host reads as an exception
(`Plan.host_syncs`, shown by plan.describe()).

Not collected by the suite's own run (the name does not match test_*.py): tests/test_devices.py runs
this file in a process of its own, since the simulated devices register a torch backend for the process."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import kvcompile
from kvcompile.engine import op
import sim_devices
from test_devices import LAYERS, load, saved  # noqa: F401  (saved: the fixture)
from tp_run import PRUNING, inputs, small_budget, spec_names

pytestmark = pytest.mark.skipif(sim_devices.available() is not None, reason=str(sim_devices.available()))
if sim_devices.available() is None:
    sim_devices.register()  # for this process (tests/test_devices.py runs this file in one of its own)

EVERY_SPEC = spec_names() + list(PRUNING)
STEPS = 24  # new tokens: heads cross page boundaries (pages of 16 entries) into their reserved pages


class NextStep(LogitsProcessor):
    """Called once after each forward of generate(): the recorder's next step starts."""

    def __init__(self, recorder):
        self.recorder = recorder

    def __call__(self, input_ids, scores):
        self.recorder.step()
        return scores


def storage(t) -> int:
    """Where a tensor's data lives (a SimTensor's: its CPU tensor's)."""
    return getattr(t, "elem", t).data_ptr()


def decode_reads(model, name, monkeypatch, steps=STEPS):
    """(reads, shapes, plan, places): per forward (0: the prompt, 1: the first decode step, ...), the host
    reads and the op shapes recorded inside kvcompile's attend op, and where every layer's page tensors
    (`LayerStore.tensors()`) live after it."""
    ids, mask = (x.to("sim:0") for x in inputs())
    places = {}
    with sim_devices.recording() as rec:
        inner = op._attend

        def scoped(cache, *args, **kwargs):
            with rec.scope():
                out = inner(cache, *args, **kwargs)
            places[len(rec.reads) - 1] = [tuple(storage(t) for t in store.tensors()) for store in cache.stores
                                          if store is not None]
            return out
        monkeypatch.setattr(op, "_attend", scoped)
        with torch.no_grad(), kvcompile.compiled(model, small_budget(name)):
            plan = model.kvcompile_plan
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                           logits_processor=LogitsProcessorList([NextStep(rec)]))
    return rec.reads[:-1], rec.shapes[:-1], plan, places


def count(reads) -> list[int]:
    return [sum(read[2] for read in step) for step in reads]


@pytest.fixture(scope="module")
def model(saved):
    return load(saved).to("sim:0")


def test_the_detector_sees_every_kind_of_host_read():
    a = torch.arange(6.0).to("sim:0")
    with sim_devices.recording() as rec:
        with rec.scope():
            float(a[0]), a.tolist(), (a > 2).nonzero(), a[a > 2], a.masked_select(a > 2), a.cpu(), a.to("cpu")
            a + 1, a.sum(), torch.where(a > 2, a, 0.0)  # nothing read back
    assert [read[0] for read in rec.reads[0] if read[2]] == [
        "item", "tolist", "nonzero", "boolean mask index", "masked_select", "to cpu", "to cpu"]


@pytest.mark.parametrize("name", EVERY_SPEC)
def test_decode_steps_read_nothing_back_and_keep_their_shapes(model, name, monkeypatch):
    """After the first decode step (which sets up the decode state), a step inside kvcompile's op reads
    nothing back to the host and runs every op on the shapes of the step before, but for the plan's named
    exceptions (Plan.host_syncs: the reads in the functions it names; a step with such a read may change
    shapes)."""
    reads, shapes, plan, places = decode_reads(model, name, monkeypatch)
    named = {fn for fns in plan.host_syncs.values() for fn in fns}
    unnamed = [(i, kind, at) for i in range(2, len(reads)) for kind, at, inside, stack in reads[i]
               if inside and not stack & named]
    assert not unnamed, f"{name}: host reads per decode step {count(reads)[1:]}; unnamed: {unnamed[:8]}"
    synced = {i for i in range(2, len(reads)) if count(reads[i:i + 1])[0]}
    changed = [i for i in range(3, len(reads)) if shapes[i] != shapes[i - 1] and not {i, i - 1} & synced]
    assert not changed, f"{name}: op shapes change at decode steps {changed} (no host read there)"
    # what a captured CUDA graph replays into: every page tensor, length and count keeps its storage
    moved = [i for i in range(3, len(reads)) if places[i] != places[i - 1] and not {i, i - 1} & synced]
    assert not moved, f"{name}: page tensors move to new storage at decode steps {moved} (no host read there)"
    if not plan.host_syncs:
        assert not synced


def test_a_spec_with_a_named_exception_shows_it_and_the_rest_of_its_steps_read_nothing(model, monkeypatch):
    """zsmerge: its online-eviction budget may outgrow the pages a head holds after the prompt (Plan.host_syncs,
    in plan.describe()); steps that take no page read nothing back."""
    reads, _, plan, _ = decode_reads(model, "zsmerge", monkeypatch)
    assert "host_syncs: {'page allocation" in plan.describe()
    per_step = count(reads)[2:]
    assert sum(per_step) <= 2 * LAYERS * 2, per_step  # a page per layer at most, twice here
