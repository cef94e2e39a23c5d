"""`kvcompile serve --reuse-context`: a request that continues an earlier one (its prompt starts with that request's
prompt and answer) continues a copy of that request's kept compressed cache, prefilling only the new tokens. On a
tiny model served in this process on 127.0.0.1 with the character tokenizer of test_serve_http (one token per
character, so a client's text continuation is the kept token ids followed by the new ones): the second turn's tokens
equal generate()'s multi-turn path (`generate(turn2, past_key_values=<turn 1's cache>)`, what
`kvcompile.integrations.context.Conversation.say` runs); with a budget covering everything, the plain model's; without reuse, or
for a prompt diverging inside a kept sequence, a fresh prefill's. The kept caches are bounded (least recently used
dropped, its pool blocks given back) and a query-aware policy is refused at start-up.
"""
import contextlib
import math
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="kvcompile serve needs fastapi and uvicorn")
pytest.importorskip("uvicorn", reason="kvcompile serve needs fastapi and uvicorn")
requests = pytest.importorskip("requests")

import kvcompile  # noqa: E402
from kvcompile.integrations.context import KeptSequence, KeptSequences  # noqa: E402
from kvcompile.integrations.server import KVCompileServer, ServeOptions  # noqa: E402
from kvcompile.integrations.batching import RequestKV, request_bytes  # noqa: E402
from tests.test_serve_http import char_tokenizer, free_port, save_char_model  # noqa: E402

TIMEOUT = 60
NEW = 6
EA = dict(per_head=16)  # expected_attention keeps 16 entries per head of a prompt
TURN1 = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
TURN2 = " And then? Tell me again, slowly:"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_char_model(tmp_path_factory.mktemp("tiny-reuse"))


@contextlib.contextmanager
def serving(folder, policy, **options):
    server = KVCompileServer(ServeOptions(spec=policy, model=str(folder), port=free_port(), kv_tokens=4096,
                                          max_batch_tokens=128, log_level="error", log_requests=False, **options))
    server.start()
    try:
        server.wait_started(timeout=60)
        yield server
    finally:
        server.stop()


def complete(server, prompt: str, stream: bool = False) -> dict:
    url = f"http://127.0.0.1:{server.options.port}/v1/completions"
    body = {"model": server.options.model_name, "prompt": prompt, "max_tokens": NEW, "temperature": 0}
    if not stream:
        reply = requests.post(url, json=body, timeout=TIMEOUT)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]
    import json

    text, finish = "", None
    with requests.post(url, json={**body, "stream": True}, timeout=TIMEOUT, stream=True) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text, finish = text + choice["text"], choice["finish_reason"] or finish
    return {"text": text, "finish_reason": finish}


def settled(server, **expected) -> dict:
    """The server's metrics once the engine thread applied the pool holds and releases (and kept `expected`)."""
    end = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m["kv_bytes_outside"] == m["kv_bytes_kept"] and all(m[k] == v for k, v in expected.items()):
            return m
        if time.monotonic() > end:
            return m
        time.sleep(0.05)


def compiled(folder, policy):
    from transformers import AutoModelForCausalLM

    return kvcompile.compile(AutoModelForCausalLM.from_pretrained(folder).eval(), policy)


def ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text)["input_ids"]])


def two_turns(model, tokenizer, turn1: str, turn2_after: str):
    """generate()'s multi-turn path: turn 1, then turn 2 continuing turn 1's cache (the texts of both answers)."""
    with torch.no_grad():
        first = model.generate(ids(tokenizer, turn1), max_new_tokens=NEW, do_sample=False,
                               return_dict_in_generate=True)
        answer1 = tokenizer.decode(first.sequences[0, -NEW:])
        second = ids(tokenizer, turn1 + answer1 + turn2_after)
        assert torch.equal(second[:, :first.sequences.shape[1]], first.sequences)
        out = model.generate(second, past_key_values=first.past_key_values, max_new_tokens=NEW, do_sample=False)
    return answer1, tokenizer.decode(out[0, second.shape[1]:])


def fresh(model, tokenizer, text: str) -> str:
    with torch.no_grad():
        out = model.generate(ids(tokenizer, text), max_new_tokens=NEW, do_sample=False)
    return tokenizer.decode(out[0, -NEW:])


def test_second_turn_equals_the_multi_turn_path(folder):
    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    answer1, answer2 = two_turns(compiled(folder, policy), tokenizer, TURN1, TURN2)
    full = fresh(compiled(folder, policy), tokenizer, TURN1 + answer1 + TURN2)
    with serving(folder, policy, reuse_context=True) as server:
        first = complete(server, TURN1)
        assert (first["text"], first["finish_reason"]) == (answer1, "length")
        m = settled(server, kept_sequences=1)
        assert m["kept_sequences"] == 1 and m["kv_bytes_kept"] > 0 and m["requests_reused"] == 0
        assert m["kv_bytes_outside"] == m["kv_bytes_kept"]  # the kept cache is counted in the pool
        per_block = server.cache.kvcompile.bytes_per_block
        assert m["blocks_free"] == m["blocks_total"] - math.ceil(m["kv_bytes_kept"] / per_block)
        second = complete(server, TURN1 + answer1 + TURN2)
        assert server.metrics()["requests_reused"] == 1
        assert second["text"] == answer2
        again = complete(server, TURN1 + answer1 + TURN2, stream=True)  # the same kept sequence, streamed
        assert again["text"] == answer2 and server.metrics()["requests_reused"] == 2
        m = settled(server, kept_sequences=2)  # turn 2's cache is kept too (one entry for both identical runs)
        assert m["kept_sequences"] == 2 and m["kv_bytes_outside"] == m["kv_bytes_kept"]
    assert answer2 != full  # compression before the question: the reuse is not a fresh prefill (and is tested)


def test_chat_continuation_with_seeded_sampling_continues_the_kept_cache(folder):
    """A chat client's second turn (the first turn, its answer as an assistant message, a new user message) starts
    with the kept tokens; sampled with a seed, it equals torch.manual_seed(seed) and generate() continuing turn 1's
    cache."""
    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    model = compiled(folder, policy)
    template = lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"]
    turn1 = [{"role": "user", "content": TURN1}]
    with serving(folder, policy, reuse_context=True) as server:
        url = f"http://127.0.0.1:{server.options.port}/v1/chat/completions"
        body = {"model": server.options.model_name, "max_tokens": NEW}
        reply = requests.post(url, json={**body, "messages": turn1, "temperature": 0}, timeout=TIMEOUT)
        answer1 = reply.json()["choices"][0]["message"]["content"]
        settled(server, kept_sequences=1)
        turn2 = turn1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": TURN2}]
        reply = requests.post(url, json={**body, "messages": turn2, "temperature": 0.8, "seed": 7}, timeout=TIMEOUT)
        answer2 = reply.json()["choices"][0]["message"]["content"]
        assert server.metrics()["requests_reused"] == 1
    with torch.no_grad():
        ids1 = torch.tensor([template(turn1)])
        first = model.generate(ids1, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
        assert tokenizer.decode(first.sequences[0, ids1.shape[1]:], skip_special_tokens=True) == answer1
        ids2 = torch.tensor([template(turn2)])
        assert torch.equal(ids2[:, :first.sequences.shape[1]], first.sequences)
        torch.manual_seed(7)
        out = model.generate(ids2, past_key_values=first.past_key_values, max_new_tokens=NEW, do_sample=True,
                             temperature=0.8)
    assert answer2 == tokenizer.decode(out[0, ids2.shape[1]:], skip_special_tokens=True)


def test_budget_covering_everything_equals_the_plain_model(folder):
    from transformers import AutoModelForCausalLM

    policy = kvcompile.load_spec("expected_attention", ratio=1.0)
    tokenizer = char_tokenizer()
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    answer1 = fresh(plain, tokenizer, TURN1)
    answer2 = fresh(plain, tokenizer, TURN1 + answer1 + TURN2)
    with serving(folder, policy, reuse_context=True) as server:
        assert complete(server, TURN1)["text"] == answer1
        settled(server, kept_sequences=1)
        assert complete(server, TURN1 + answer1 + TURN2)["text"] == answer2
        assert server.metrics()["requests_reused"] == 1


def test_without_reuse_the_whole_prompt_is_prefilled(folder):
    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    model = compiled(folder, policy)
    answer1 = fresh(model, tokenizer, TURN1)
    with serving(folder, policy) as server:
        assert complete(server, TURN1)["text"] == answer1
        assert complete(server, TURN1 + answer1 + TURN2)["text"] == fresh(model, tokenizer, TURN1 + answer1 + TURN2)
        m = server.metrics()
        assert m["kept_sequences"] == 0 and m["kv_bytes_outside"] == 0 and m["requests_reused"] == 0


def test_a_continuation_and_engine_requests_at_once(folder):
    """A continuing request runs beside the engine's requests on the same model: each gets its own tokens."""
    from concurrent.futures import ThreadPoolExecutor

    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    answer1, answer2 = two_turns(compiled(folder, policy), tokenizer, TURN1, TURN2)
    model = compiled(folder, policy)
    others = [TURN1.lower(), TURN2 * 3]
    with serving(folder, policy, reuse_context=True) as server:
        complete(server, TURN1)
        settled(server, kept_sequences=1)
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda text: complete(server, text)["text"], [TURN1 + answer1 + TURN2] + others))
        assert server.metrics()["requests_reused"] == 1
    assert replies == [answer2] + [fresh(model, tokenizer, text) for text in others]


def test_a_prompt_diverging_inside_a_kept_sequence_is_prefilled(folder):
    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    model = compiled(folder, policy)
    answer1 = fresh(model, tokenizer, TURN1)
    other = "Z" if answer1[-1] != "Z" else "Y"
    diverging = [TURN1[:-3] + "XY" + TURN2,  # inside the prompt
                 TURN1 + answer1[:-1] + other + TURN2,  # at the answer's last token
                 TURN1 + answer1[:3]]  # a prefix of the kept sequence (it holds more than the prompt)
    with serving(folder, policy, reuse_context=True) as server:
        complete(server, TURN1)
        settled(server, kept_sequences=1)
        for text in diverging:
            assert complete(server, text)["text"] == fresh(model, tokenizer, text)
        assert server.metrics()["requests_reused"] == 0


def test_kept_caches_are_bounded_least_recently_used_first(folder):
    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    model = compiled(folder, policy)
    with torch.no_grad():
        out = model.generate(ids(tokenizer, TURN1), max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    one = request_bytes(RequestKV(out.past_key_values, 0))
    other = TURN1.upper()
    with serving(folder, policy, reuse_context=True, reuse_context_bytes=one * 3 // 2) as server:
        answer_a = complete(server, TURN1)["text"]
        a = settled(server, kept_sequences=1)
        answer_b = complete(server, other)["text"]
        m = settled(server, kept_sequences=1)
        # the second dropped the first: one kept, and the pool holds only its blocks (the first's came back)
        assert m["kept_sequences"] == 1 and m["kv_bytes_kept"] <= one * 3 // 2
        assert m["kv_bytes_outside"] == m["kv_bytes_kept"]
        per_block = server.cache.kvcompile.bytes_per_block
        assert m["blocks_free"] == m["blocks_total"] - math.ceil(m["kv_bytes_kept"] / per_block)
        assert a["kv_bytes_kept"] > 0
        assert complete(server, TURN1 + answer_a + TURN2)["text"] == fresh(model, tokenizer,
                                                                           TURN1 + answer_a + TURN2)
        assert server.metrics()["requests_reused"] == 0  # A was dropped: a fresh prefill
        settled(server, kept_sequences=1)
        complete(server, other + answer_b + TURN2)  # B was dropped in turn by the request above: kept is its own
        assert server.metrics()["requests_reused"] == 0


def test_kept_sequences_match_the_longest_and_drop_the_oldest():
    kept = KeptSequences(max_bytes=25)
    a, ab, c = (KeptSequence(ids, None, n, key) for ids, n, key in (((1, 2), 10, "a"), ((1, 2, 3), 10, "ab"),
                                                                   ((4,), 10, "c")))
    assert kept.put(a) == [] and kept.put(ab) == []
    assert kept.match([1, 2, 3, 4]) is ab and kept.match([1, 2, 5]) is a and kept.match([1]) is None
    assert kept.match([2, 1, 2]) is None
    assert kept.put(c) == [ab]  # the least recently used (a was matched last)
    assert kept.put(KeptSequence((9,), None, 26, "big")) == [KeptSequence((9,), None, 26, "big")]
    assert len(kept) == 2 and kept.nbytes == 20


def test_a_kept_sequence_lent_to_a_continuation_stays_counted_until_given_back():
    """A continuation holds the kept cache it continues until it ends: that sequence is not the one dropped to make
    room, one replaced while lent is counted until its last give_back returns it for release, and a new sequence
    that cannot fit beside lent ones is not kept."""
    kept = KeptSequences(max_bytes=25)
    a, b = KeptSequence((1,), None, 10, "a"), KeptSequence((2,), None, 10, "b")
    assert kept.put(a) == [] and kept.put(b) == []
    assert kept.match([1, 5], lend=True) is a and kept.match([1, 6], lend=True) is a  # two continuations of a
    assert kept.match([2, 5]) is b  # b now the most recently used, a the least, but lent
    c = KeptSequence((3,), None, 10, "c")
    assert kept.put(c) == [b]  # a is lent: b goes instead
    assert kept.put(KeptSequence((4,), None, 10, "d")) == [c]
    assert kept.put(KeptSequence((5,), None, 20, "e")) == [KeptSequence((5,), None, 20, "e")]  # beside a: no room
    again = KeptSequence((1,), None, 12, "a2")
    assert kept.put(again) == [KeptSequence((4,), None, 10, "d")]  # a replaced while lent: a (10) + a2 (12) counted
    assert kept.nbytes == 22 and len(kept) == 1
    assert kept.give_back(a) == []  # the other continuation still uses it
    assert kept.give_back(a) == [a] and kept.nbytes == 12  # its last: released now
    with pytest.raises(RuntimeError, match="given back more often than lent"):
        kept.give_back(a)
    assert kept.match([1, 2], lend=True) is again and kept.clear() == [again] and kept.nbytes == 0


def test_a_continuation_gives_its_kept_sequence_back_when_it_ends(folder):
    """The server lends the kept sequence a request continues and gives it back when the request is settled: the
    kept sequences' bytes always equal the blocks held outside the engine, and nothing stays lent."""
    policy = kvcompile.load_spec("expected_attention", **EA)
    with serving(folder, policy, reuse_context=True) as server:
        answer = complete(server, TURN1)["text"]
        settled(server, kept_sequences=1)
        complete(server, TURN1 + answer + TURN2)
        m = settled(server, kept_sequences=2)
        assert m["requests_reused"] == 1 and m["kv_bytes_outside"] == m["kv_bytes_kept"]
        assert [e.lent for e in server.kept._entries.values()] == [0, 0]


def test_query_aware_policies_are_refused_at_start_up(folder):
    for spec in ("snapkv", "lava", "h2o"):
        with pytest.raises(ValueError, match="--reuse-context needs a query-agnostic policy"):
            KVCompileServer(ServeOptions(spec=spec, model=str(folder), reuse_context=True))
    with pytest.raises(ValueError, match="--reuse-context-bytes bounds the kept caches of --reuse-context"):
        KVCompileServer(ServeOptions(spec="knorm", model=str(folder), reuse_context_bytes=1000))
    assert all(kvcompile.load_spec(s).scoring.query_agnostic for s in ("expected_attention", "knorm", "streamingllm"))
    with pytest.raises(ValueError, match="is not less than the KV pool"):
        KVCompileServer(ServeOptions(spec="knorm", model=str(folder), kv_tokens=256, reuse_context=True,
                                     reuse_context_bytes=10 ** 12, log_level="error", log_requests=False))


def test_the_command_line_names_both_flags_and_refuses_a_query_aware_spec(folder, capsys):
    from kvcompile.tools import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--reuse-context" in help_text and "--reuse-context-bytes" in help_text
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--spec", "snapkv", "--model", str(folder), "--reuse-context"])
    assert exc.value.code == 2 and "--reuse-context needs a query-agnostic policy" in capsys.readouterr().err


# --- a continued request is a request of the engine (kvcompile.integrations.batching) ---------------------------

def post(server, body: dict) -> dict:
    """A non-streamed completion; its whole reply (the id is the engine's request id)."""
    body = {"model": server.options.model_name, "temperature": 0, **body}
    reply = requests.post(f"http://127.0.0.1:{server.options.port}/v1/completions", json=body, timeout=TIMEOUT)
    return reply.json() | {"status": reply.status_code}


def first_turn(server, policy, folder):
    """Turn 1 served and kept; the answer and turn 2's text."""
    tokenizer = char_tokenizer()
    answer1 = fresh(compiled(folder, policy), tokenizer, TURN1)
    assert complete(server, TURN1)["text"] == answer1
    settled(server, kept_sequences=1)
    return TURN1 + answer1 + TURN2


def test_a_continued_and_a_fresh_request_decode_in_one_batched_step(folder, monkeypatch):
    """A continued request sent while a fresh one decodes: their decode steps run as one batch (one paged
    attention call per layer for both), and each gets its own tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcompile.engine.batch import DecodeBatch

    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    answer1, answer2 = two_turns(compiled(folder, policy), tokenizer, TURN1, TURN2)
    steps = []
    run = DecodeBatch.run
    with serving(folder, policy, reuse_context=True) as server:
        backend = type(server.cache.kvcompile.plan.decode_attention)
        calls = []
        call = backend.run
        monkeypatch.setattr(backend, "run", lambda self, q, *a: calls.append(q.shape[0]) or call(self, q, *a))

        def recorded(self, layer, *args):
            names = {id(kv.cache): rid for rid, kv in server.cache.kvcompile.requests.items()}
            before = len(calls)
            out = run(self, layer, *args)
            steps.append((frozenset(names[id(c)] for c in self.caches), calls[before:]))
            return out

        monkeypatch.setattr(DecodeBatch, "run", recorded)
        assert complete(server, TURN1)["text"] == answer1
        settled(server, kept_sequences=1)
        url = f"http://127.0.0.1:{server.options.port}/v1/completions"
        body = {"model": server.options.model_name, "temperature": 0, "stream": True, "max_tokens": 40,
                "prompt": TURN2 * 2}
        with requests.post(url, json=body, timeout=TIMEOUT, stream=True) as long_reply, ThreadPoolExecutor(1) as pool:
            lines = long_reply.iter_lines()
            first = next(line for line in lines if line.startswith(b"data: "))  # the fresh request decodes
            continued = pool.submit(post, server, {"prompt": TURN1 + answer1 + TURN2, "max_tokens": NEW}).result()
            rest = [line for line in lines if line.startswith(b"data: ")]
        assert continued["choices"][0]["text"] == answer2 and server.metrics()["requests_reused"] == 1
    import json

    fresh_id = json.loads(first[6:])["id"]
    assert rest[-1] == b"data: [DONE]"
    layers = server.cache.kvcompile.plan.num_layers
    together = [made for names, made in steps if names == {continued["id"], fresh_id}]
    assert len(together) >= layers * (NEW - 2)  # every decode step of the continued request after its first
    assert all(made == [2] for made in together) and all(made == [len(names)] for names, made in steps)


def test_the_pools_hold_what_the_memory_report_counts_while_a_continuation_runs(folder, monkeypatch):
    """After every forward while a continued request runs: it holds pages of the engine's pools, the requests'
    bytes are their pool pages and tables, the pages taken are those their block tables name, and the blocks
    each holds cover its bytes; the kept caches alone are held outside the engine."""
    from kvcompile.integrations.batching import KVCompilePagedCache
    from kvcompile.store.pool import PooledStore

    policy = kvcompile.load_spec("expected_attention", **EA)
    seen = []
    sync = KVCompilePagedCache.sync_blocks

    def checked(self):
        sync(self)
        state = self.kvcompile
        report = self.memory_report()
        pooled = {rid: kv for rid, kv in state.requests.items()
                  if all(isinstance(s, PooledStore) for s in kv.cache.stores)}
        own = sum(s.own_tensors_bytes for kv in pooled.values() for s in kv.cache.stores)
        named = 0
        for layer, pool in enumerate(state.pages.pools.layers):
            pages = set()
            for kv in pooled.values():
                s = kv.cache.stores[layer]
                pages |= set(s.block_table[torch.arange(s.block_table.shape[-1]) < s.owned[..., None]].tolist())
            named += len(pages) * (0 if pool is None else pool.page_bytes)
        held = sum(r["bytes"] for rid, r in report["requests"].items() if rid in pooled)
        taken = report["decode"]["pool"]["bytes_taken"]
        blocks = all(r["blocks"] == math.ceil(r["bytes"] / report["bytes_per_block"]) for r in report["requests"].values())
        seen.append((set(pooled), held, taken + own, taken, named, blocks, self.outside_bytes()))

    monkeypatch.setattr(KVCompilePagedCache, "sync_blocks", checked)
    with serving(folder, policy, reuse_context=True) as server:
        turn2 = first_turn(server, policy, folder)
        kept = server.metrics()["kv_bytes_kept"]
        reply = post(server, {"prompt": turn2, "max_tokens": NEW})
        assert reply["status"] == 200 and server.metrics()["requests_reused"] == 1
    running = [s for s in seen if reply["id"] in s[0]]
    assert len(running) >= NEW - 1  # its forwards, in the pools from the first
    for _, held, counted, taken, named, blocks, outside in seen:
        assert held == counted and taken == named and blocks
    assert all(outside == kept for *_, outside in running)  # the continuation's bytes are the engine's


def test_every_page_comes_back_after_a_continuation_finishes_is_cut_or_fails(folder, monkeypatch):
    """A continued request that ends by itself (kept in turn), one cut at a stop string, one whose sampling fails
    (a 500 for it alone, the fresh request beside it answered): each held pool pages while it ran, and after it
    every pool page is free and the blocks free are the pool's less the kept caches'."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcompile.integrations.batching import RequestSampling
    from kvcompile.store.pool import PooledStore

    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    model = compiled(folder, policy)
    pooled = set()  # (request id, prompt tokens) of the requests holding pool pages when one picks a token
    pick = RequestSampling.pick
    failing = False

    def picked(self, history, raw):
        for rid, kv in server.cache.kvcompile.requests.items():  # on the engine thread
            if all(isinstance(s, PooledStore) for s in kv.cache.stores):
                pooled.add((rid, kv.prompt_length))
        if failing and history.shape[1] > len(turn2) + 2:  # the continued request, after two tokens
            raise RuntimeError("this request's sampling failed")
        return pick(self, history, raw)

    monkeypatch.setattr(RequestSampling, "pick", picked)

    def all_back(server, kept_sequences):
        end = time.monotonic() + 10
        while server.cache.kvcompile.requests and time.monotonic() < end:  # a cancelled request leaves at the
            time.sleep(0.05)  # engine's next step
        m = settled(server, kept_sequences=kept_sequences)
        pool = server.cache.memory_report()["decode"]["pool"]
        per_block = server.cache.kvcompile.bytes_per_block
        kept = sum(math.ceil(n / per_block) for n in server.cache.kvcompile.outside.values())  # each its own
        return (pool["free_pages"] == pool["pages"] > 0 and server.cache.kvcompile.requests == {} and
                m["blocks_free"] == m["blocks_total"] - kept and m["kv_bytes_outside"] == m["kv_bytes_kept"])

    with serving(folder, policy, reuse_context=True) as server:
        turn2 = first_turn(server, policy, folder)
        done = post(server, {"prompt": turn2, "max_tokens": NEW})
        assert done["status"] == 200 and (done["id"], len(turn2)) in pooled and all_back(server, kept_sequences=2)
        text = done["choices"][0]["text"]
        cut = post(server, {"prompt": turn2, "max_tokens": NEW, "stop": text[2:4]})
        assert cut["choices"][0]["finish_reason"] == "stop" and (cut["id"], len(turn2)) in pooled
        assert all_back(server, kept_sequences=2)
        failing = True
        pooled.clear()
        with ThreadPoolExecutor(2) as threads:
            failed, other = threads.map(lambda p: post(server, {"prompt": p, "max_tokens": NEW}), [turn2, TURN2])
        assert failed["status"] == 500 and "this request's sampling failed" in failed["error"]["message"]
        assert len(turn2) in {length for _, length in pooled}
        assert other["status"] == 200 and other["choices"][0]["text"] == fresh(model, tokenizer, TURN2)
        assert all_back(server, kept_sequences=2) and server.metrics()["requests_reused"] == 3


def test_a_request_leaves_the_engine_only_with_its_pages_and_blocks_given_back(folder):
    """A request (fresh and kept, continued and kept, continued and cut at a stop string: cancelled) is gone from the
    cache's live requests only once its pool pages and its blocks are back: a thread that finds it gone (the
    server's metrics, a caller waiting for a cancelled request to leave) never reads them still held."""
    policy = kvcompile.load_spec("expected_attention", **EA)
    seen = []  # (request id, every pool page free, its blocks still in the block table) when it left

    with serving(folder, policy, reuse_context=True) as server:
        state, cache = server.cache.kvcompile, server.cache

        class Watched(dict):  # the cache's live requests, noting the pool when one leaves (on the engine thread)
            def _left(self, rid):
                pool = cache.memory_report()["decode"]["pool"]
                seen.append((rid, pool["free_pages"] == pool["pages"] > 0, rid in cache.allocator.block_table))

            def pop(self, rid, *default):
                if rid in self:
                    self._left(rid)
                return super().pop(rid, *default)

            def __delitem__(self, rid):
                self._left(rid)
                super().__delitem__(rid)

        state.requests = Watched(state.requests)
        turn2 = first_turn(server, policy, folder)
        done = post(server, {"prompt": turn2, "max_tokens": NEW})
        cut = post(server, {"prompt": turn2, "max_tokens": NEW, "stop": done["choices"][0]["text"][2:4]})
        assert cut["choices"][0]["finish_reason"] == "stop"
        end = time.monotonic() + TIMEOUT
        while cut["id"] not in {rid for rid, *_ in seen} and time.monotonic() < end:  # it leaves at the engine's
            time.sleep(0.05)  # next step
    assert {done["id"], cut["id"]} <= {rid for rid, *_ in seen} and len(seen) >= 3
    assert all(free and not blocks for _, free, blocks in seen), seen


def test_tokens_equal_generate_from_a_copy_of_the_kept_cache_and_usage_is_the_engines(folder):
    """The continued request's tokens and log-probabilities are `generate(prompt, past_key_values=<a copy of the
    kept cache>)`'s on the compiled model, and its usage is recorded by the engine, as every request's."""
    import copy

    policy = kvcompile.load_spec("expected_attention", **EA)
    tokenizer = char_tokenizer()
    model = compiled(folder, policy)
    new = 12
    with serving(folder, policy, reuse_context=True) as server:
        turn2 = first_turn(server, policy, folder)
        prompt = ids(tokenizer, turn2)
        entry = server.kept.match(prompt[0].tolist())
        assert entry is not None
        cache = copy.deepcopy(entry.cache)
        reply = post(server, {"prompt": turn2, "max_tokens": new, "logprobs": 0})
        usage = [u for u in server.cache.memory_report()["finished"] if u.request_id == reply["id"]]
    with torch.no_grad():
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, prompt.shape[1]:]
    assert reply["choices"][0]["text"] == tokenizer.decode(tokens)
    want = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])[torch.arange(len(tokens)),
                                                                                        tokens]
    torch.testing.assert_close(torch.tensor(reply["choices"][0]["logprobs"]["token_logprobs"]), want, rtol=1e-4,
                               atol=1e-4)
    assert len(usage) == 1 and usage[0].tokens == prompt.shape[1] + new - 1 and usage[0].bytes > 0
