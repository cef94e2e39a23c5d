"""Prefill once, compress many: a cache replayed from captured states is the cache a live
prefill builds, and the greedy tokens from it are generate()'s."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvcompile
from kvcompile.sweep import capture, greedy, replay
from tiny import left_pad, prompt, tiny_model

# replay has no model to run a reconstruction scorer's second pass (kvzip): refused, tests/test_kvzip.py
SPECS = sorted(p.stem for p in (Path(__file__).parent.parent / "specs").glob("*.yaml")
               if not getattr(kvcompile.load_spec(p).scoring, "reconstructs", False))


@pytest.fixture(scope="module")
def captured():
    model = tiny_model("llama")
    ids, mask = left_pad([prompt(140, seed=21)[0], prompt(101, seed=22)[0]])
    states, logits = capture(model, ids, mask)
    return model, ids, mask, states, logits


@pytest.mark.parametrize("name", SPECS)
def test_replay_equals_live_prefill_and_generate(captured, name):
    model, ids, mask, states, logits = captured
    policy = kvcompile.load_spec(name) if kvcompile.load_spec(name).budget.threshold else \
        kvcompile.load_spec(name, per_head=max(48, kvcompile.load_spec(name).ranking.window + 16))
    cache = replay(policy, model.config, states)
    with kvcompile.compiled(model, policy), torch.no_grad():
        live = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              return_dict_in_generate=True)
    tokens = greedy(model, cache, logits, max_new_tokens=6)
    assert tokens.tolist() == live.sequences[:, ids.shape[1]:].tolist()
    assert torch.equal(cache.kept(), live.past_key_values.kept())


@pytest.mark.parametrize("name", ["snapkv", "lava", "zsmerge", "streamingllm"])
def test_teacher_forced_on_replay_equals_live_prefill(name):
    """The continuation scores (kvcompile eval --continuation) from a replayed cache are the
    logits of a live compiled prefill fed the same continuation token by token."""
    from kvcompile.sweep import teacher_forced

    model = tiny_model("llama")
    ids = prompt(130, seed=31)
    prompt_ids, continuation = ids[:, :110], ids[:, 110:]
    policy = kvcompile.load_spec(name, per_head=max(40, kvcompile.load_spec(name).ranking.window + 16))
    states, last = capture(model, prompt_ids)
    replayed = teacher_forced(model, replay(policy, model.config, states), last, continuation)
    with kvcompile.compiled(model, policy), torch.no_grad():
        out = model(prompt_ids, use_cache=True)
        cache, rows = out.past_key_values, [out.logits[:, -1]]
        for t in range(continuation.shape[1] - 1):
            out = model(continuation[:, t:t + 1], past_key_values=cache, use_cache=True)
            rows.append(out.logits[:, -1])
    torch.testing.assert_close(replayed, torch.stack(rows, dim=1))
    assert replayed.shape == (1, 20, model.config.vocab_size)
