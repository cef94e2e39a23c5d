"""Prefill once, compress many: a cache replayed from captured states is the cache a live
prefill builds, and the greedy tokens from it are generate()'s."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvcompile
from kvcompile.tools.sweep import capture, greedy, replay
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
    from kvcompile.tools.sweep import teacher_forced

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


def test_replay_refuses_a_chunked_prefill_and_prefilled_runs_it():
    """A policy that compresses while prefilling in chunks changes the prompt's forward itself (chunk k
    attends to what chunks < k kept): a one-pass capture cannot give it, so replay refuses it with the
    reason, and `prefilled` (the compiled model's own forward) gives what generate()'s prefill keeps."""
    from kvcompile.tools.sweep import not_replayable, prefilled

    model = tiny_model("llama")
    ids = prompt(120, seed=41)
    chunked = kvcompile.load_spec("expected_attention", per_head=24, schedule={"prefill": {"chunk": 40}})
    one_pass = kvcompile.load_spec("expected_attention", per_head=24)
    assert not_replayable(one_pass) is None and "schedule.prefill" in not_replayable(chunked)
    states, last = capture(model, ids)
    with pytest.raises(ValueError, match="cannot be replayed.*schedule.prefill"):
        replay(chunked, model.config, states)
    cache, logits = prefilled(model, chunked, ids, headroom=4)
    with kvcompile.compiled(model, chunked), torch.no_grad():
        live = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    one = replay(one_pass, model.config, states)
    assert greedy(model, cache, logits, max_new_tokens=4).tolist() == live.sequences[:, ids.shape[1]:].tolist()
    assert torch.equal(cache.kept(), live.past_key_values.kept())
    # the chunked prefill keeps other entries than one pass at this budget (what a replay would have shown)
    assert any(not torch.equal(one.kept_positions(layer), cache.kept_positions(layer))
               for layer in range(model.config.num_hidden_layers))


def _fresh(states):
    """The same captured layers with no scores kept yet."""
    from kvcompile.tools.sweep import Captured

    return Captured(list(states), states.windows, states.sinks, states.ids)


@pytest.mark.parametrize("name", SPECS)
def test_a_replay_from_kept_prompt_scores_equals_one_that_scores(captured, name, monkeypatch):
    """replay keeps each scorer's prompt scores with the captured states: a second replay (and any policy with
    the same scorer) selects from them without scoring again, and keeps and answers what scoring again gives."""
    from kvcompile.plan import Plan

    model, ids, mask, states, logits = captured
    policy = kvcompile.load_spec(name) if kvcompile.load_spec(name).budget.threshold else \
        kvcompile.load_spec(name, per_head=max(48, kvcompile.load_spec(name).ranking.window + 16))
    plain = replay(policy, model.config, list(states))  # a plain list keeps nothing: every layer scored
    fresh = _fresh(states)
    replay(policy, model.config, fresh)
    assert len(fresh.scores) == 1
    calls = []
    monkeypatch.setattr(Plan, "score", lambda self, state: calls.append(1) or pytest.fail("scored again"))
    again = replay(policy, model.config, fresh)
    assert not calls
    assert torch.equal(again.kept(), plain.kept())
    monkeypatch.undo()
    assert greedy(model, again, logits, max_new_tokens=6).tolist() == \
        greedy(model, plain, logits, max_new_tokens=6).tolist()


def test_policies_that_share_a_scorer_share_its_prompt_scores(captured):
    """Another allocation, schedule and storage over the same scorer reuse its kept scores and keep what scoring
    again keeps; another scorer's fields are another entry."""
    model, ids, mask, states, logits = captured
    first = kvcompile.load_spec("snapkv", per_head=48)
    other = kvcompile.load_spec("snapkv", per_head=40, budget={"heads": "pooled", "layers": "pyramid"},
                                storage="int8", schedule="cascade")
    fresh = _fresh(states)
    replay(first, model.config, fresh)
    shared = replay(other, model.config, fresh)
    assert len(fresh.scores) == 1
    plain = replay(other, model.config, list(states))
    assert torch.equal(shared.kept(), plain.kept())
    assert greedy(model, shared, logits, max_new_tokens=6).tolist() == \
        greedy(model, plain, logits, max_new_tokens=6).tolist()
    wider = kvcompile.load_spec("snapkv", per_head=48, scoring={"window_attention": {"window": 16}})
    replay(wider, model.config, fresh)
    assert len(fresh.scores) == 2


@pytest.mark.parametrize("layers", ["global", "entropy"])
def test_policies_that_act_alike_keep_the_same_entries(captured, layers):
    """Policy.acting: a layers rule that moves budgets by scores cascades whatever the schedule says, so
    `schedule: prefill` and `schedule: cascade` beside it are one policy (tune searches it once): equal under
    acting() and keeping the same entries; beside a static layers rule the two stay distinct."""
    model, ids, mask, states, logits = captured
    scoring = "window_attention" if layers == "entropy" else "key_norm"
    base = {"name": "a", "scoring": scoring, "budget": {"per_head": 40, "layers": layers, "heads": "pooled"}}
    one, two = (kvcompile.load_spec(dict(base, schedule=s)) for s in ("prefill", "cascade"))
    assert one != two and one.acting() == two.acting()
    assert torch.equal(replay(one, model.config, states).kept(), replay(two, model.config, states).kept())
    static = {"name": "a", "scoring": scoring, "budget": {"per_head": 40, "layers": "uniform"}}
    assert kvcompile.load_spec(dict(static, schedule="prefill")).acting() != \
        kvcompile.load_spec(dict(static, schedule="cascade")).acting()


def test_every_spec_decoded_together_gives_each_cache_its_own_answer():
    """greedy_together: the caches of every replayable spec at two budgets, after one question, decode as batches
    of the engine's batched step (plans whose steps differ in separate batches, `batch_key`), every batch in one
    forward a step: each cache's tokens are greedy()'s on a copy of it alone, and it holds the same entries and
    bytes after."""
    import copy

    from kvcompile.engine.batch import batch_key
    from kvcompile.tools.sweep import feed, greedy_together

    model = tiny_model("llama")
    ids, question = prompt(140, seed=21), prompt(9, seed=5)
    states, _ = capture(model, ids)
    caches, lasts, alone = [], [], []
    for name in SPECS:
        spec = kvcompile.load_spec(name)
        if spec.schedule.prefill is not None:  # chunked prefill: not replayable (test above)
            continue
        for per_head in (48, 80):
            policy = spec if spec.budget.threshold else \
                kvcompile.load_spec(name, per_head=max(per_head, spec.ranking.window + 16))
            cache = replay(policy, model.config, states, headroom=40)
            last = feed(model, cache, question)
            own = copy.deepcopy(cache)
            alone.append((name, greedy(model, own, last, 20)[0].tolist(), own.memory_report()))
            caches.append(cache)
            lasts.append(last)
    keys = {batch_key(cache.plan) for cache in caches}
    assert len(caches) >= 30 and len(keys) >= 4 and None not in keys  # several batches, each of several caches
    forwards = []
    hook = model.register_forward_hook(lambda module, args, out: forwards.append(1))
    try:
        tokens, seconds = greedy_together(model, caches, lasts, 20)
    finally:
        hook.remove()
    assert len(forwards) <= 19  # every batch in the same forward a step (a token is the last's argmax; 20 at most)
    for (name, expected, report), got, cache, (wall, cpu) in zip(alone, tokens, caches, seconds):
        assert got == expected, name
        after = cache.memory_report()
        assert after["bytes_held"] == report["bytes_held"] and torch.equal(after["kept"], report["kept"]), name
        assert wall > 0 and cpu > 0


def test_a_cache_whose_steps_do_not_batch_decodes_alone_among_batched_ones():
    """greedy_together: a plan whose decode steps run per request (pruning every few tokens: batch_key None) is
    decoded by greedy() alone, between the batched caches, and gives greedy()'s tokens like them."""
    import copy

    from kvcompile.engine.batch import batch_key
    from kvcompile.policy import policy_to_mapping
    from kvcompile.tools.sweep import feed, greedy_together

    model = tiny_model("llama")
    ids, question = prompt(120, seed=31), prompt(6, seed=7)
    states, _ = capture(model, ids)
    pruning = dict(policy_to_mapping(kvcompile.load_spec("h2o", per_head=80)),
                   schedule={"decode": {"every": 3}})
    policies = [kvcompile.load_spec("snapkv", per_head=48), kvcompile.load_spec(pruning),
                kvcompile.load_spec("snapkv", per_head=64)]
    caches, lasts, expected = [], [], []
    for policy in policies:
        cache = replay(policy, model.config, states, headroom=30)
        lasts.append(feed(model, cache, question))
        own = copy.deepcopy(cache)
        expected.append(greedy(model, own, lasts[-1], 12)[0].tolist())
        caches.append(cache)
    assert [batch_key(c.plan) is None for c in caches] == [False, True, False]
    tokens, seconds = greedy_together(model, caches, lasts, 12)
    assert tokens == expected and all(wall > 0 and cpu > 0 for wall, cpu in seconds)


def test_adopting_many_caches_grows_each_pool_once_to_their_pages(captured):
    """PooledPages.adopt_all: every layer's pool grows once, to exactly the pages the caches' heads own (adopting
    one by one grows a pool by a quarter at a time, copying it each time), and each cache's entries are the same
    as adopted one at a time."""
    from kvcompile.engine.batch import decode_path

    model, ids, mask, states, logits = captured
    policies = [kvcompile.load_spec(name, per_head=per_head) for name in ("snapkv", "tova") for per_head in (48, 64)]
    caches = [replay(policy, model.config, states) for policy in policies]
    owned = [sum(int(cache.stores[layer].owned.sum()) for cache in caches) for layer in range(len(caches[0].stores))]
    together, alone = decode_path(caches[0].plan), decode_path(caches[0].plan)
    copies = [replay(policy, model.config, states) for policy in policies]
    together.adopt_all(caches)
    for cache in copies:
        alone.adopt(cache)
    for layer, pages in enumerate(owned):
        (pool,) = together.pools.by_layout[layer].values()
        assert pool.pages == pages and pool.free_pages == 0
        (grown,) = alone.pools.by_layout[layer].values()
        assert grown.pages >= pages
        for a, b in zip(caches, copies):
            torch.testing.assert_close(a.stores[layer].kv_rows(a.stores[layer].entries()[0]),
                                       b.stores[layer].kv_rows(b.stores[layer].entries()[0]), rtol=0, atol=0)
