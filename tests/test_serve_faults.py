"""No request harms another in `kvcompile serve`: a request whose own work raises (its text's decoding or its stop
check in the server, its forward in the engine as it continues a kept compressed sequence, --reuse-context) gets
its own OpenAI-shaped 500, or, streamed, its stream ends with an error event; the requests answered beside it in
the same engine steps get exactly generate()'s text, its blocks come back (nothing of it is kept for a
continuation) and the server answers afterwards. One tiny server in this process (expected_attention,
--reuse-context), a bounded number of HTTP requests, each with a time limit.
"""
from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi", reason="kvcompile serve needs fastapi and uvicorn")
pytest.importorskip("uvicorn", reason="kvcompile serve needs fastapi and uvicorn")
requests = pytest.importorskip("requests")

import kvcompile  # noqa: E402
from kvcompile.integrations.batching import outside_id  # noqa: E402
from tests.test_serve_http import char_tokenizer, error_of, expected  # noqa: E402
from tests.test_serve_reuse import NEW, TURN1, TURN2, compiled, serving, two_turns  # noqa: E402
from tests.tiny import run_threads  # noqa: E402

TIMEOUT = 60
EA = dict(per_head=16)


def fresh(model, tokenizer, text: str) -> str:
    """generate()'s greedy answer to `text` as the server's text (special tokens skipped)."""
    return expected(model, tokenizer, tokenizer(text)["input_ids"])


class Injected(RuntimeError):
    """The failure a test injects."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.test_serve_http import save_char_model

    folder = save_char_model(tmp_path_factory.mktemp("tiny-faults"))
    policy = kvcompile.load_spec("expected_attention", **EA)
    with serving(folder, policy, reuse_context=True) as server:
        yield server, compiled(folder, policy), char_tokenizer()


def url(server, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{server.options.port}{path}"


def body(server, text: str, **more) -> dict:
    return {"model": server.options.model_name, "prompt": text, "max_tokens": NEW, "temperature": 0, **more}


def streamed(server, payload: dict) -> list[dict]:
    """The stream's events (the JSON of every `data:` line before [DONE]); asserts that [DONE] ends it."""
    events, done = [], False
    with requests.post(url(server), json={**payload, "stream": True}, timeout=TIMEOUT, stream=True) as reply:
        assert reply.status_code == 200, reply.text
        for line in reply.iter_lines(decode_unicode=True):
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    assert done, events
    return events


def text_of(events: list[dict]) -> str:
    assert all("error" not in e for e in events), events
    return "".join(e["choices"][0]["text"] for e in events)


def poison(monkeypatch, server, inject) -> None:
    """`inject(job)` on the Job of every request whose `user` is "poison" (that request's own object only)."""
    prepare = server.prepare

    async def prepared(request, chat, request_id):
        job = await prepare(request, chat, request_id)
        if request.user == "poison":
            inject(job)
        return job

    monkeypatch.setattr(server, "prepare", prepared)


def raising(after: int, what: str):
    calls = []

    def failing(original):
        def call(*args, **kwargs):
            calls.append(1)
            if len(calls) > after:
                raise Injected(f"injected failure in {what}")
            return original(*args, **kwargs)
        return call

    return failing


def accounted(server, failed: list[str]) -> dict:
    """Once the engine is idle: no live request holds bytes, the pool's blocks are the free ones and the kept
    sequences' only (those of the failed requests among neither), and the server is healthy."""
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        state = server.cache.kvcompile
        tables = dict(server.cache.allocator.block_table)
        held = {k: len(v) for k, v in tables.items() if v}
        idle = m["requests_running"] == 0 and m["requests_waiting"] == 0 and not state.requests
        if (idle and m["kv_bytes_outside"] == m["kv_bytes_kept"] and set(held) == set(state.outside)) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle and m["kv_bytes_held"] == 0, m
    assert set(held) == set(state.outside), (held, state.outside)  # blocks only under kept sequences
    assert m["blocks_free"] + sum(held.values()) == m["blocks_total"], (m, held)
    assert m["kv_bytes_outside"] == m["kv_bytes_kept"], m
    for rid in failed:
        assert outside_id(rid) not in state.outside and rid not in tables
    assert not state.sampling and not state.admitted and not state.continued and not state.faults
    assert requests.get(url(server, "/health"), timeout=TIMEOUT).json() == {"status": "ok"}
    return m


@pytest.mark.parametrize("where", ["decode", "stop check"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_requests_own_server_side_failure_fails_it_alone(setup, monkeypatch, where, stream):
    server, model, tokenizer = setup
    if where == "decode":  # its text's decoding raises on its third output
        inject = raising(2, "decode")
        poison(monkeypatch, server, lambda job: setattr(job, "decode", inject(job.decode)))
        extra = {}
    else:  # its stop-string check raises on its second output
        inject = raising(1, "the stop check")
        poison(monkeypatch, server, lambda job: setattr(job, "_cut", inject(job._cut)))
        extra = {"stop": ["~~"]}
    bad = body(server, "Hello there, how are you?", user="poison", **extra)
    a, b = "The quick brown fox jumps over the lazy dog. ", "Pack my box with five dozen liquor jugs."

    def faulty():
        if stream:
            return streamed(server, bad)
        return requests.post(url(server), json=bad, timeout=TIMEOUT)

    failed_before = server.counts["failed"]
    got = run_threads([faulty, lambda: streamed(server, body(server, a, **extra)),
                       lambda: requests.post(url(server), json=body(server, b), timeout=TIMEOUT)])
    if stream:
        errors = [e for e in got[0] if "error" in e]
        assert len(errors) == 1 and got[0][-1] is errors[0], got[0]  # the last event before [DONE]
        error = errors[0]["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    else:
        error = error_of(got[0], 500)
    assert "injected failure" in error["message"] and error["code"] == "internal_error"
    assert text_of(got[1]) == fresh(model, tokenizer, a)
    assert got[2].status_code == 200 and got[2].json()["choices"][0]["text"] == fresh(model, tokenizer, b)
    assert server.counts["failed"] == failed_before + 1
    accounted(server, [])
    monkeypatch.undo()
    reply = requests.post(url(server), json=body(server, "And later?"), timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == fresh(model, tokenizer, "And later?")


def on_continued_cache(server, inject) -> None:
    """`inject(cache)` on the engine's copy of a kept cache, the first time a request continuing one gets it."""
    cache = server.cache
    begin = cache.begin_batch
    done = []

    def begin_and_inject(scheduled):
        begin(scheduled)
        state = cache.kvcompile
        for rid in state.continued:
            kv = state.requests.get(rid)
            if kv is not None and not done:
                done.append(rid)
                inject(kv.cache)

    cache.begin_batch = begin_and_inject
    return done


@pytest.mark.parametrize("where", ["forward", "decode"])
def test_a_continuations_engine_failure_fails_it_alone_and_the_kept_sequence_serves_the_next(setup, where):
    """A request continuing a kept sequence whose forward over its new tokens raises (or one of its decode steps),
    in the engine: its own 500 `engine_error`; a fresh request streamed beside it gets generate()'s text; the kept
    sequence it continued is kept as it was, and the next continuation of it gets the multi-turn answer."""
    server, model, tokenizer = setup
    answer1, answer2 = two_turns(model, tokenizer, TURN1, TURN2)
    first = requests.post(url(server), json=body(server, TURN1), timeout=TIMEOUT).json()
    assert first["choices"][0]["text"] == answer1
    deadline = time.monotonic() + 10
    while server.metrics()["kept_sequences"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    reused = server.metrics()["requests_reused"]
    original = server.cache.begin_batch

    def fail_advance(cache):
        advance, calls = cache.advance, []

        def failing(tokens):
            calls.append(1)
            if len(calls) > (0 if where == "forward" else 2):
                raise Injected(f"injected failure in the continuation's {where}")
            return advance(tokens)

        cache.advance = failing

    hit = on_continued_cache(server, fail_advance)
    other = "Sphinx of black quartz, judge my vow."
    try:
        got = run_threads([lambda: requests.post(url(server), json=body(server, TURN1 + answer1 + TURN2),
                                                 timeout=TIMEOUT),
                           lambda: streamed(server, body(server, other))])
    finally:
        server.cache.begin_batch = original
    assert hit and server.metrics()["requests_reused"] == reused + 1
    error = error_of(got[0], 500)
    assert error["code"] == "engine_error" and "injected failure" in error["message"], error
    assert text_of(got[1]) == fresh(model, tokenizer, other)
    accounted(server, hit)
    again = requests.post(url(server), json=body(server, TURN1 + answer1 + TURN2), timeout=TIMEOUT).json()
    assert again["choices"][0]["text"] == answer2 and server.metrics()["requests_reused"] == reused + 2
    accounted(server, [])


@pytest.mark.parametrize("stream", [True, False])
def test_a_cache_that_cannot_be_kept_gives_its_blocks_back_and_the_answer_stands(setup, monkeypatch, stream):
    """Keeping a finished request's compressed cache for a continuation raises (injected on the server's kept
    sequences): its answer is delivered as it is, its blocks go back to the pool, and the server goes on."""
    server, model, tokenizer = setup
    text = "Keep me if you can."

    def failing(entry):
        raise Injected("injected failure in keeping a cache")

    monkeypatch.setattr(server.kept, "put", failing)
    kept = server.metrics()["kept_sequences"]
    if stream:
        events = streamed(server, body(server, text))
        assert text_of(events) == fresh(model, tokenizer, text)
        rid = events[0]["id"]
    else:
        reply = requests.post(url(server), json=body(server, text), timeout=TIMEOUT)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == fresh(model, tokenizer, text)
        rid = reply.json()["id"]
    accounted(server, [rid])
    assert server.metrics()["kept_sequences"] == kept
    monkeypatch.undo()
    reply = requests.post(url(server), json=body(server, "And later?"), timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == fresh(model, tokenizer, "And later?")
