"""Every store kind in the engine's page pools (kvcompile.store.pool), and the batched decode step over pages of
codes and two tiers (kvcompile.engine.batch), under transformers' continuous batching
(kvcompile.integrations.batching).

The stores of codes (int8, int4), of two tiers (mixed precision, codes beside merge slots) and KIVI's keep their
pages in the engine's per-layer pools, a pool per page layout: on every forward the pools' bytes taken are what the
memory report counts of the requests in them, and the pages taken are those their block tables name; every page
comes back when requests finish, are cancelled or fail. Codes and two tiers decode in one batch: generate()'s
tokens, the per-request path's log-probabilities, one decode attention call per layer per step.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import kvcompile
import kvcompile.engine.op
from kvcompile.engine.batch import BatchedDecode, BatchedStepDecode, decode_path
from kvcompile.engine.online import TorchStep
from kvcompile.integrations.batching import KVCompilePagedCache, RequestSampling, request_bytes
from kvcompile.store.codes import ChannelCodeStore, CodeStore
from kvcompile.store.pages import Entries
from kvcompile.store.pool import (BatchCodeStore, BatchTieredStore, PagePools, Pooled, PooledChannelCodeStore,
                                  PooledCodeStore, tiers)
from kvcompile.store.tiers import TieredStore
from tests.test_batched_decode import (assert_same_entries, batched_equals_generate_and_alone, count_step_calls,
                                       prefilled, requests, run_engine, start_engine, step_joining_and_leaving)
from tests.test_serving import SNAP, compiled, gen_config, prompts, reference

# every kept token as codes (int8, int4: one pool of codes a layer), two tiers (mixed: a float pool and a pool of
# codes a layer), KIVI (every token kept; a float pool and a pool of pages of `tokens` codes; groups flush while
# decoding), codes beside merge slots (two tiers, new tokens into the codes; the slots' bias in the float tier), two
# tiers by score beside merge slots
KIVI = dict(storage={"kivi": {"bits": 4, "residual": 16, "tokens": 16}})
KINDS = {"int8": ("snapkv", dict(SNAP, storage="int8")), "int4": ("snapkv", dict(SNAP, storage="int4")),
         "mixed": ("snapkv", dict(SNAP, storage={"mixed": {"full": 0.5, "bits": 4}})), "kivi": ("kivi", KIVI),
         "slots": ("lava_residual", dict(per_head=40, storage="int8")),
         "mixed_slots": ("lava_residual", dict(per_head=40, storage={"mixed": {"full": 0.5, "bits": 4}}))}
TIERED = ("mixed", "kivi", "slots", "mixed_slots")


def kind_model(kind: str):
    spec, overrides = KINDS[kind]
    return compiled(spec, **overrides)


def pooled_requests(state) -> list:
    return [kv for kv in state.requests.values() if any(PagePools.pooled(s) for s in kv.cache.stores)]


def check_pools(state) -> tuple[int, int, int, int]:
    """(bytes the pooled requests hold, what the pools have taken plus their own tensors, the pools' bytes taken,
    the bytes of the pages their block tables name), each pool's free count checked against the pages named."""
    pools = state.pages.pools
    pooled = pooled_requests(state)
    for kv in pooled:
        assert all(PagePools.pooled(s) for s in kv.cache.stores)  # every layer's every tier, once adopted
    own = sum(t.own_tensors_bytes for kv in pooled for s in kv.cache.stores for t in tiers(s))
    taken = pools.report()["bytes_taken"]
    named = 0
    for layer, by_layout in enumerate(pools.by_layout):
        for pool in by_layout.values():
            pages = set()
            for kv in pooled:
                for t in tiers(kv.cache.stores[layer]):
                    if t.pool is pool:
                        cols = torch.arange(t.block_table.shape[-1])
                        pages |= set(t.block_table[cols < t.owned[..., None]].tolist())
            named += len(pages) * pool.page_bytes
            assert pool.free_pages == pool.pages - len(pages)
    return sum(request_bytes(kv) for kv in pooled), taken + own, taken, named


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_store_kind_lives_in_the_pools_and_its_bytes_are_what_memory_reports(kind, monkeypatch):
    """After every forward: the requests' stores (each tier of a tiered store) are in the engine's pools, a pool per
    page layout; the bytes they hold are the pool pages they lease and their block tables and counters; the pages
    taken are those their block tables name. The tokens are generate()'s; at the end every page is free."""
    model = kind_model(kind)
    plan = model.kvcompile_plan
    seen, flushes, layouts = [], [], set()
    sync = KVCompilePagedCache.sync_blocks

    def checked(self):
        sync(self)
        seen.append(check_pools(self.kvcompile))
        layouts.update(len(by_layout) for by_layout in self.kvcompile.pages.pools.by_layout if by_layout)

    flush = ChannelCodeStore.flush  # a request's own flush (a pooled store's), or a batch's (one op for all)

    def counted(self, high, step):
        flushes.append(bool((high.lengths >= self.storage.residual + self.storage.tokens).any()))
        flush(self, high, step)

    monkeypatch.setattr(KVCompilePagedCache, "sync_blocks", checked)
    monkeypatch.setattr(ChannelCodeStore, "flush", counted)
    first = requests([(150, 12), (90, 20), (190, 9), (60, 24)])
    tokens, _, report = run_engine(model, first, num_blocks=64)
    assert tokens == [reference(model, ids, new) for ids, new in first]
    assert any(held for held, *_ in seen)
    for held, counted_bytes, taken, named in seen:
        assert held == counted_bytes and taken == named
    assert layouts == {2 if plan.store is TieredStore else 1}  # a pool per page layout: each tier's
    if kind == "kivi":
        assert any(flushes)  # groups moved into pages of codes in the pool while decoding
    pool = report["decode"]["pool"]
    assert pool["pages"] > 0 and pool["free_pages"] == pool["pages"] and pool["bytes_taken"] == 0
    assert report["free_blocks"] == report["num_blocks"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_batched_codes_equal_generate_and_the_per_request_path(kind, monkeypatch):
    """Pages of codes (and two tiers) decode in one batch over the pools: requests of different lengths, two joining
    once the others decode, get generate()'s tokens and the per-request path's log-probabilities."""
    model = kind_model(kind)
    assert isinstance(decode_path(model.kvcompile_plan), BatchedDecode)
    batched_equals_generate_and_alone(model, monkeypatch)


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_attention_call_per_layer_per_decode_step_over_codes_and_tiers(kind, monkeypatch):
    """Four requests prefilled in one forward, then decoding together, each request's first decode step included:
    every step is one call of the plan's decode attention per layer for all four (over codes: the quantized kernel;
    over two tiers: TieredPagedAttention, one kernel call per tier's pool), and never the op's decode."""
    model = kind_model(kind)
    plan = model.kvcompile_plan
    backend = type(plan.decode_attention)
    calls, alone = [], []
    call = backend.__call__
    monkeypatch.setattr(backend, "__call__", lambda self, q, *args, **kw: calls.append(q.shape[0]) or
                        call(self, q, *args, **kw))
    decode = kvcompile.engine.op.decode
    monkeypatch.setattr(kvcompile.engine.op, "decode", lambda cache, *a, **k: alone.append(1) or decode(cache, *a, **k))
    new = 10
    first = [(x, new) for x in prompts([60, 70, 80, 90])]
    tokens, _, report = run_engine(model, first, max_batch_tokens=512)
    layers = plan.num_layers
    steps = new - 1  # the first token comes from the prompt's forward; every decode step after it is batched
    assert (list(calls), len(alone)) == ([4] * (layers * steps), 0)
    assert tokens == [reference(model, ids, new) for ids, new in first]
    assert report["decode"]["steps"] == steps and report["decode"]["attention_calls"] == layers * steps


@pytest.mark.parametrize("kind, batch", [("int8", BatchCodeStore), ("int4", BatchCodeStore),
                                         ("mixed", BatchTieredStore), ("kivi", BatchTieredStore),
                                         ("slots", BatchTieredStore)])
def test_codes_and_two_tiers_decode_by_one_decode_step_call_per_layer_on_the_batch(kind, batch, monkeypatch):
    """Pages of codes and two tiers decode in the batch by the decode-step family: per layer and step one call of
    `TorchStep` on the four requests as one store of their class over the pools, and never the op's decode. Codes
    (`BatchCodeStore`): the store's own append, quantizing, and the quantized decode attention; two tiers
    (`BatchTieredStore`): the appending tier's append into its pool, the low tier's flush, the attention over both
    tiers' pools."""
    model = kind_model(kind)
    assert isinstance(decode_path(model.kvcompile_plan).step, TorchStep)
    calls, alone, report = count_step_calls(model, monkeypatch)
    steps = 10 - 1  # the first token comes from the prompt's forward
    assert (calls, alone) == ([(4, batch)] * (model.kvcompile_plan.num_layers * steps), 0)
    assert report["decode"]["steps"] == steps


def test_the_plan_batches_every_store_kind_without_a_decode_schedule():
    """int8, int4 (one pool a layer), mixed, KIVI and codes or two tiers beside merge slots (two: a batch of two
    tiers, the slots' bias in the float tier's attention) decode in the batch."""
    for kind in KINDS:
        path = decode_path(kind_model(kind).kvcompile_plan)
        assert isinstance(path, BatchedDecode) and path.pools is not None, kind
        assert isinstance(path.step, TorchStep), kind  # the store's append and attention, on the batch


@pytest.mark.parametrize("kind", list(KINDS))
def test_cancelled_and_failed_requests_give_every_page_back(kind, monkeypatch):
    """Among requests decoding together, one is cancelled and one's sampling fails after it holds pool pages: the
    others get generate()'s tokens, the failed one its error, and every page of every pool is free at the end."""
    model = kind_model(kind)
    config = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256, page_size=16)
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=config)
    pick = RequestSampling.pick
    failing = set()
    held = []  # pool pages taken when the failing request picks its failing token

    def picked(self, history, raw):
        if id(self) in failing and history.shape[1] > 3:
            held.append(manager.batch_processor.cache.kvcompile.pages.pools.report()["bytes_taken"])
            raise RuntimeError("this request's sampling failed")
        return pick(self, history, raw)

    monkeypatch.setattr(RequestSampling, "pick", picked)
    start_engine(manager)
    new = 24
    ids = prompts([150, 120, 140, 100])
    picks = {}
    try:
        for i, x in enumerate(ids):
            picks[f"r{i}"] = RequestSampling.for_config(model, gen_config(new), top_logprobs=0)
            manager.submit(x, f"r{i}", new, picks[f"r{i}"])
        failing.add(id(picks["r2"]))
        outputs, errors, cancelled = {}, {}, False
        deadline = time.monotonic() + 300
        while len(outputs) + len(errors) < 3 or not cancelled:
            assert time.monotonic() < deadline, "the engine stopped answering"
            if not cancelled and len(picks["r3"].logprobs) >= 3:
                manager.cancel_request("r3")
                cancelled = True
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished() and result.request_id != "r3":
                if result.error is not None:
                    errors[result.request_id] = result.error
                else:
                    outputs[result.request_id] = result.generated_tokens
        cache = manager.batch_processor.cache
        deadline = time.monotonic() + 30
        while cache.kvcompile.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        report = cache.memory_report()
    finally:
        manager.stop(block=True, timeout=10)
    assert list(errors) == ["r2"] and "sampling failed" in str(errors["r2"]) and held and held[0] > 0
    assert [outputs[f"r{i}"] for i in range(2)] == [reference(model, x, new) for x in ids[:2]]
    pool = report["decode"]["pool"]
    assert report["requests"] == {} and pool["pages"] > 0 and pool["free_pages"] == pool["pages"]
    assert pool["bytes_taken"] == 0 and report["free_blocks"] == report["num_blocks"]


# --- the pool itself, for codes and tiers ------------------------------------------------------------------------

def entries(n: int, seed: int, heads: int = 2, d: int = 16) -> Entries:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, heads, n, d, generator=g), torch.randn(1, heads, n, d, generator=g)
    take = torch.rand(1, heads, n, generator=g) > 0.3
    return Entries(k, v, torch.rand(1, heads, n, generator=g), torch.arange(n).expand(1, heads, n).clone(),
                   torch.ones(1, heads, n), take)


def storage(name):
    return kvcompile.load_spec("snapkv", storage=name).storage


@pytest.mark.parametrize("part", ["int8", "int4", {"mixed": {"full": 0.5}},
                                  {"kivi": {"bits": 4, "residual": 4, "tokens": 4}}])
def test_a_pooled_store_of_codes_or_tiers_is_the_store_it_adopted(part):
    """Adopted into the pools (a tiered store tier by tier, each in the pool of its layout), a store holds the same
    entries; appends (runs of pool pages, KIVI's flushes, the pools growing) give what its own appends give; a deep
    copy has pages of its own and its class; released stores give every page back."""
    part = storage(part)
    cls = TieredStore if part.tiered else CodeStore
    pools = PagePools(1)
    own = [cls.build([entries(n, seed)], torch.zeros(1, 2, dtype=torch.long), 4, 1, storage=part)
           for seed, n in enumerate((20, 33))]
    pooled = [pools.adopt(0, copy.deepcopy(s)) for s in own]
    for s, p in zip(own, pooled):
        assert all(isinstance(t, Pooled) for t in tiers(p))
        assert_same_entries(s, p) if cls is CodeStore else assert_same_tiers(s, p)
    g = torch.Generator().manual_seed(2)
    pages = {key: pool.pages for key, pool in pools.by_layout[0].items()}
    low = [p.low.lengths.clone() for p in pooled] if part.tiered else None
    for i in range(30):
        for s, p in zip(own, pooled):
            k, v = torch.randn(1, 2, 16, generator=g), torch.randn(1, 2, 16, generator=g)
            s.append(k, v, torch.tensor([100 + i]), step=2)
            p.append(k, v, torch.tensor([100 + i]), step=2)
    assert len(pools.by_layout[0]) == (2 if part.tiered else 1)
    assert any(pool.pages > pages[key] for key, pool in pools.by_layout[0].items())  # grew under the stores
    for s, p in zip(own, pooled):
        assert_same_entries(s, p) if cls is CodeStore else assert_same_tiers(s, p)
        kept = copy.deepcopy(p)
        assert not any(isinstance(t, Pooled) for t in tiers(kept)) and type(kept) is type(s)
        assert_same_entries(s, kept) if cls is CodeStore else assert_same_tiers(s, kept)
    if part.key_axis == "channel":
        assert isinstance(pooled[0].low, PooledChannelCodeStore) and isinstance(own[0].low, ChannelCodeStore)
        assert all(bool((p.low.lengths > before).all()) for p, before in zip(pooled, low))  # flushed groups
    taken = sum(t.leased for p in pooled for t in tiers(p))
    assert pools.report()["pages"] - pools.report()["free_pages"] == taken
    left = PagePools.detached(pooled[0])  # a cache that leaves the engine: pages of its own, the pools' back
    assert type(left) is type(own[0]) and not any(isinstance(t, Pooled) for t in tiers(left))
    assert_same_entries(own[0], left) if cls is CodeStore else assert_same_tiers(own[0], left)
    assert pools.report()["pages"] - pools.report()["free_pages"] == sum(t.leased for t in tiers(pooled[1]))
    PagePools.release(pooled[1])
    assert all(pool.free_pages == pool.pages for pool in pools.by_layout[0].values())


def assert_same_tiers(a: TieredStore, b: TieredStore) -> None:
    assert_same_entries(a.high, b.high)
    assert_same_entries(a.low, b.low)


# running scores over codes (H2O, int8): the plan's decode step runs on the batch as one store of codes
H2O_CODES = dict(per_head=40, storage="int8", ranking={"by_score": {"sinks": 0, "window": 8}})


def test_running_scores_over_codes_decode_in_the_batch_as_generate_and_the_per_request_path(monkeypatch):
    """H2O over int8 pages: the plan's decode step on the batch (`BatchCodeStore`): requests joining once the others
    decode get generate()'s tokens and the per-request path's log-probabilities."""
    model = compiled("h2o", **H2O_CODES)
    assert type(decode_path(model.kvcompile_plan)) is BatchedStepDecode
    batched_equals_generate_and_alone(model, monkeypatch)


def test_a_batched_step_over_codes_is_each_request_alone(monkeypatch):
    """H2O over int8 pages: the plan's decode step, one call a layer on the batch as one store of codes
    (`BatchCodeStore`: the append quantizes, the reads dequantize), leaves each request's pages as its own steps do
    (requests of different lengths, one joining, one leaving): the same codes, positions and lengths, running scores
    and outputs within float summation order (the torch step's softmax runs over the batch's padded width)."""
    plan = compiled("h2o", **dict(H2O_CODES, per_head=16)).kvcompile_plan.with_headroom(24)
    path = decode_path(plan)
    assert type(path) is BatchedStepDecode
    lengths = (40, 23, 61)
    own = [prefilled(plan, n, seed) for seed, n in enumerate(lengths)]
    batched = [prefilled(plan, n, seed) for seed, n in enumerate(lengths)]
    for cache, _ in batched:
        path.adopt(cache)
    step_type, calls = type(plan.decode_step), []
    call = step_type.__call__
    monkeypatch.setattr(step_type, "__call__", lambda self, plan, store, *a: calls.append(type(store)) or call(
        self, plan, store, *a))
    step_joining_and_leaving(plan, path, own, batched, exact=False)
    assert calls.count(BatchCodeStore) == 20 * plan.num_layers  # one call a layer and step for the batch
    for (a, _), (b, _) in zip(own, batched):
        assert a.seq_length == b.seq_length
        for x, y in zip(a.stores, b.stores):
            assert type(x) is CodeStore and isinstance(y, PooledCodeStore) and torch.equal(x.lengths, y.lengths)
            (fx, sx), (fy, sy) = x.entries(), y.entries()
            assert torch.equal(sx, sy)
            for name in ("k_pages", "v_pages", "k_scale", "v_scale", "pos_pages"):  # the codes, bit for bit
                assert torch.equal(getattr(x, name).flatten(0, 1)[fx[sx]], getattr(y, name).flatten(0, 1)[fy[sy]])
            torch.testing.assert_close(x.score_pages.view(-1)[fx[sx]], y.score_pages.view(-1)[fy[sy]])


def test_the_batched_write_of_codes_equals_each_store_append():
    """The batch's append over a pool of codes (`PagePools.batch`) quantizes every request's new entry as each store's
    own append does."""
    part = storage("int4")
    pools = PagePools(1)
    own = [CodeStore.build([entries(n, seed)], torch.zeros(1, 2, dtype=torch.long), 4, 1, storage=part)
           for seed, n in enumerate((9, 23, 16))]
    pooled = [pools.adopt(0, copy.deepcopy(s)) for s in own]
    assert all(isinstance(p, PooledCodeStore) for p in pooled)
    g = torch.Generator().manual_seed(3)
    for i in range(6):
        k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
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
    pool = pooled[0].pool
    for s, p in zip(own, pooled):
        assert_same_entries(s, p)
        flat, stored = s.entries()
        mine, _ = p.entries()
        for name in ("k_pages", "k_scale", "k_zero", "v_pages", "v_scale", "v_zero"):  # the codes themselves
            a, b = getattr(s, name), getattr(pool, name)
            assert torch.equal(a.reshape(-1, a.shape[-1])[flat[stored]], b.reshape(-1, b.shape[-1])[mine[stored]])


def test_kivis_flush_of_a_batch_is_one_op_and_each_stores_own_flush(monkeypatch):
    """KIVI, requests of different lengths decoding in one batch: after the batched append into the float tiers'
    pool, the flush of the batch (`PagePools.batch`: their tiers as one store of two tiers) moves every full group of every request with one quantization of the keys and one
    of the values, and leaves each store's tiers (codes, scales, positions, the float tier's rotated pages and
    lengths) as its own appends and flushes do, bit for bit, while the pool of codes grows under it."""
    import kvcompile.kernels.quantize as quantize

    part = storage({"kivi": {"bits": 4, "residual": 4, "tokens": 4}})
    pools = PagePools(1)
    own = [TieredStore.build([entries(n, seed)], torch.zeros(1, 2, dtype=torch.long), 4, 1, storage=part)
           for seed, n in enumerate((9, 22, 14))]
    pooled = [pools.adopt(0, copy.deepcopy(s)) for s in own]
    codes = pooled[0].low.pool
    pages = codes.pages
    calls = []
    into = quantize.quantize_pages_into
    monkeypatch.setattr(quantize, "quantize_pages_into", lambda x, *a: calls.append(x.shape[0]) or into(x, *a))
    g = torch.Generator().manual_seed(5)
    moved = 0
    for i in range(13):
        k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
        positions = torch.tensor([100 + i] * 3)
        for r, s in enumerate(own):
            s.append(k[r:r + 1], v[r:r + 1], positions[r:r + 1], step=2)
        before = sum(int(p.low.lengths.sum()) for p in pooled)
        for p in pooled:
            if p.room <= 0:
                p.make_room(2)
        batch = PagePools.batch(pooled)
        calls.clear()
        batch.append(k, v, positions, step=2)  # the float tiers' append (no quantization), then the flush
        batch.finish(evicted=False)
        assert calls == [3 * 2, 3 * 2]  # keys, then values: every head of the three requests in one call each
        moved += sum(int(p.low.lengths.sum()) for p in pooled) - before
        for s, p in zip(own, pooled):
            assert_same_tiers(s, p)
            for name in ("k_scale", "k_zero"):  # a scale and zero per page and channel, bit for bit
                mine, theirs = s.low.entries(), p.low.entries()
                held = (mine[0] // 4)[mine[1]], (theirs[0] // 4)[theirs[1]]
                assert torch.equal(getattr(s.low, name)[held[0]], getattr(p.low, name)[held[1]])
    assert moved > 0  # groups were flushed
    assert codes.pages > pages  # the pool of codes grew under the flushes' reservations


def test_a_tiered_store_reserves_what_its_appending_tier_takes():
    """Codes beside merge slots: new tokens join the codes (`new_token_tier` low), so what one append can add
    (`growth_bytes`, what serving reserves for a decode step) is the codes' pages, which a pooled store leases."""
    part = kvcompile.load_spec("lava_residual", storage="int8").storage
    assert part.new_token_tier == "low"
    src = entries(20, 0)
    src.positions[..., :2] = torch.tensor([-1, -2])  # two merge slots a head, kept
    src.take[..., :2] = True
    store = PagePools(1).adopt(0, TieredStore.build([src], torch.full((1, 2), 2), 4, 1, storage=part))
    g = torch.Generator().manual_seed(4)
    grew = []
    for i in range(12):
        reserved, before = store.growth_bytes(1), store.nbytes
        store.append(torch.randn(1, 2, 16, generator=g), torch.randn(1, 2, 16, generator=g), torch.tensor([30 + i]))
        assert store.nbytes - before <= reserved, i
        grew.append(store.nbytes > before)
    assert any(grew)
