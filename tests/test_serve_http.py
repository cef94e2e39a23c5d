"""`kvcompile serve` end to end: kvcompile's OpenAI layer over the continuous-batching engine on a compiled
tiny model, started here in this process on a thread on 127.0.0.1, asked with an HTTP client (a bounded
number of requests, each with a time limit), stopped here. Completions and chat completions, streamed and
not, one request and several at once: the text is what `model.generate` with the same spec gives for the
same tokens (greedy, or sampled with the request's seed). Every invalid request is refused by name in
OpenAI's error shape, every accepted parameter is honoured, an engine failure fails its request alone.
"""
import json
import socket
import string
import threading

import pytest
import torch

pytest.importorskip("fastapi", reason="kvcompile serve needs transformers[serving]: pip install fastapi uvicorn openai")
pytest.importorskip("uvicorn", reason="kvcompile serve needs transformers[serving]")
pytest.importorskip("openai", reason="kvcompile serve needs transformers[serving]")
requests = pytest.importorskip("requests")

import kvcompile  # noqa: E402
from kvcompile.integrations.server import KVCompileServer, ServeOptions  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

TIMEOUT = 60  # seconds, per HTTP request
MAX_TOKENS = 6
SPEC = dict(per_head=16, ranking={"by_score": {"window": 4}}, scoring={"window_attention": {"window": 4}})
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer():
    """One token per printable ASCII character (no download): every generated token decodes to text."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    specials = ["<pad>", "<|im_end|>", "<|im_start|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   unk_token="<unk>", chat_template=TEMPLATE)


def save_char_model(folder, max_positions: int | None = None):
    """A tiny Llama with the character tokenizer (its special ids as the model's), saved to `folder`."""
    tokenizer = char_tokenizer()
    model = tiny_model()
    model.resize_token_embeddings(len(tokenizer))
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    if max_positions is not None:
        model.config.max_position_embeddings = max_positions
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Llama with the character tokenizer saved to a folder, served with snapkv (16 per head) in a pool
    of 4096 tokens of full cache (a request of 1024 new tokens grows past 1024: snapkv evicts nothing while
    decoding)."""
    # the server refuses prompt + max_tokens past the context: room for transformers serve's default of 1024
    folder = save_char_model(tmp_path_factory.mktemp("tiny-served"), max_positions=2048)
    policy = kvcompile.load_spec("snapkv", **SPEC)
    server = KVCompileServer(ServeOptions(spec=policy, model=str(folder), port=free_port(), kv_tokens=4096,
                                          max_batch_tokens=128, log_level="error", log_requests=False))
    from transformers import AutoModelForCausalLM

    reference = kvcompile.compile(AutoModelForCausalLM.from_pretrained(folder).eval(), policy)
    server.start()
    try:
        server.wait_started(timeout=60)
        yield server, char_tokenizer(), folder, reference
    finally:
        server.stop()
    assert not server.running


def url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.options.port}{path}"


def expected(model, tokenizer, ids: list[int]) -> str:
    """The greedy continuation through generate() on a compiled model."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def post(server, path: str, body: dict) -> dict:
    reply = requests.post(url(server, path), json=body, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with requests.post(url(server, path), json={**body, "stream": True}, timeout=TIMEOUT, stream=True) as reply:
        assert reply.status_code == 200, reply.text
        for line in reply.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    return chunks


def completion_body(folder, prompt_text: str) -> dict:
    return {"model": str(folder), "prompt": prompt_text, "max_tokens": MAX_TOKENS, "temperature": 0}


def chat_body(folder, text: str) -> dict:
    return {"model": str(folder), "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
            "temperature": 0}


PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def test_server_runs_the_compiled_model(served):
    server, tokenizer, folder, reference = served
    assert server.model.kvcompile_policy.name == "snapkv"
    assert requests.get(url(server, "/health"), timeout=TIMEOUT).json() == {"status": "ok"}
    # generate() on the served model, the engine started, gives the same as on another copy
    post(server, "/v1/completions", completion_body(folder, PROMPT))
    ids = tokenizer(PROMPT)["input_ids"]
    assert expected(server.model, tokenizer, ids) == expected(reference, tokenizer, ids)


def test_completion_equals_generate(served):
    server, tokenizer, folder, reference = served
    reply = post(server, "/v1/completions", completion_body(folder, PROMPT))
    assert reply["choices"][0]["text"] == expected(reference, tokenizer, tokenizer(PROMPT)["input_ids"])


def test_streamed_completion_equals_generate(served):
    server, tokenizer, folder, reference = served
    chunks = stream(server, "/v1/completions", completion_body(folder, PROMPT))
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    assert text == expected(reference, tokenizer, tokenizer(PROMPT)["input_ids"])


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def test_chat_streamed_and_not_equals_generate(served):
    server, tokenizer, folder, reference = served
    want = expected(reference, tokenizer, chat_ids(tokenizer, PROMPT))
    reply = post(server, "/v1/chat/completions", chat_body(folder, PROMPT))
    assert reply["choices"][0]["message"]["content"] == want
    chunks = stream(server, "/v1/chat/completions", chat_body(folder, PROMPT))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == want


def test_concurrent_requests_give_their_sequential_results(served):
    server, tokenizer, folder, reference = served
    texts = [f"Request {i}: " + "lorem ipsum dolor sit amet " * (2 + i) for i in range(3)]
    replies: dict[int, dict] = {}

    def ask(i):
        replies[i] = post(server, "/v1/completions", completion_body(folder, texts[i]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * TIMEOUT)
    assert sorted(replies) == [0, 1, 2]
    for i, text in enumerate(texts):
        assert replies[i]["choices"][0]["text"] == expected(reference, tokenizer, tokenizer(text)["input_ids"])


def test_without_max_tokens_a_request_gets_transformers_default(served):
    """No max_tokens: transformers serve's default of 1024 new tokens (the served model's generation config
    asks fewer), through kvcompile's engine as through generate()."""
    server, tokenizer, folder, reference = served
    assert (server.model.generation_config.max_new_tokens or 0) < 1024
    body = completion_body(folder, "Hello")
    del body["max_tokens"]
    reply = post(server, "/v1/completions", body)
    ids = tokenizer("Hello")["input_ids"]
    out = reference.generate(torch.tensor([ids]), max_new_tokens=1024, do_sample=False)[0, len(ids):]
    assert len(out) == 1024 and reply["usage"]["completion_tokens"] == 1024  # no end-of-sequence before
    assert reply["choices"][0]["text"] == tokenizer.decode(out, skip_special_tokens=True)


def test_a_policy_the_engine_cannot_run_is_refused_before_listening(served):
    server, tokenizer, folder, reference = served
    from kvcompile.errors import CompileError

    policy = kvcompile.load_spec("snapkv", **SPEC, schedule={"cascade": False, "decode": {"every": {"n": 4}}})
    with pytest.raises(CompileError, match="prunes every 4"):
        KVCompileServer(ServeOptions(spec=policy, model=str(folder), port=free_port(), log_level="error",
                                     log_requests=False))


# --- issue 25: nothing a client sends stops the server; every parameter honoured or refused by name ---------

def error_of(reply, status: int) -> dict:
    """The OpenAI error of a refused request, checked for its status and shape."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_models_lists_the_served_model_offline_and_an_unknown_model_is_404(served):
    server, tokenizer, folder, reference = served
    listed = requests.get(url(server, "/v1/models"), timeout=TIMEOUT).json()
    # the folder's name, not the path it was given as; the path as given is accepted too
    assert [m["id"] for m in listed["data"]] == [folder.name] and listed["object"] == "list"
    assert "/" not in folder.name
    for name in (folder.name, str(folder)):
        reply = post(server, "/v1/completions", {**completion_body(folder, PROMPT), "model": name})
        assert reply["model"] == folder.name
    assert requests.get(url(server, f"/v1/models/{folder.name}"), timeout=TIMEOUT).json()["id"] == folder.name
    for reply in (requests.post(url(server, "/v1/completions"), json={**completion_body(folder, PROMPT),
                                                                      "model": "gpt-4o"}, timeout=TIMEOUT),
                  requests.get(url(server, "/v1/models/gpt-4o"), timeout=TIMEOUT)):
        error = error_of(reply, 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"


LONG = "abcdefghij" * 210  # 2100 tokens: past the served model's 2048-token context


@pytest.mark.parametrize("path,change,param", [
    ("/v1/chat/completions", {"messages": None}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"max_tokens": 2000}, "max_tokens"),
    ("/v1/completions", {"max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"temperature": 3}, "temperature"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"seed": 1.5}, "seed"),
    # issue 39: values that gave a 500 (or failed every request of the engine step) are the request's own 400
    ("/v1/completions", {"temperature": 1e-300}, "temperature"),
    ("/v1/chat/completions", {"temperature": 0.001}, "temperature"),
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"seed": 2**70}, "seed"),
    ("/v1/chat/completions", {"seed": -2**70}, "seed"),
    ("/v1/completions", {"prompt": "\ud800abc"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800abc"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]},
     "messages.0.content.0.text"),
    ("/v1/completions", {"stop": "\ud800"}, "stop"),
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"n": 2}, "n"),
    ("/v1/completions", {"logprobs": 9}, "logprobs"),
    ("/v1/completions", {"logprobs": 1, "stream": True}, "logprobs"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_an_invalid_request_is_refused_by_name_in_openai_shape(served, path, change, param):
    server, tokenizer, folder, reference = served
    body = chat_body(folder, PROMPT) if path.endswith("chat/completions") else completion_body(folder, PROMPT)
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    error = error_of(requests.post(url(server, path), json=body, timeout=TIMEOUT), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert requests.get(url(server, "/health"), timeout=TIMEOUT).status_code == 200


def test_a_body_that_is_not_json_is_refused(served):
    server = served[0]
    reply = requests.post(url(server, "/v1/completions"), data="{not json", timeout=TIMEOUT,
                          headers={"content-type": "application/json"})
    assert error_of(reply, 400)["code"] == "invalid_json"


def sampled(model, ids: list[int], new: int, seed: int, **settings) -> list[int]:
    """generate()'s sampled tokens with torch seeded as the request's `seed` seeds its own generator."""
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=True, **settings)
    return out[0, len(ids):].tolist()


def test_each_request_samples_with_its_own_settings_and_seed(served):
    """temperature, top_p and seed per request, two at once with other settings: each gets generate()'s tokens
    for its settings (the engine draws from the request's own generator; greedy ones take argmax)."""
    server, tokenizer, folder, reference = served
    new = 12
    ids = tokenizer(PROMPT)["input_ids"]
    cases = [dict(temperature=1.2, seed=7), dict(temperature=0.8, top_p=0.9, seed=11), dict(temperature=0)]
    replies: dict[int, dict] = {}

    def ask(i):
        replies[i] = post(server, "/v1/completions", {**completion_body(folder, PROMPT), "max_tokens": new,
                                                      **cases[i]})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * TIMEOUT)
    greedy = reference.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):].tolist()
    for i, case in enumerate(cases):
        text = replies[i]["choices"][0]["text"]
        if case["temperature"] == 0:
            assert text == tokenizer.decode(greedy, skip_special_tokens=True)
            continue
        settings = {k: v for k, v in case.items() if k != "seed"}
        want = sampled(reference, ids, new, case["seed"], **settings)
        assert text == tokenizer.decode(want, skip_special_tokens=True)
        assert want != greedy  # it really sampled
    # the same seed again gives the same text, chat too
    chat = {**chat_body(folder, PROMPT), "max_tokens": new, "temperature": 1.2, "seed": 7}
    first = post(server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    want = sampled(reference, chat_ids(tokenizer, PROMPT), new, 7, temperature=1.2)
    assert first == tokenizer.decode(want, skip_special_tokens=True)
    assert post(server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"] == first


def test_stop_strings_end_the_answer_streamed_or_not(served):
    server, tokenizer, folder, reference = served
    ids = tokenizer(PROMPT)["input_ids"]
    full = tokenizer.decode(reference.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):],
                            skip_special_tokens=True)
    stop = full[8:10]
    want = full[:full.find(stop)]
    body = {**completion_body(folder, PROMPT), "max_tokens": 30, "stop": [stop, "\x00never"]}
    reply = post(server, "/v1/completions", body)
    assert reply["choices"][0]["text"] == want and reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] < 30
    chunks = stream(server, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_are_the_models(served):
    """logprobs: each sampled token's log-probability under the model (log-softmax of its raw logits, as
    generate() returns them with output_logits) and its most likely alternatives."""
    server, tokenizer, folder, reference = served
    ids = tokenizer(PROMPT)["input_ids"]
    out = reference.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    logs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
    tokens = out.sequences[0, len(ids):]
    want = logs[torch.arange(len(tokens)), tokens]
    reply = post(server, "/v1/completions", {**completion_body(folder, PROMPT), "logprobs": 2})
    got = reply["choices"][0]["logprobs"]
    torch.testing.assert_close(torch.tensor(got["token_logprobs"]), want, rtol=1e-4, atol=1e-4)
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-4)  # greedy: the top one
               for top, lp in zip(got["top_logprobs"], got["token_logprobs"]))
    chat = post(server, "/v1/chat/completions", {**chat_body(folder, PROMPT), "logprobs": True, "top_logprobs": 3})
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 3 for c in content)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_include_usage(served, path):
    server, tokenizer, folder, reference = served
    body = chat_body(folder, PROMPT) if "chat" in path else completion_body(folder, PROMPT)
    plain = stream(server, path, body)
    assert all("usage" not in c for c in plain)
    chunks = stream(server, path, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_an_engine_failure_fails_that_request_alone(served, monkeypatch):
    """A forward that raises (injected here for one prompt) fails its request with a 500 in OpenAI's shape; the
    engine goes on: the next request is answered exactly, every block is back in the pool."""
    server, tokenizer, folder, reference = served
    from kvcompile.integrations.batching import KVCompileModelRunner

    poison = tokenizer("FAIL")["input_ids"]
    forward = KVCompileModelRunner._forward_process_and_sample

    def failing(self, model, *args, **kwargs):
        if any(r.initial_tokens[:len(poison)] == poison for r in self.cache.kvcompile.rows):
            raise RuntimeError("injected failure")
        return forward(self, model, *args, **kwargs)

    monkeypatch.setattr(KVCompileModelRunner, "_forward_process_and_sample", failing)
    reply = requests.post(url(server, "/v1/completions"), json=completion_body(folder, "FAIL now"), timeout=TIMEOUT)
    error = error_of(reply, 500)
    assert "injected failure" in error["message"] and error["type"] == "server_error"
    reply = post(server, "/v1/completions", completion_body(folder, PROMPT))
    assert reply["choices"][0]["text"] == expected(reference, tokenizer, tokenizer(PROMPT)["input_ids"])
    assert requests.get(url(server, "/health"), timeout=TIMEOUT).json() == {"status": "ok"}
    metrics = server.metrics()
    assert metrics["failed_engine_steps"] >= 1 and metrics["blocks_free"] == metrics["blocks_total"]


def test_metrics_and_one_log_line_per_request(served, caplog):
    server, tokenizer, folder, reference = served
    with caplog.at_level("INFO", logger="kvcompile.serve"):
        reply = post(server, "/v1/completions", completion_body(folder, PROMPT))
        requests.post(url(server, "/v1/completions"), json={**completion_body(folder, PROMPT), "n": 2}, timeout=TIMEOUT)
    refused = [r.getMessage() for r in caplog.records if " 400 refused" in r.getMessage()]
    assert len(refused) == 1 and refused[0].startswith("cmpl-") and "`n`" in refused[0]
    lines = [r.getMessage() for r in caplog.records if reply["id"] in r.getMessage()]
    assert len(lines) == 1
    assert " 200 ok " in lines[0] and f"prompt_tokens={reply['usage']['prompt_tokens']}" in lines[0]
    assert f"completion_tokens={MAX_TOKENS}" in lines[0] and "ttft=" in lines[0] and "kv_held=" in lines[0]
    assert "kv_held=-" not in lines[0]
    text = requests.get(url(server, "/metrics"), timeout=TIMEOUT).text
    for name in ("kvcompile_requests_running", "kvcompile_requests_waiting", "kvcompile_kv_bytes_held",
                 "kvcompile_kv_bytes_full", "kvcompile_blocks_free", "kvcompile_soft_resets_total"):
        assert f"\n{name} " in text
    assert 'kvcompile_requests_total{outcome="ok"}' in text


def test_serve_help_says_which_model_name_requests_use():
    from kvcompile.tools.cli import build_parser

    parser = build_parser()
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve_parser.format_help().split())
    assert "--served-model-name" in text and "Requests name the model" in text


def test_the_openai_client_lists_the_model_and_reads_our_errors(served):
    import openai

    server, tokenizer, folder, reference = served
    client = openai.OpenAI(base_url=url(server, "/v1"), api_key="-", timeout=TIMEOUT, max_retries=0)
    name = client.models.list().data[0].id
    reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].text == expected(reference, tokenizer, tokenizer(PROMPT)["input_ids"])
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=-5)
    assert refused.value.param == "max_tokens" and "max_tokens" in str(refused.value)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert missing.value.code == "model_not_found"


# --- issue 39: a request's failure is its own -------------------------------------------------------------------

def test_a_sampling_value_that_cannot_sample_fails_only_its_request(served, monkeypatch):
    """Beside an open greedy stream: `temperature: 1e-300` (whose probabilities are inf and nan) is refused at
    validation with the valid range; a request whose own sampling still cannot pick a token in the engine
    (injected: its temperature warper set to 1e-300 past validation) gets its own 500, while the stream and a
    greedy request answered in the same forwards get exactly generate()'s text and no engine step fails."""
    server, tokenizer, folder, reference = served
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper

    sampling = server._sampling

    def poisoned(request):
        picked = sampling(request)
        if request.seed == 4242:
            picked.processors = LogitsProcessorList([TemperatureLogitsWarper(1e-300)])
        return picked

    monkeypatch.setattr(server, "_sampling", poisoned)
    failed_steps = server.metrics()["failed_engine_steps"]
    new = 400
    body = {**completion_body(folder, PROMPT), "max_tokens": new, "stream": True}
    with requests.post(url(server, "/v1/completions"), json=body, timeout=TIMEOUT, stream=True) as reply:
        assert reply.status_code == 200, reply.text
        lines = reply.iter_lines(decode_unicode=True)
        first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
        bad = requests.post(url(server, "/v1/completions"), json={**completion_body(folder, "Hello"),
                                                                  "temperature": 1e-300}, timeout=TIMEOUT)
        error = error_of(bad, 400)
        assert error["param"] == "temperature" and "0.01" in error["message"] and "2" in error["message"]
        own = requests.post(url(server, "/v1/completions"), json={**completion_body(folder, "Hello"),
                                                                  "temperature": 1.0, "seed": 4242}, timeout=TIMEOUT)
        error = error_of(own, 500)
        assert error["code"] == "engine_error" and "probability" in error["message"]
        greedy = post(server, "/v1/completions", completion_body(folder, "Hello"))
        # the stream was decoding all along: it shared its forwards with the two requests above
        assert first["id"] in server.manager.batch_processor.scheduler.active_requests
        chunks = [first]
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]
    ids = tokenizer(PROMPT)["input_ids"]
    want = reference.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):]
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(want, skip_special_tokens=True)
    assert greedy["choices"][0]["text"] == expected(reference, tokenizer, tokenizer("Hello")["input_ids"])
    metrics = server.metrics()
    assert metrics["failed_engine_steps"] == failed_steps
    assert metrics["blocks_free"] == metrics["blocks_total"] and not server.cache.kvcompile.sampling


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_past_the_context_by_size_is_refused_before_it_is_tokenized(served, monkeypatch, path):
    """A prompt with more characters than the context's tokens can hold (the context times the vocabulary's
    longest token) is refused with 400 context_length_exceeded without tokenizing it: a multi-megabyte prompt
    costs no tokenizer time."""
    server, tokenizer, folder, reference = served
    calls = []
    tokenize = server._prompt_ids
    monkeypatch.setattr(server, "_prompt_ids", lambda *args: calls.append(args) or tokenize(*args))
    chat = "chat" in path
    param = "messages" if chat else "prompt"
    assert server.max_prompt_chars == server.context * max(len(t) for t in tokenizer.get_vocab())
    for chars in (server.max_prompt_chars + 1, 4 * 2**20):
        text = ("abcdefghij" * (chars // 10 + 1))[:chars]
        body = chat_body(folder, text) if chat else completion_body(folder, text)
        error = error_of(requests.post(url(server, path), json=body, timeout=TIMEOUT), 400)
        assert error["param"] == param and error["code"] == "context_length_exceeded"
        assert f"{chars} characters" in error["message"]
    assert not calls
    post(server, path, chat_body(folder, PROMPT) if chat else completion_body(folder, PROMPT))  # tokenized
    assert len(calls) == 1


def test_health_answers_while_a_prompt_is_tokenized(served, monkeypatch):
    """Tokenizing is off the event loop: while one request's prompt is being tokenized (held here until /health
    has answered, at most 30 s), /health is answered."""
    server, tokenizer, folder, reference = served
    entered, release = threading.Event(), threading.Event()
    tokenize = server._prompt_ids

    def slow(request, chat):
        if not chat and request.prompt.startswith("SLOW"):
            entered.set()
            release.wait(timeout=30)
        return tokenize(request, chat)

    monkeypatch.setattr(server, "_prompt_ids", slow)
    replies = {}
    asking = threading.Thread(target=lambda: replies.update(
        slow=requests.post(url(server, "/v1/completions"), json=completion_body(folder, "SLOW " + PROMPT),
                           timeout=TIMEOUT)))
    asking.start()
    try:
        assert entered.wait(timeout=30)
        assert requests.get(url(server, "/health"), timeout=10).json() == {"status": "ok"}
        assert not release.is_set() and asking.is_alive()  # the slow prompt was still being tokenized
    finally:
        release.set()
        asking.join(timeout=2 * TIMEOUT)
    assert replies["slow"].status_code == 200, replies["slow"].text
    want = expected(reference, tokenizer, tokenizer("SLOW " + PROMPT)["input_ids"])
    assert replies["slow"].json()["choices"][0]["text"] == want
