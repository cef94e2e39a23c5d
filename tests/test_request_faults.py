"""No request harms another in the continuous-batching engine (kvcompile.integrations.batching): one request's own
work raising inside a step (its cache's compression or append, its pages' move into the engine's pools, a continued
request's copy of its kept cache or its forward), injected on that request's cache object only, fails that request
alone: its result carries the error, its blocks and pool pages come back, every other request of the same forwards
gets exactly generate()'s tokens, and the engine serves the next request. A failure that no request owns (the
batched decode kernel, which covers every decoding request) fails the requests of that forward, each with the
error, with every block and page given back, and the engine goes on.
"""
from __future__ import annotations

import time

import pytest

import kvcompile
from kvcompile.engine.batch import BatchedDecode, decode_path
from kvcompile.integrations.batching import RequestSampling
from tests.test_reuse_engine import engine
from tests.test_serving import SNAP, gen_config, prompts, reference
from tests.tiny import prompt as tiny_prompt
from tests.tiny import tiny_model

NEW = 8


class Injected(RuntimeError):
    """The failure a test injects."""


def compiled(spec: str = "snapkv", **overrides):
    return kvcompile.compile(tiny_model(), spec, **(overrides or SNAP))


def run(manager, model, requests) -> dict:
    """Submit every (name, ids, new, kept cache or None) at once; each request's tokens, or its error (a str)."""
    outcomes = {}
    for name, ids, new, kept in requests:
        manager.submit(ids, name, new, RequestSampling.for_config(model, gen_config(new)), continues=kept)
    deadline = time.monotonic() + 120
    while len(outcomes) < len(requests):
        assert time.monotonic() < deadline, f"the engine stopped answering (answered: {sorted(outcomes)})"
        result = manager.get_result(timeout=1)
        if result is None:
            continue
        if result.error is not None:
            outcomes[result.request_id] = str(result.error)
        elif result.is_finished():
            outcomes[result.request_id] = result.generated_tokens
    return outcomes


def on_cache_of(manager, name: str, inject) -> None:
    """Call `inject(cache)` on request `name`'s own KVCompileCache as soon as the engine makes it (the engine
    cache's `begin_batch`, patched on that one engine's instance)."""
    cache = manager.batch_processor.cache
    begin = cache.begin_batch
    done = []

    def begin_and_inject(scheduled):
        begin(scheduled)
        kv = cache.kvcompile.requests.get(name)
        if kv is not None and not done:
            done.append(True)
            inject(kv.cache)

    cache.begin_batch = begin_and_inject


def raise_on_call(obj, method: str, after: int = 0, calls: list | None = None):
    """`obj.method` (on that instance only) raising Injected from its call number `after` + 1 on (`calls`: the count,
    shared with earlier injections)."""
    original = getattr(obj, method)
    calls = [] if calls is None else calls

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise Injected(f"injected failure in {method}")
        return original(*args, **kwargs)

    setattr(obj, method, failing)


def assert_all_given_back(manager) -> None:
    cache = manager.batch_processor.cache
    deadline = time.monotonic() + 10
    while cache.kvcompile.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    report = cache.memory_report()
    pool = report["decode"]["pool"]
    assert report["requests"] == {} and report["free_blocks"] == report["num_blocks"], report
    assert pool["free_pages"] == pool["pages"] and pool["bytes_taken"] == 0, pool
    state = cache.kvcompile
    assert not state.sampling and not state.admitted and not state.continued and not state.faults


# the faulty request's own work, by where it raises
FAULTS = {
    # its prompt's compression: the op's prefill hands layer 1's compressed store to its cache
    "compression": lambda cache: raise_on_call(cache, "hold_store", after=1),
    # after the forward that compressed it: its pages' move into the engine's pools
    "adoption": lambda cache: raise_on_call(cache, "hold_stores"),
    # after a later forward, its pages in the pools already (a store of two tiers is bound to a new object then)
    "later adoption": lambda cache: raise_on_call(cache, "hold_stores", after=2),
    # its third decode step, in the batched step: its cache counting the token
    "advance": lambda cache: raise_on_call(cache, "advance", after=3),
    # a decode step in the batched step: its layer-1 store making room for the token (before that layer's kernel)
    "make_room": lambda cache: on_layer_store(cache, 1, "make_room", after=2),
}


def on_layer_store(cache, layer: int, method: str, after: int) -> None:
    """`raise_on_call` on the cache's layer-`layer` store once its pages are in the engine's pools, and on every store
    object that replaces it there (a store of two tiers is a new object after each forward), one count for all."""
    hold, calls, done = cache.hold_stores, [], set()

    def hold_and_inject(stores):
        hold(stores)
        store = cache.stores[layer]
        if id(store) not in done:
            done.add(id(store))
            raise_on_call(store, method, after, calls)

    cache.hold_stores = hold_and_inject


def assert_fails_alone(manager, model, fault, a, bad, c) -> None:
    """Requests a, bad and c at once, `fault` injected into bad's cache: bad fails with the injected error, a and c
    get generate()'s tokens, and every block and pool page comes back."""
    on_cache_of(manager, "bad", fault)
    outcomes = run(manager, model, [("a", a, NEW, None), ("bad", bad, NEW, None), ("c", c, NEW, None)])
    assert isinstance(outcomes["bad"], str) and "injected failure" in outcomes["bad"], outcomes["bad"]
    assert outcomes["a"] == reference(model, a) and outcomes["c"] == reference(model, c)
    assert_all_given_back(manager)


@pytest.mark.parametrize("where", list(FAULTS))
def test_one_requests_failure_inside_a_step_fails_it_alone(where):
    model = compiled()
    assert isinstance(decode_path(model.kvcompile_plan), BatchedDecode)
    a, bad, c, later = prompts([60, 50, 70, 40])
    with engine(model) as manager:
        assert_fails_alone(manager, model, FAULTS[where], a, bad, c)
        assert run(manager, model, [("later", later, NEW, None)])["later"] == reference(model, later)
        assert_all_given_back(manager)
        assert manager.batch_processor.cache.kvcompile.failed_forwards == 0  # no forward failed as a whole


def fail_deepcopy(cache) -> None:
    def failing(memo):
        raise Injected("injected failure in the copy of the kept cache")

    cache.__deepcopy__ = failing


@pytest.mark.parametrize("where", ["copy", "forward", "decode"])
def test_a_continued_requests_failure_fails_it_alone(where):
    """A request continuing a kept compressed cache (kvcompile serve --reuse-context) fails alone where its copy of
    the kept cache fails (the pages copied into the pools so far given back), where its forward over the tokens
    after the kept sequence raises, or one of its decode steps: a fresh request beside it gets generate()'s tokens,
    and the kept cache is left as it was for the next continuation, which gets generate()'s tokens from it."""
    from tests.test_reuse_engine import compiled as query_agnostic, continued, kept_sequence

    model = query_agnostic()
    first, fresh = prompts([70, 60])
    sequence, kept = kept_sequence(model, first, 5)
    ids = sequence + tiny_prompt(20, seed=7)[0].tolist()
    new = 6
    with engine(model) as manager:
        if where == "copy":
            fail_deepcopy(kept)
        else:
            on_cache_of(manager, "continued", lambda cache: raise_on_call(cache, "advance",
                                                                          after=0 if where == "forward" else 2))
        outcomes = run(manager, model, [("continued", ids, new, kept), ("fresh", fresh, new, None)])
        assert isinstance(outcomes["continued"], str) and "injected failure" in outcomes["continued"]
        assert outcomes["fresh"] == reference(model, fresh, new)
        assert_all_given_back(manager)
        if where == "copy":
            del kept.__deepcopy__
        again = run(manager, model, [("again", ids, new, kept)])
        assert again["again"] == continued(model, ids, kept, new)[0]
        assert_all_given_back(manager)
        assert manager.batch_processor.cache.kvcompile.failed_forwards == 0


def test_a_batched_kernel_failure_fails_the_requests_of_its_forward_and_the_engine_goes_on():
    """The batched decode step's kernel covers every decoding request of the forward: its failure is no one
    request's, so every request that forward packed fails with the error (none hangs), every block and page comes
    back, and the next requests get generate()'s tokens."""
    model = compiled()
    a, b, later = prompts([60, 50, 40])
    with engine(model) as manager:
        path = manager.batch_processor.cache.kvcompile.pages
        step, calls = path.step, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2 * model.kvcompile_plan.num_layers + 1:  # the third batched step's first layer
                raise Injected("injected failure in the batched kernel")
            return step(*args, **kwargs)

        path.step = failing
        outcomes = run(manager, model, [("a", a, NEW, None), ("b", b, NEW, None)])
        assert all(isinstance(o, str) and "injected failure" in o for o in outcomes.values()), outcomes
        assert_all_given_back(manager)
        assert manager.batch_processor.cache.kvcompile.failed_forwards == 1
        assert run(manager, model, [("later", later, NEW, None)])["later"] == reference(model, later)
        assert_all_given_back(manager)


def test_a_request_whose_sampling_fails_streams_no_stand_in_token():
    """A request whose own sampling raises on its third token (the forward gives its row a stand-in token so the
    others keep their places): none of its outputs carries the stand-in, its error comes with the two tokens it
    picked, and a request beside it gets generate()'s tokens."""
    model = compiled()
    a, bad = prompts([60, 50])
    with engine(model) as manager:
        sampling = RequestSampling.for_config(model, gen_config(NEW))
        raise_on_call(sampling, "pick", after=2)
        manager.submit(bad, "bad", NEW, sampling, streaming=True)
        manager.submit(a, "a", NEW, RequestSampling.for_config(model, gen_config(NEW)))
        seen, deadline = [], time.monotonic() + 60
        while not any(s.request_id == "bad" and s.error is not None for s in seen) or \
                not any(s.request_id == "a" for s in seen):
            assert time.monotonic() < deadline, seen
            result = manager.get_result(timeout=1)
            if result is not None:
                seen.append(result)
        mine = [s for s in seen if s.request_id == "bad"]
        assert mine[-1].error is not None and "injected failure" in mine[-1].error
        assert all(len(s.generated_tokens) <= 2 for s in mine), [s.generated_tokens for s in mine]
        assert mine[-1].generated_tokens == reference(model, bad)[:2]
        assert next(s for s in seen if s.request_id == "a").generated_tokens == reference(model, a)
        assert_all_given_back(manager)


# other batched decode steps: the plan's own step on the batch (h2o: running scores; zsmerge: online eviction and
# its split per request), and a store of two tiers (kivi: full-precision recent entries, int codes beside them)
OTHER_PATHS = {"h2o": dict(per_head=40, ranking={"by_score": {"sinks": 0, "window": 8}}), "zsmerge": dict(per_head=40),
               "kivi": dict(per_head=40)}


@pytest.mark.parametrize("where", ["advance", "make_room", "later adoption"])
@pytest.mark.parametrize("spec", list(OTHER_PATHS))
def test_one_requests_failure_in_other_batched_steps_fails_it_alone(spec, where):
    model = compiled(spec, **OTHER_PATHS[spec])
    assert isinstance(decode_path(model.kvcompile_plan), BatchedDecode)
    a, bad, c = prompts([60, 50, 70])
    with engine(model) as manager:
        assert_fails_alone(manager, model, FAULTS[where], a, bad, c)
        assert manager.batch_processor.cache.kvcompile.failed_forwards == 0
