"""The compiled entry through the public API: kvcompile.compile(model, spec, mode="compiled")
gives the eager entry's greedy tokens for every spec (Inductor, one set of graphs reused
across specs), and generating more tokens adds no graph."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import kvcompile
from tiny import left_pad, prompt, tiny_model

SPECS = sorted(p.stem for p in (Path(__file__).parent.parent / "specs").glob("*.yaml"))


def small(name):
    policy = kvcompile.load_spec(name)
    if policy.budget.threshold is not None:
        return kvcompile.load_spec(name, budget={"threshold": {"attention_norm": {"t": 0.05}}})
    return kvcompile.load_spec(name, per_head=max(48, policy.ranking.sinks + policy.ranking.window + 16))


@pytest.mark.slow
def test_compiled_entry_equals_eager_for_every_spec():
    model = tiny_model("llama")
    ids, mask = left_pad([prompt(150, seed=11)[0], prompt(120, seed=12)[0]])
    eager, compiled = {}, {}
    with torch.no_grad():
        for name in SPECS:
            with kvcompile.compiled(model, small(name)):
                eager[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        for name in SPECS:
            with kvcompile.compiled(model, small(name), mode="compiled"):
                compiled[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert model.config._attn_implementation == "sdpa" and "forward" not in model.__dict__
        # after warm-up, 64 more generated tokens add no graph
        with kvcompile.compiled(model, small("snapkv"), mode="compiled"):
            graphs = counters["stats"]["unique_graphs"]
            model.generate(ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            assert counters["stats"]["unique_graphs"] == graphs
    for name in SPECS:
        assert compiled[name].tolist() == eager[name].tolist(), name
