"""One page pool per layer and one batched decode step (kvcompile.store.pool, kvcompile.engine.batch) under
transformers' continuous batching (kvcompile.integrations.batching).

Every request's pages live in the engine's pools; a step's decode tokens run as one batch, each request's first
decode step included: per layer one append and one paged attention call for all of them, or, where the policy's
step does more (h2o's running scores, zsmerge's online eviction into merge slots, a merge bias), one call of the
plan's decode step on the batch. What holds: the tokens are generate()'s (each request alone) and the per-request
path's, logits included, with requests of different lengths joining and leaving mid-run; a batched step leaves
each request's pages as its own step does; one attention call per layer per decode step; every page goes back to
its pool; the pool's bytes are what the engine's memory report counts.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import kvcompile
import kvcompile.engine.op
import kvcompile.integrations.batching
import kvcompile.store.pages
from kvcompile.engine.batch import BatchedDecode, BatchedStepDecode, PerRequestDecode, decode_path
from kvcompile.engine.online import TorchStep
from kvcompile.kernels import paged_attention
from kvcompile.integrations.batching import KVCompilePagedCache, RequestSampling, request_bytes
from kvcompile.store.pages import Entries, LayerStore
from kvcompile.store.pool import BatchStore, PagePools, PooledStore
from tests.test_serving import SNAP, compiled, gen_config, prompts, reference
from tests.tiny import tiny_model

SPECS = {"snapkv": SNAP, "pyramidkv": dict(per_head=40), "adakv": dict(per_head=40), "lava": dict(per_head=40),
         "streamingllm": dict(per_head=40)}
# policies whose decode step is more than an append and an attention: the plan's decode step runs on the batch
# (h2o: running scores; zsmerge: decayed scores, online eviction into merge slots, the merge bias; lava_residual:
# merge slots from the prompt, the merge bias)
STEP_SPECS = {"h2o": dict(per_head=40, ranking={"by_score": {"sinks": 0, "window": 8}}), "zsmerge": dict(per_head=40),
              "lava_residual": dict(per_head=40)}


def start_engine(manager) -> None:
    """Start a continuous-batching manager and wait (60 s at most) until its kvcompile cache exists, as server.py
    waits."""
    manager.start()
    deadline = time.monotonic() + 60
    while not isinstance(getattr(manager.batch_processor, "cache", None), KVCompilePagedCache):
        assert time.monotonic() < deadline, "the engine did not start"
        time.sleep(0.01)


def run_engine(model, first, later=(), per_request=None, monkeypatch=None, check=None, **cb):
    """Requests `first` [(ids, max_new_tokens)] submitted at once, then `later` ones once every first request has
    a token (they join while the others decode); each picks its tokens with its own RequestSampling (greedy, the
    top-3 log-probabilities recorded). `per_request`: force the per-request decode path (with or without pools).
    Returns the tokens and log-probabilities per request, and the engine's memory report at the end."""
    if per_request is not None:
        monkeypatch.setattr(kvcompile.integrations.batching, "decode_path", lambda plan: PerRequestDecode(
            PagePools(plan.num_layers) if per_request == "pooled" else None, reason="forced"))
    config = ContinuousBatchingConfig(**{"num_blocks": 128, "max_batch_tokens": 64, "page_size": 16, **cb})
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=config)
    start_engine(manager)
    outputs, picks = {}, {}

    def submit(name, ids, new):
        picks[name] = RequestSampling.for_config(model, gen_config(new), top_logprobs=3)
        manager.submit(ids, name, new, picks[name])

    try:
        for i, (ids, new) in enumerate(first):
            submit(f"a{i}", ids, new)
        names = [f"a{i}" for i in range(len(first))] + [f"b{i}" for i in range(len(later))]
        started = False
        deadline = time.monotonic() + 300
        while len(outputs) < len(names):
            assert time.monotonic() < deadline, "the engine stopped answering"
            if not started and all(len(p.logprobs) >= 1 for n, p in picks.items() if n.startswith("a")):
                for i, (ids, new) in enumerate(later):
                    submit(f"b{i}", ids, new)
                started = True
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                assert result.error is None, result.error
                outputs[result.request_id] = result.generated_tokens
        report = manager.batch_processor.cache.memory_report()
    finally:
        manager.stop(block=True, timeout=10)
    return ([outputs[n] for n in names], [torch.tensor([[lp] + [x for _, x in top] for lp, top in picks[n].logprobs])
                                         for n in names], report)


REQUESTS = [(150, 12), (90, 5), (190, 9), (60, 14)]
LATER = [(120, 7), (40, 10)]


def requests(lengths):
    ids = prompts([n for n, _ in lengths])
    return [(x, new) for x, (_, new) in zip(ids, lengths)]


@pytest.mark.parametrize("spec", list(SPECS))
def test_batched_decode_equals_generate_and_the_per_request_path(spec, monkeypatch):
    """Requests of different prompt lengths and answer lengths, two joining once the others decode: the batched
    engine gives each request generate()'s tokens, and the per-request path's tokens and log-probabilities."""
    model = compiled(spec, **SPECS[spec])
    assert isinstance(decode_path(model.kvcompile_plan), BatchedDecode)
    first = requests(REQUESTS)
    later = [(prompt(n, seed=40 + i)[0].tolist(), new) for i, (n, new) in enumerate(LATER)]
    tokens, logprobs, report = run_engine(model, first, later)
    counts = report["decode"]
    assert counts["steps"] > 0 and counts["tokens"] > counts["steps"]
    # the step's block tables: built where requests joined, cut where some left, else the last step's
    assert 0 < counts["tables_built"] and 0 < counts["tables_cut"]
    assert counts["tables_built"] + counts["tables_cut"] < counts["attention_calls"]
    assert tokens == [reference(model, ids, new) for ids, new in first + later]
    alone, alone_logprobs, alone_report = run_engine(model, first, later, per_request="own",
                                                     monkeypatch=monkeypatch)
    assert "steps" not in alone_report["decode"]
    assert tokens == alone
    for a, b in zip(logprobs, alone_logprobs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def prompt(n, seed):
    from tests.tiny import prompt as tiny_prompt
    return tiny_prompt(n, seed=seed)


def test_one_attention_call_per_layer_per_decode_step(monkeypatch):
    """Four requests prefilled in one forward, then decoding together: every decode step, each request's first
    included (it enters decoding in the step's plan), is one paged attention call per layer for all four, and no
    request runs the op's decode."""
    model = compiled()
    plan = model.kvcompile_plan
    backend = type(plan.decode_attention)
    calls, alone = [], []
    run = backend.run
    monkeypatch.setattr(backend, "run", lambda self, q, *args: calls.append(q.shape[0]) or run(self, q, *args))
    decode = kvcompile.engine.op.decode
    monkeypatch.setattr(kvcompile.engine.op, "decode", lambda cache, *a, **k: alone.append(1) or decode(cache, *a, **k))
    new = 10
    first = [(x, new) for x in prompts([60, 70, 80, 90])]
    tokens, _, report = run_engine(model, first, max_batch_tokens=512)
    counted = list(calls), len(alone)
    layers = plan.num_layers
    steps = new - 1  # the first token comes from the prompt's forward
    # one call per layer and decode step, for the four; the op's decode never
    assert counted == ([4] * (layers * steps), 0)
    assert tokens == [reference(model, ids, new) for ids, new in first]
    assert report["decode"]["steps"] == steps and report["decode"]["attention_calls"] == layers * steps


def count_step_calls(model, monkeypatch, new: int = 10):
    """Four requests prefilled in one forward, then decoding together: the (requests, store class) of every call of
    the batch's decode step (`decode_path(plan).step`), the op's decode calls, and the tokens."""
    step = type(decode_path(model.kvcompile_plan).step)
    calls, alone = [], []
    call = step.__call__
    monkeypatch.setattr(step, "__call__", lambda self, plan, store, layer, q, *a: calls.append(
        (q.shape[0], type(store))) or call(self, plan, store, layer, q, *a))
    decode = kvcompile.engine.op.decode
    monkeypatch.setattr(kvcompile.engine.op, "decode", lambda cache, *a, **k: alone.append(1) or decode(cache, *a, **k))
    first = [(x, new) for x in prompts([60, 70, 80, 90])]
    tokens, _, report = run_engine(model, first, max_batch_tokens=512)
    counted = list(calls), len(alone), report  # before generate() runs the op alone
    assert tokens == [reference(model, ids, new) for ids, new in first]
    return counted


@pytest.mark.parametrize("spec", ["snapkv", "adakv"])
def test_a_plain_policy_decodes_by_one_decode_step_call_per_layer_on_the_batch(spec, monkeypatch):
    """A plain policy's batch runs a member of the decode-step family as the others do: per layer and step one call
    of `TorchStep` (the store's append, the plan's decode attention backend) on the four requests as one store over
    the pool (`BatchStore`), each request's first decode step included, and never the op's decode."""
    model = compiled(spec, **SPECS[spec])
    assert isinstance(decode_path(model.kvcompile_plan).step, TorchStep)
    calls, alone, report = count_step_calls(model, monkeypatch)
    steps = 10 - 1  # the first token comes from the prompt's forward
    assert (calls, alone) == ([(4, BatchStore)] * (model.kvcompile_plan.num_layers * steps), 0)
    assert report["decode"]["steps"] == steps


@pytest.mark.parametrize("spec", ["adakv", "h2o", "zsmerge"])
def test_pages_go_back_and_the_pool_is_what_memory_reports(spec, monkeypatch):
    """After every forward: the requests' bytes (what their pool blocks cover) are the pages they hold in the pools
    and their block tables and counters; the pages taken are those the live requests' block tables name. After
    the run, every page is free again. (h2o and zsmerge: the plan's decode step on the batch, zsmerge's evicting
    online.)"""
    model = compiled(spec, **(SPECS | STEP_SPECS)[spec])
    seen = []
    sync = KVCompilePagedCache.sync_blocks

    def checked(self):
        sync(self)
        state = self.kvcompile
        pools = state.pages.pools
        stores = [s for kv in state.requests.values() for s in kv.cache.stores if isinstance(s, PooledStore)]
        pooled = [kv for kv in state.requests.values() if any(isinstance(s, PooledStore) for s in kv.cache.stores)]
        held = sum(request_bytes(kv) for kv in pooled)
        own = sum(s.own_tensors_bytes for s in stores)
        taken = pools.report()["bytes_taken"]
        named = 0
        for layer, pool in enumerate(pools.layers):
            if pool is None:
                continue
            pages = set()
            for kv in pooled:
                s = kv.cache.stores[layer]
                cols = torch.arange(s.block_table.shape[-1])
                pages |= set(s.block_table[cols < s.owned[..., None]].tolist())
            named += len(pages) * pool.page_bytes
            assert pool.free_pages == pool.pages - len(pages)
        seen.append((held, taken + own, taken, named))

    monkeypatch.setattr(KVCompilePagedCache, "sync_blocks", checked)
    first = requests(REQUESTS)
    tokens, _, report = run_engine(model, first, num_blocks=48)
    assert tokens == [reference(model, ids, new) for ids, new in first]
    assert any(held for held, *_ in seen)
    for held, counted, taken, named in seen:
        assert held == counted and taken == named
    pool = report["decode"]["pool"]
    assert report["decode"]["steps"] > 0  # decoded in batches
    assert pool["pages"] > 0 and pool["free_pages"] == pool["pages"] and pool["bytes_taken"] == 0
    assert report["free_blocks"] == report["num_blocks"]


# --- the pool itself -----------------------------------------------------------------------------------------

def layer_store(n: int, seed: int, heads: int = 2, d: int = 8, page_size: int = 4) -> LayerStore:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, heads, n, d, generator=g), torch.randn(1, heads, n, d, generator=g)
    take = torch.rand(1, heads, n, generator=g) > 0.3
    entries = Entries(k, v, torch.rand(1, heads, n, generator=g), torch.arange(n).expand(1, heads, n).clone(),
                      torch.ones(1, heads, n), take)
    return LayerStore.build([entries], torch.zeros(1, heads, dtype=torch.long), page_size, 1)


def assert_same_entries(a: LayerStore, b: LayerStore) -> None:
    """The same stored entries per head (keys, values, scores, positions, counts), whatever lies past them."""
    x, y = a.gather(), b.gather()
    assert torch.equal(a.lengths, b.lengths) and torch.equal(x[-1], y[-1])
    for u, w in zip(x[:-1], y[:-1]):
        assert torch.equal(u[x[-1]], w[x[-1]])


def test_a_pooled_store_is_the_store_it_adopted():
    """Adopted into a pool, a store holds the same entries; appends (taking runs of pages and growing the pool under
    another store) give what the store's own appends give; a deep copy or a detached store has pages of its own;
    released and dropped stores give their pages back, once."""
    pools = PagePools(1)
    a, b = layer_store(20, 0), layer_store(33, 1)
    before = copy.deepcopy(a)
    pa, pb = pools.adopt(0, a), pools.adopt(0, b)
    assert_same_entries(before, pa)
    pages = pools.layers[0].pages
    g = torch.Generator().manual_seed(2)
    for i in range(40):
        k, v = torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8, generator=g)
        b.append(k, v, torch.tensor([100 + i]), step=2)
        pb.append(k, v, torch.tensor([100 + i]), step=2)
        pa.append(v, k, torch.tensor([100 + i]), step=2)
    assert pools.layers[0].pages > pages  # grew under both stores
    assert_same_entries(b, pb)
    own = copy.deepcopy(pb)
    assert type(own) is LayerStore and own.k_pages.data_ptr() != pb.k_pages.data_ptr()
    assert_same_entries(b, own)
    pool = pools.layers[0]
    assert pool.free_pages == pool.pages - pa.leased - pb.leased
    assert pa.nbytes == pa.leased * pool.page_bytes + pa.own_tensors_bytes
    pb.release()
    assert pb.released and pool.free_pages == pool.pages - pa.leased
    pb.release()  # once
    del pa  # dropped without release: its finalizer gives the pages back
    assert pool.free_pages == pool.pages
    with pytest.raises(RuntimeError, match="twice"):
        pool.give_back(torch.tensor([0]))


def test_the_plan_says_which_policies_decode_in_the_batch():
    for spec, overrides in SPECS.items():
        assert isinstance(decode_path(compiled(spec, **overrides).kvcompile_plan), BatchedDecode), spec
    for spec in ("h2o", "zsmerge", "lava_residual"):  # running scores, online eviction, a merge bias: the plan's step
        path = decode_path(plan_of(spec))
        assert type(path) is BatchedStepDecode and path.pools is not None, spec
    assert isinstance(decode_path(plan_of("kivi")), BatchedDecode)  # two tiers: each in the pool of its page layout
    path = decode_path(plan_of("lava_residual", storage="int8"))  # codes beside merge slots: two tiers, the bias
    assert type(path) is BatchedDecode and isinstance(path.step, TorchStep) and path.pools is not None
    path = decode_path(plan_of("h2o", storage="int8"))  # running scores over codes: the plan's step on the batch
    assert type(path) is BatchedStepDecode and path.pools is not None


def plan_of(spec: str, **overrides):
    return kvcompile.compile(tiny_model(), spec, **overrides).kvcompile_plan


def test_the_batched_write_equals_each_store_append():
    """The batch's append (`PagePools.batch`: one write for every request's new entry) leaves each store as its own
    append does."""
    pools = PagePools(1)
    own = [layer_store(n, seed) for seed, n in enumerate((9, 23, 16))]
    pooled = [pools.adopt(0, copy.deepcopy(s)) for s in own]
    g = torch.Generator().manual_seed(3)
    for i in range(5):
        k, v = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
        positions = torch.tensor([50 + i, 60 + i, 70 + i])
        for j, s in enumerate(own):
            s.append(k[j:j + 1], v[j:j + 1], positions[j:j + 1], step=1)
        for s in pooled:
            s.make_room(1)
        batch = PagePools.batch(pooled)
        batch.append(k, v, positions)
        batch.finish(evicted=False)
        lengths = batch.lengths
        assert torch.equal(lengths, torch.cat([s.lengths for s in own]))
    for s, p in zip(own, pooled):
        assert_same_entries(s, p)
        assert p.room == s.room


def test_kernel_takes_a_batch_over_one_pool():
    """The paged kernel over the pool's batch equals it per request (what the batched step relies on)."""
    pools = PagePools(1)
    stores = [pools.adopt(0, layer_store(n, seed)) for seed, n in enumerate((9, 23, 16))]
    pool = pools.layers[0]
    q = torch.randn(3, 4, 8)
    out = PagePools.batch(stores).attend(paged_attention.backend("torch"), q, lambda counts: None, 0.3)
    for i, s in enumerate(stores):
        one = paged_attention.backend("torch")(q[i:i + 1], pool.k_pages, pool.v_pages, s.block_table, s.lengths, None,
                                               0.3)
        torch.testing.assert_close(out[i:i + 1], one)


def test_cancelled_and_soft_reset_requests_give_their_pages_back():
    """A request cancelled while it decodes, and requests the engine soft-resets in a small pool (replayed from
    their prompts): every page is back in its pool at the end, and the others' tokens are generate()'s."""
    model = compiled("snapkv", per_head=16, ranking={"by_score": {"window": 4}},
                     scoring={"window_attention": {"window": 4}})
    config = ContinuousBatchingConfig(num_blocks=20, max_batch_tokens=256, page_size=16)
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=config)
    start_engine(manager)
    new = 72
    ids = prompts([150, 150, 150, 140])
    picks = {}
    try:
        for i, x in enumerate(ids):
            picks[f"r{i}"] = RequestSampling.for_config(model, gen_config(new), top_logprobs=0)
            manager.submit(x, f"r{i}", new, picks[f"r{i}"])
        outputs, cancelled = {}, False
        deadline = time.monotonic() + 300
        while len(outputs) < 3 or not cancelled:
            assert time.monotonic() < deadline, "the engine stopped answering"
            if not cancelled and len(picks["r3"].logprobs) >= 3:
                manager.cancel_request("r3")
                cancelled = True
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished() and result.request_id != "r3":
                assert result.error is None, result.error
                outputs[result.request_id] = result.generated_tokens
        deadline = time.monotonic() + 30
        cache = manager.batch_processor.cache
        while cache.kvcompile.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        report = cache.memory_report()
    finally:
        manager.stop(block=True, timeout=10)
    assert report["soft_resets"] >= 1 and report["decode"]["steps"] > 0
    assert [outputs[f"r{i}"] for i in range(3)] == [reference(model, x, new) for x in ids[:3]]
    pool = report["decode"]["pool"]
    assert report["requests"] == {} and pool["pages"] > 0 and pool["free_pages"] == pool["pages"]


def batched_equals_generate_and_alone(model, monkeypatch) -> None:
    """Requests of different lengths, two joining once the others decode, run in one batch: some steps batched,
    each request gets generate()'s tokens, and the per-request path's tokens and log-probabilities (1e-4)."""
    first = requests(REQUESTS)
    later = [(prompt(n, seed=40 + i)[0].tolist(), new) for i, (n, new) in enumerate(LATER)]
    tokens, logprobs, report = run_engine(model, first, later)
    counts = report["decode"]
    assert counts["steps"] > 0 and counts["tokens"] > counts["steps"]
    assert tokens == [reference(model, ids, new) for ids, new in first + later]
    alone, alone_logprobs, alone_report = run_engine(model, first, later, per_request="pooled",
                                                     monkeypatch=monkeypatch)
    assert "steps" not in alone_report["decode"]
    assert tokens == alone
    for a, b in zip(logprobs, alone_logprobs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# --- the plan's decode step on the batch: running scores, online eviction, the merge bias ----------------------

@pytest.mark.parametrize("kernels", [None, "torch"])
@pytest.mark.parametrize("spec", list(STEP_SPECS))
def test_batched_step_equals_generate_and_the_per_request_path(spec, kernels, monkeypatch):
    """h2o, zsmerge and lava_residual (the fused C++ step, and the torch step): requests joining and leaving mid-run
    decode in one batch, each its first decode step included, and each gets generate()'s tokens and the per-request
    path's tokens and log-probabilities."""
    model = compiled(spec, **STEP_SPECS[spec], **({} if kernels is None else {"kernels": kernels}))
    assert type(decode_path(model.kvcompile_plan)) is BatchedStepDecode
    batched_equals_generate_and_alone(model, monkeypatch)


@pytest.mark.parametrize("spec", list(STEP_SPECS))
def test_one_decode_step_call_per_layer_per_step(spec, monkeypatch):
    """Four requests prefilled in one forward, then decoding together: every decode step, the first included, is
    one call of the plan's decode step per layer for all four (the fused C++ kernel once, over the four), no
    request runs the op's decode, and the tokens are generate()'s."""
    model = compiled(spec, **STEP_SPECS[spec])
    plan = model.kvcompile_plan
    step, kernel = type(plan.decode_step), []
    calls, alone = [], []
    call = step.__call__
    monkeypatch.setattr(step, "__call__", lambda self, plan, store, layer, q, *a: calls.append(q.shape[0]) or call(
        self, plan, store, layer, q, *a))
    decode = kvcompile.engine.op.decode
    monkeypatch.setattr(kvcompile.engine.op, "decode", lambda cache, *a, **k: alone.append(1) or decode(cache, *a, **k))
    counted = kvcompile.store.pages.online_step_cpp
    monkeypatch.setattr(kvcompile.store.pages, "online_step_cpp",
                        lambda pages, q, *a: kernel.append(q.shape[0]) or counted(pages, q, *a))
    new = 10
    first = [(x, new) for x in prompts([60, 70, 80, 90])]
    tokens, _, report = run_engine(model, first, max_batch_tokens=512)
    got = list(calls), len(alone), list(kernel)
    layers = plan.num_layers
    steps = new - 1  # the first token comes from the prompt's forward
    uses_kernel = isinstance(plan.decode_step, kvcompile.store.pages.CppOnlineStep)
    assert got == ([4] * (layers * steps), 0, [4] * (layers * steps) if uses_kernel else [])
    assert tokens == [reference(model, ids, new) for ids, new in first]
    assert report["decode"]["steps"] == steps and report["decode"]["attention_calls"] == layers * steps


def prefilled(plan, n: int, seed: int):
    """A cache holding a random prompt of n tokens compressed by the plan (the op's prompt path, layer by layer),
    and the generator its decode steps draw from."""
    from kvcompile.cache import KVCompileCache
    g = torch.Generator().manual_seed(seed)
    cache = KVCompileCache.from_plan(plan)
    hq, h, d = 4, plan.num_heads, plan.head_dim
    for layer in range(plan.num_layers):
        q, k, v = (torch.randn(1, x, n, d, generator=g) for x in (hq, h, h))
        kvcompile.engine.op.run_layer(q, k, v, None, layer, cache, d ** -0.5)
    return cache, g


def step_joining_and_leaving(plan, path, own, batched, exact: bool) -> None:
    """20 decode steps of the requests `batched` (adopted by `path`) through the path's batched step, request 2
    joining at step 6 and request 1 leaving at 14, and of their twins `own` alone through the op, on the same
    random q, k, v: each step's batched output equals the request's own (bit for bit where `exact`)."""
    hq, h, d = 4, plan.num_heads, plan.head_dim
    for t in range(20):
        live = [0, 1] if t < 6 else [0, 1, 2] if t < 14 else [0, 2]  # request 2 joins at step 6, 1 leaves at 14
        step = path.plan([(batched[r][0], 1) for r in live])
        assert step.alone == [] and step.batch is not None
        for layer in range(plan.num_layers):
            draws = [[torch.randn(1, x, 1, d, generator=own[r][1]) for x in (hq, h, h)] for r in live]
            q, k, v = (torch.cat([x[i] for x in draws], dim=2) for i in range(3))
            out = step.batch.run(layer, q, k, v, d ** -0.5)
            for r, ((cache, _), (qi, ki, vi)) in enumerate(zip([own[r] for r in live], draws)):
                alone = kvcompile.engine.op.run_layer(qi, ki, vi, None, layer, cache, d ** -0.5)
                if exact:
                    assert torch.equal(out[r], alone[0, :, 0])
                else:
                    torch.testing.assert_close(out[r], alone[0, :, 0])


@pytest.mark.parametrize("kernels", [None, "torch"])
@pytest.mark.parametrize("spec", list(STEP_SPECS))
def test_a_batched_step_is_each_request_alone(spec, kernels):
    """The plan's decode step on a batch of requests (of different lengths, their first decode step and the next
    ones, past the point where zsmerge's heads evict into full merge slots; one joining the batch for its first step
    beside requests already decoding, one leaving) leaves each request's pages as its own steps do: the same entries (keys, values, positions, merge counts, running scores) and outputs, exactly for the
    C++ steps (a head's step reads its own pages only, on one thread at these sizes), within float summation order
    for the torch step (its softmax runs over the batch's padded width)."""
    overrides = dict(STEP_SPECS[spec], per_head=16) | ({} if kernels is None else {"kernels": kernels})
    plan = compiled(spec, **overrides).kvcompile_plan.with_headroom(24)
    assert type(decode_path(plan)) is BatchedStepDecode
    lengths = (40, 23, 61)
    own = [prefilled(plan, n, seed) for seed, n in enumerate(lengths)]
    batched = [prefilled(plan, n, seed) for seed, n in enumerate(lengths)]
    path = decode_path(plan)
    for cache, _ in batched:
        path.adopt(cache)
    same = torch.equal if kernels is None else torch.testing.assert_close
    step_joining_and_leaving(plan, path, own, batched, exact=kernels is None)
    for (a, _), (b, _) in zip(own, batched):
        assert a.seq_length == b.seq_length
        for x, y in zip(a.stores, b.stores):
            assert isinstance(y, PooledStore) and torch.equal(x.lengths, y.lengths) and torch.equal(x.slots, y.slots)
            gx, gy = x.gather(), y.gather()
            stored = gx[-1]
            assert torch.equal(stored, gy[-1])
            assert torch.equal(gx[3][stored], gy[3][stored]) and torch.equal(gx[4][stored], gy[4][stored])
            for u, w in zip(gx[:3], gy[:3]):
                same(u[stored], w[stored])
    if spec == "zsmerge":  # merge slots were filled and folded into while the batch decoded
        assert all(bool((s.slots > 0).all()) and float(s.count_pages.max()) > 1 for c, _ in batched for s in c.stores)
