"""The engine's scheduler after a soft reset (kvcompile.integrations.batching.ReplaySteps): transformers blocks new
requests until a request finishes by itself, so that the starved ones get the blocks first. When the last active
request is cancelled instead (a client gone, a stop string), no request finishes by itself again: the waiting and
re-queued requests must still be scheduled, and their tokens are generate()'s."""
import time

from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvcompile.integrations.batching import KVCompilePagedCache, RequestSampling
from tests.test_serving import SNAP, compiled, gen_config, prompts, reference


def test_waiting_requests_run_after_the_last_active_one_is_cancelled_following_a_soft_reset():
    model = compiled("snapkv", **SNAP)
    config = ContinuousBatchingConfig(num_blocks=20, max_batch_tokens=256, page_size=16)
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=config)
    manager.start()
    new = 72
    ids = prompts([150, 150, 150, 140])
    try:
        deadline = time.monotonic() + 60
        while not isinstance(getattr(manager.batch_processor, "cache", None), KVCompilePagedCache):
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.01)
        cache, scheduler = manager.batch_processor.cache, manager.batch_processor.scheduler
        for i, x in enumerate(ids):
            manager.submit(x, f"r{i}", new, RequestSampling.for_config(model, gen_config(new)))
        deadline = time.monotonic() + 120
        while cache.kvcompile.soft_resets == 0:  # the pool cannot hold the four as they grow
            assert time.monotonic() < deadline, "no soft reset"
            time.sleep(0.001)
        cancelled = set(scheduler.active_requests)
        for rid in cancelled:
            manager.cancel_request(rid)
        outputs = {}
        deadline = time.monotonic() + 120
        while len(outputs) < len(ids) - len(cancelled):
            assert time.monotonic() < deadline, f"the engine stopped answering (done: {sorted(outputs)})"
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished() and result.request_id not in cancelled:
                assert result.error is None, result.error
                outputs[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=10)
    assert cancelled and not cancelled & set(outputs)
    assert outputs == {f"r{i}": reference(model, x, new) for i, x in enumerate(ids) if f"r{i}" not in cancelled}
