"""A decode step with no host synchronisation and static shapes (issue 23), on a simulated accelerator
(tests/sim_devices.py: its HostReads records every device-to-host read: item()/int()/bool(), tolist(),
nonzero, masked_select, boolean-mask indexing, copies to the CPU, and the shapes of every op).

For every shipped spec (and decode-time pruning), generate() on sim:0: the decode steps after the
first must read nothing back to the host inside kvcompile's attend op, and every op there must see the
same tensor shapes at every step, unless the plan names the step's host reads as an exception
(`Plan.host_syncs`, shown by plan.describe()).

Not collected by the suite's own run (the name does not match test_*.py): tests/test_devices.py runs
this file in a process of its own, since the simulated devices register a torch backend for the process."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import kvcompile
from kvcompile import runtime
import sim_devices
from test_devices import LAYERS, load, saved  # noqa: F401  (saved: the fixture)
from tp_run import PRUNING, inputs, small_budget, spec_names

pytestmark = pytest.mark.skipif(sim_devices.available() is not None, reason=str(sim_devices.available()))
if sim_devices.available() is None:
    sim_devices.register()  # for this process (tests/test_devices.py runs this file in one of its own)

EVERY_SPEC = spec_names() + list(PRUNING)
STEPS = 40  # new tokens: decode steps cross several page boundaries (pages of 16 entries)


class NextStep(LogitsProcessor):
    """Called once after each forward of generate(): the recorder's next step starts."""

    def __init__(self, recorder):
        self.recorder = recorder

    def __call__(self, input_ids, scores):
        self.recorder.step()
        return scores


def decode_reads(model, name, monkeypatch, steps=STEPS):
    """(reads, shapes, plan): per forward (0: the prompt, 1: the first decode step, ...), the host reads
    and the op shapes recorded inside kvcompile's attend op."""
    ids, mask = (x.to("sim:0") for x in inputs())
    with sim_devices.recording() as rec:
        inner = runtime._attend

        def scoped(*args, **kwargs):
            with rec.scope():
                return inner(*args, **kwargs)
        monkeypatch.setattr(runtime, "_attend", scoped)
        with torch.no_grad(), kvcompile.compiled(model, small_budget(name)):
            plan = model.kvcompile_plan
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                           logits_processor=LogitsProcessorList([NextStep(rec)]))
    return rec.reads[:-1], rec.shapes[:-1], plan


def count(reads) -> list[int]:
    return [sum(inside for _, _, inside in step) for step in reads]


@pytest.fixture(scope="module")
def model(saved):
    return load(saved).to("sim:0")


def test_the_detector_sees_every_kind_of_host_read():
    a = torch.arange(6.0).to("sim:0")
    with sim_devices.recording() as rec:
        with rec.scope():
            float(a[0]), a.tolist(), (a > 2).nonzero(), a[a > 2], a.masked_select(a > 2), a.cpu(), a.to("cpu")
            a + 1, a.sum(), torch.where(a > 2, a, 0.0)  # nothing read back
    assert [kind for kind, _, inside in rec.reads[0] if inside] == [
        "item", "tolist", "nonzero", "boolean mask index", "masked_select", "to cpu", "to cpu"]


@pytest.mark.parametrize("name", EVERY_SPEC)
def test_decode_steps_read_nothing_back_and_keep_their_shapes(model, name, monkeypatch):
    reads, shapes, plan = decode_reads(model, name, monkeypatch)
    steady = range(2, len(reads))
    named = dict(getattr(plan, "host_syncs", ()) or ())
    found = {at for i in steady for kind, at, inside in reads[i] if inside}
    allowed = {at for at in found if any(key in at for key in named)}
    assert found == allowed, (f"{name}: host reads per decode step {count(reads)[1:]}; at "
                              f"{sorted(found - allowed)}")
    if not named:
        changed = [i for i in steady if shapes[i] != shapes[2]]
        assert not changed, f"{name}: op shapes change at decode steps {changed}"
