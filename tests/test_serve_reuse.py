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
