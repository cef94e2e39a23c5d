"""kvcompile inside transformers' continuous batching (kvcompile.integrations.batching).

A compiled model's `generate_batch` / `init_continuous_batching` runs each request through its own
KVCompileCache: the tokens equal `model.generate` with the same spec (greedy), one request or several
at once, and a compressed request gives its blocks back to the engine's pool after its prompt.
"""
import math

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import RequestState

import kvcompile
from kvcompile.integrations.generate import CompileError
from kvcompile.integrations.batching import BATCHING_ATTENTION, KVCompileBatchingManager, KVCompilePagedCache
from tests.tiny import prompt, tiny_model

NEW = 8
# snapkv with a window that fits the tiny prompts: 16 entries per KV head
SNAP = dict(per_head=16, ranking={"by_score": {"window": 4}}, scoring={"window_attention": {"window": 4}})


def gen_config(new: int = NEW) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def compiled(spec: str = "snapkv", **overrides):
    model = tiny_model()
    return kvcompile.compile(model, spec, **(overrides or SNAP))


def prompts(lengths) -> list[list[int]]:
    return [prompt(n, seed=10 + i)[0].tolist() for i, n in enumerate(lengths)]


def reference(model, ids: list[int], new: int = NEW) -> list[int]:
    out = model.generate(torch.tensor([ids]), generation_config=gen_config(new))
    return out[0, len(ids):].tolist()


def serve(model, inputs, new: int = NEW, **cb):
    """Run `inputs` through the engine's manager (started, fed, stopped here); the tokens in input order
    and the cache's memory report after the run."""
    config = ContinuousBatchingConfig(**{"num_blocks": 64, "max_batch_tokens": 256, "page_size": 16, **cb})
    manager = model.init_continuous_batching(generation_config=gen_config(new), continuous_batching_config=config)
    assert isinstance(manager, KVCompileBatchingManager)
    manager.start()
    try:
        ids = manager.add_requests(inputs=inputs, max_new_tokens=new)
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=30)
            assert result is not None, "the engine stopped answering"
            if result.is_finished():
                assert result.error is None, result.error
                results[result.request_id] = result
        report = manager.batch_processor.cache.memory_report()
    finally:
        manager.stop(block=True, timeout=10)
    return [results[i].generated_tokens for i in ids], report


def engine_cache(model, num_blocks: int) -> KVCompilePagedCache:
    """The engine's cache on a compiled model (its manager's batch processor's), without starting the engine."""
    manager = model.init_continuous_batching(generation_config=gen_config(),
                                             continuous_batching_config=ContinuousBatchingConfig(num_blocks=num_blocks,
                                                                                                 page_size=16))
    return manager._create_batch_processor().cache


def test_one_request_equals_generate():
    model = compiled()
    ids = prompts([60])
    out = model.generate_batch(ids, generation_config=gen_config(), warmup=False,
                               continuous_batching_config=ContinuousBatchingConfig(num_blocks=32, page_size=16))
    assert [r.generated_tokens for r in out.values()] == [reference(model, ids[0])]
    # the policy ran: the full cache gives other tokens for this prompt
    plain = tiny_model()
    assert reference(plain, ids[0]) != reference(model, ids[0])


def test_concurrent_requests_equal_their_sequential_results():
    """Four requests at once, their prompts split over several forwards (max_batch_tokens 64), packed
    with the others' decode steps: each gives what it gives alone through generate()."""
    model = compiled()
    ids = prompts([40, 90, 130, 65])
    tokens, report = serve(model, ids, max_batch_tokens=64)
    assert tokens == [reference(model, x) for x in ids]
    assert report["peak_requests"] >= 2 and report["requests"] == {}


@pytest.mark.parametrize("spec", ["adakv", "lava", "zsmerge"])
def test_headwise_cascade_and_online_specs_equal_generate(spec):
    model = compiled(spec, per_head=40)
    ids = prompts([150, 90, 190])
    tokens, _ = serve(model, ids, max_batch_tokens=96)
    assert tokens == [reference(model, x) for x in ids]


def test_compressed_requests_give_blocks_back_and_run_together():
    """A pool of 24 blocks (384 tokens): four requests of 158 tokens need 40 blocks with full caches
    (at most two at once); compressed, all four hold their caches at the same time."""
    model = compiled()
    ids = prompts([150, 150, 150, 150])
    num_blocks = 24
    full = math.ceil((150 + NEW - 1) / 16)
    assert 2 * full <= num_blocks < 3 * full
    tokens, report = serve(model, ids, num_blocks=num_blocks)
    assert tokens == [reference(model, x) for x in ids]
    assert report["peak_requests"] == 4
    assert report["blocks_released"] > 0
    usage = report["finished"]
    assert len(usage) == 4
    for u in usage:
        assert u.tokens == 150 + NEW - 1  # the last token is sampled, never stored
        assert u.full_blocks == full
        assert u.blocks == math.ceil(u.bytes / report["bytes_per_block"])
        assert u.blocks < full / 2
    assert report["free_blocks"] == report["num_blocks"]  # every block back in the pool


@pytest.mark.parametrize("spec,max_batch_tokens,num_blocks", [("snapkv", 64, 20), ("adakv", 256, 20),
                                                              ("h2o", 256, 16)])
def test_soft_reset_requests_are_replayed_exactly(spec, max_batch_tokens, num_blocks):
    """A pool of 16 or 20 blocks: three requests compressed to 16 entries per head fit together after their prompts,
    but not as they grow while decoding (no eviction), so the engine soft-resets starved ones
    (`create_equivalent_initial_request`: prompt + generated tokens re-queued). kvcompile replays each:
    the original prompt compressed as before (in chunks of the token budget with max_batch_tokens 64),
    then every generated token as a decode step; the tokens are generate()'s. snapkv: one budget per
    layer; adakv: head-wise budgets; h2o: scores that keep running while decoding."""
    overrides = dict(per_head=16, ranking={"by_score": {"window": 4}})
    if spec != "h2o":
        overrides["scoring"] = {"window_attention": {"window": 4}}
    model = compiled(spec, **overrides)
    new = 72
    ids = prompts([150, 150, 150])
    tokens, report = serve(model, ids, new=new, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    assert report["soft_resets"] >= 1 and report["replayed_tokens"] >= 1  # decoding requests were preempted
    assert tokens == [reference(model, x, new) for x in ids]
    assert report["requests"] == {} and report["free_blocks"] == report["num_blocks"]


def test_a_request_reusing_a_replayed_id_is_not_replayed():
    """The replay is tied to the very request the engine re-queued: a later request under the same id, with
    another prompt, runs as a fresh one (its whole initial tokens are its prompt)."""
    model = compiled()
    cache = engine_cache(model, num_blocks=16)
    ids = prompts([60])[0]
    old = RequestState("req", initial_tokens=ids, max_new_tokens=NEW)
    old.generated_tokens = [5, 6, 7]
    requeued = old.create_equivalent_initial_request()  # what the engine's soft reset re-queues
    cache.requeued(requeued, prompt=len(ids))
    assert cache.prompt_length(requeued) == len(ids) and cache.headroom(requeued) == NEW
    assert cache.replay_step(requeued) == len(ids)
    fresh = RequestState("req", initial_tokens=ids + [5, 6, 7], max_new_tokens=NEW)
    assert cache.replay_of(fresh) is None and cache.replay_step(fresh) is None
    assert cache.prompt_length(fresh) == len(ids) + 3
    cache.free_blocks("req")  # the request ends: its replay goes with it
    assert cache.replay_of(requeued) is None


def test_reservation_does_not_grow_with_max_new_tokens():
    """transformers serve asks 1024 new tokens of a request that names no max_tokens: a request reserves its
    compressed prompt and at most plan.SPARE_RUN spare pages per head (the same for 64 new tokens or 1024),
    then grows step by step as it decodes."""
    model = compiled()
    cache = engine_cache(model, num_blocks=64)
    ids = prompts([150])[0]

    def reserved(new):
        return cache.reserved_tokens(RequestState("req", initial_tokens=ids, max_new_tokens=new), len(ids))

    assert reserved(1024) == reserved(64) < len(ids)
    assert reserved(8) <= reserved(64)


def test_engine_runs_kvcompile_attention_and_releases_its_tensor():
    model = compiled()
    config = ContinuousBatchingConfig(num_blocks=16, page_size=16)
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=config)
    assert model.config._attn_implementation == BATCHING_ATTENTION
    processor = manager._create_batch_processor()
    assert isinstance(processor.cache, KVCompilePagedCache)
    assert processor.cache.cache_tensor.numel() == 0
    assert not processor.cache.use_prefix_sharing
    assert not manager.continuous_batching_config.allow_block_sharing


@pytest.mark.parametrize("case", ["async", "offload", "fork", "compiled", "decode_every", "prefill_chunk"])
def test_what_cannot_run_is_refused_at_start(case):
    gen = gen_config()
    config = ContinuousBatchingConfig(num_blocks=16, page_size=16)
    if case == "decode_every":
        model = compiled("snapkv", **SNAP, schedule={"cascade": False, "decode": {"every": {"n": 4}}})
        match = "prunes every 4"
    elif case == "prefill_chunk":
        model = compiled("snapkv", **SNAP, schedule={"prefill": {"chunk": {"size": 32}}})
        match = "every 32 tokens"
    elif case == "compiled":
        model = kvcompile.compile(tiny_model(), "snapkv", mode="compiled", **SNAP)
        match = "mode='eager'"
    else:
        model = compiled()
        if case == "async":
            config.use_async_batching = True
            match = "use_async_batching"
        elif case == "offload":
            config.cpu_offload_space = 1.0
            match = "cpu_offload_space"
        else:
            gen.num_return_sequences = 2
            match = "num_return_sequences"
    before = model.config._attn_implementation
    with pytest.raises(CompileError, match=match):
        model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    assert model.config._attn_implementation == before  # nothing switched


def test_uncompile_gives_back_the_engine():
    model = compiled()
    ids = prompts([60])
    kvcompile.uncompile(model)
    assert "init_continuous_batching" not in model.__dict__
    out = model.generate_batch(ids, generation_config=gen_config(), warmup=False,
                               continuous_batching_config=ContinuousBatchingConfig(num_blocks=32, page_size=16))
    assert [r.generated_tokens for r in out.values()] == [reference(model, ids[0])]


def test_a_kept_manager_is_reused_and_destroyed_by_uncompile():
    model = compiled()
    ids = prompts([50])
    config = ContinuousBatchingConfig(num_blocks=32, page_size=16)
    first = model.generate_batch(ids, generation_config=gen_config(), continuous_batching_config=config,
                                 warmup=False, persistent_manager=True)
    kept = model._cached_continuous_batching_manager
    assert isinstance(kept, KVCompileBatchingManager)
    assert model.init_continuous_batching() is kept
    assert [r.generated_tokens for r in first.values()] == [reference(model, ids[0])]
    kvcompile.uncompile(model)
    assert not hasattr(model, "_cached_continuous_batching_manager")
    assert model.config._attn_implementation == "sdpa"


def test_a_request_the_pool_can_never_hold_is_refused_at_admission():
    """A pool of 24 blocks: a 600-token prompt in chunks of 64 holds its full keys and values until its last chunk,
    more than the pool: refused when admitted, naming its size and the pool's; the other request runs."""
    model = compiled()
    ids = prompts([600, 60])
    config = ContinuousBatchingConfig(num_blocks=24, page_size=16, max_batch_tokens=64)
    out = model.generate_batch(ids, generation_config=gen_config(), warmup=False, continuous_batching_config=config)
    big, small = out.values()
    assert big.error is not None and "needs" in big.error and "the pool has 24 blocks (384 tokens)" in big.error
    assert small.error is None and small.generated_tokens == reference(model, ids[1])
