"""A request that continues a kept compressed cache (`kvcompile serve --reuse-context`) is a request of the
continuous-batching engine (kvcompile.integrations.batching): a copy of the kept cache enters the engine's page
pools as the request's, the prompt's tokens after the kept sequence are fed from its position, its decode steps
run in the same batched step as the other requests' (kvcompile.engine.batch), and the engine's blocks account
for its bytes. What holds: its tokens and log-probabilities are `generate(prompt, past_key_values=<copy of the
kept cache>)`'s on the compiled model, the kept cache is never written, a continued and a fresh request decode in
one paged attention call per layer, the pools hold what the memory report counts while a continuation runs, and
every page comes back when it finishes, is cut at a stop string or fails.
"""
from __future__ import annotations

import contextlib
import copy
import time

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import kvcompile
from kvcompile.engine.batch import BatchedDecode, DecodeBatch, decode_path
from kvcompile.integrations.batching import KVCompilePagedCache, RequestSampling, request_bytes
from kvcompile.store.pool import PooledStore
from tests.test_batched_decode import assert_same_entries
from tests.test_serving import gen_config, prompts, reference
from tests.tiny import prompt as tiny_prompt

EA = dict(per_head=16)  # expected_attention (query-agnostic: what --reuse-context serves) keeps 16 per head


def compiled():
    from tests.tiny import tiny_model

    return kvcompile.compile(tiny_model(), "expected_attention", **EA)


def kept_sequence(model, ids: list[int], new: int):
    """generate()'s compressed cache of `ids` and its answer (the last answer token not fed), and those tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=gen_config(new), return_dict_in_generate=True)
    return out.sequences[0].tolist(), out.past_key_values


def continued(model, ids: list[int], cache, new: int):
    """generate(ids, past_key_values=<a copy of cache>): the new tokens and each one's log-probability under the
    model (log-softmax of the raw logits)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), past_key_values=copy.deepcopy(cache), generation_config=gen_config(new),
                             return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@contextlib.contextmanager
def engine(model, **cb):
    config = ContinuousBatchingConfig(**{"num_blocks": 128, "max_batch_tokens": 512, "page_size": 16, **cb})
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=config)
    manager.start()
    try:
        deadline = time.monotonic() + 60
        while not isinstance(getattr(manager.batch_processor, "cache", None), KVCompilePagedCache):
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.01)
        yield manager
    finally:
        manager.stop(block=True, timeout=10)


def run(manager, model, requests):
    """Submit every (name, ids, new, kept cache or None) at once; each request's tokens and sampling."""
    picks, outputs = {}, {}
    for name, ids, new, kept in requests:
        picks[name] = RequestSampling.for_config(model, gen_config(new), top_logprobs=0)
        manager.submit(ids, name, new, picks[name], continues=kept)
    deadline = time.monotonic() + 300
    while len(outputs) < len(requests):
        assert time.monotonic() < deadline, "the engine stopped answering"
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            assert result.error is None, result.error
            outputs[result.request_id] = result.generated_tokens
    return outputs, picks


def test_a_continued_request_equals_generate_from_a_copy_and_decodes_in_the_fresh_requests_step(monkeypatch):
    """A continued request and a fresh one submitted together: the continued request's tokens and log-probabilities
    are generate()'s from a copy of the kept cache (left unchanged), the fresh one's are generate()'s; every
    batched step is one paged attention call per layer, and where both decode, one call holds both."""
    model = compiled()
    plan = model.kvcompile_plan
    assert isinstance(decode_path(plan), BatchedDecode)
    first, fresh = prompts([70, 60])
    sequence, kept = kept_sequence(model, first, 5)
    before = copy.deepcopy(kept)
    ids = sequence + tiny_prompt(20, seed=7)[0].tolist()
    new = 10
    want, want_logprobs = continued(model, ids, kept, new)
    calls, steps = [], []
    backend = type(plan.decode_attention)
    call = backend.run
    monkeypatch.setattr(backend, "run", lambda self, q, *a: calls.append(q.shape[0]) or call(self, q, *a))
    step = DecodeBatch.run

    def recorded(self, layer, *args):
        names = {id(kv.cache): rid for rid, kv in cache.kvcompile.requests.items()}
        before = len(calls)
        out = step(self, layer, *args)
        steps.append((tuple(sorted(names[id(c)] for c in self.caches)), calls[before:]))
        return out

    monkeypatch.setattr(DecodeBatch, "run", recorded)
    with engine(model) as manager:
        cache = manager.batch_processor.cache
        outputs, picks = run(manager, model, [("continued", ids, new, kept), ("fresh", fresh, new, None)])
        report = cache.memory_report()
    assert outputs["continued"] == want and outputs["fresh"] == reference(model, fresh, new)
    torch.testing.assert_close(torch.tensor([lp for lp, _ in picks["continued"].logprobs]),
                               torch.tensor(want_logprobs), rtol=1e-4, atol=1e-4)
    assert kept.seq_length == before.seq_length == len(sequence) - 1
    for a, b in zip(kept.stores, before.stores):
        assert_same_entries(a, b)
    layers = plan.num_layers
    together = [names for names, _ in steps if names == ("continued", "fresh")]
    assert len(together) >= layers * 3 and len(together) % layers == 0
    assert len(steps) == report["decode"]["attention_calls"] == layers * report["decode"]["steps"]
    assert all(made == [len(names)] for names, made in steps)  # per layer one call for the batch's requests
    pool = report["decode"]["pool"]
    assert report["requests"] == {} and pool["free_pages"] == pool["pages"] > 0
    assert report["free_blocks"] == report["num_blocks"]
    assert {u.request_id for u in report["finished"]} == {"continued", "fresh"}  # its usage is the engine's


def test_tokens_after_the_kept_sequence_longer_than_a_forward_are_fed_in_several():
    """The engine splits a continued request's new tokens at its token budget: each forward appends its share to
    the copy of the kept cache, and the tokens are generate()'s, which feeds them in one forward."""
    model = compiled()
    sequence, kept = kept_sequence(model, prompts([50])[0], 4)
    ids = sequence + tiny_prompt(90, seed=8)[0].tolist()
    with engine(model, max_batch_tokens=32) as manager:
        outputs, _ = run(manager, model, [("continued", ids, 6, kept)])
    assert outputs["continued"] == continued(model, ids, kept, 6)[0]


def test_a_continued_request_reserves_blocks_for_what_it_holds(monkeypatch):
    """After every forward the continued request holds blocks that cover its copy in the pools (the engine's byte
    accounting: no bytes outside the engine), its bytes are the pool pages its block tables name, and the
    pools' pages taken are the live requests'."""
    model = compiled()
    sequence, kept = kept_sequence(model, prompts([70])[0], 5)
    ids = sequence + tiny_prompt(40, seed=9)[0].tolist()
    seen = []
    sync = KVCompilePagedCache.sync_blocks

    def checked(self):
        sync(self)
        state = self.kvcompile
        kv = state.requests.get("continued")
        if kv is None:
            return
        assert all(isinstance(s, PooledStore) for s in kv.cache.stores)
        blocks = len(self.allocator.block_table.get("continued", []))
        taken = state.pages.pools.report()["bytes_taken"]
        own = sum(s.own_tensors_bytes for r in state.requests.values() for s in r.cache.stores
                  if isinstance(s, PooledStore))
        held = sum(request_bytes(r) for r in state.requests.values())
        seen.append((request_bytes(kv), blocks, state.bytes_per_block, held, taken + own, self.outside_bytes()))

    monkeypatch.setattr(KVCompilePagedCache, "sync_blocks", checked)
    with engine(model) as manager:
        outputs, _ = run(manager, model, [("continued", ids, 8, kept), ("fresh", prompts([80, 30])[1], 8, None)])
        report = manager.batch_processor.cache.memory_report()
    assert outputs["continued"] == continued(model, ids, kept, 8)[0]
    assert len(seen) >= 7
    for mine, blocks, per_block, held, counted, outside in seen:
        assert blocks == -(-mine // per_block) > 0 and held == counted and outside == 0
    assert report["free_blocks"] == report["num_blocks"] and report["decode"]["pool"]["bytes_taken"] == 0


def test_a_soft_reset_continued_request_is_replayed_from_its_kept_cache(monkeypatch):
    """A pool too small for every request as they grow while decoding: the engine soft-resets starved requests,
    a continued one among them (re-queued from token 0 with its prompt and generated tokens). kvcompile replays it
    from a fresh copy of the same kept cache (its new tokens, then each generated token as a decode step): its
    tokens are generate()'s from a copy of the kept cache, the others' generate()'s, and every page comes back."""
    model = compiled()
    sequence, kept = kept_sequence(model, prompts([60])[0], 4)
    ids = sequence + tiny_prompt(30, seed=11)[0].tolist()
    replayed = []
    requeued = KVCompilePagedCache.requeued
    monkeypatch.setattr(KVCompilePagedCache, "requeued",
                        lambda self, request, prompt: replayed.append(request.request_id) or
                        requeued(self, request, prompt))
    new = 72
    others = prompts([150, 150, 150])
    with engine(model, num_blocks=20, max_batch_tokens=256) as manager:
        outputs, _ = run(manager, model, [(f"r{i}", x, new, None) for i, x in enumerate(others)] +
                         [("continued", ids, new, kept)])
        report = manager.batch_processor.cache.memory_report()
    assert "continued" in replayed and report["soft_resets"] >= 1
    assert outputs["continued"] == continued(model, ids, kept, new)[0]
    assert [outputs[f"r{i}"] for i in range(3)] == [reference(model, x, new) for x in others]
    pool = report["decode"]["pool"]
    assert report["requests"] == {} and report["free_blocks"] == report["num_blocks"]
    assert pool["free_pages"] == pool["pages"]


@pytest.mark.parametrize("tokens", [1, 3, 9, 17])
def test_what_several_appends_can_take_bounds_what_they_take(tokens):
    """append_bytes (a continued request's reservation for its tokens after the kept sequence): for a store in a
    pool, exactly the pages and block-table columns those appends take; for a store with pages of its own, at least
    what they take (its tensors grow by a quarter at once)."""
    from kvcompile.integrations.batching import append_bytes
    from kvcompile.store.pool import PagePools
    from tests.test_batched_decode import layer_store

    for n, seed in ((20, 0), (33, 1), (8, 2)):
        own, pools = layer_store(n, seed), PagePools(1)
        pooled = pools.adopt(0, layer_store(n, seed))
        bounds = [append_bytes(own, tokens, 2, pooled=False), append_bytes(pooled, tokens, 2, pooled=True)]
        before = [own.nbytes, pooled.nbytes]
        g = torch.Generator().manual_seed(seed)
        for i in range(tokens):
            k, v = torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8, generator=g)
            for store in (own, pooled):
                store.append(k, v, torch.tensor([100 + i]), step=2)
        grown = [own.nbytes - before[0], pooled.nbytes - before[1]]
        assert grown[1] == bounds[1] and grown[0] <= bounds[0], (n, grown, bounds)
        assert grown[1] > 0 or tokens < 17  # 17 appends take pages past every head's spares
