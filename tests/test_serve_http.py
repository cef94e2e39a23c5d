"""`kvcompile serve` end to end: transformers' OpenAI-compatible server over a compiled tiny model,
started here on 127.0.0.1, asked with an HTTP client (a bounded number of requests, each with a time
limit), stopped here. Completions and chat completions, streamed and not, one request and several at
once: the text is what `model.generate` with the same spec gives for the same tokens (greedy).
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
from kvcompile.server import KVCompileServer, ServeOptions  # noqa: E402
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Llama with the character tokenizer saved to a folder, served with snapkv (16 per head) in a pool
    of 4096 tokens of full cache (a request of 1024 new tokens grows past 1024: snapkv evicts nothing while
    decoding)."""
    folder = tmp_path_factory.mktemp("tiny-served")
    tokenizer = char_tokenizer()
    model = tiny_model()
    model.resize_token_embeddings(len(tokenizer))
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    # the server refuses prompt + max_tokens past the context: room for transformers serve's default of 1024
    model.config.max_position_embeddings = 2048
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    policy = kvcompile.load_spec("snapkv", **SPEC)
    server = KVCompileServer(ServeOptions(spec=policy, model=str(folder), port=free_port(), kv_tokens=4096,
                                          max_batch_tokens=128, log_level="error", log_requests=False))
    from transformers import AutoModelForCausalLM

    reference = kvcompile.compile(AutoModelForCausalLM.from_pretrained(folder).eval(), policy)
    server.start()
    try:
        server.wait_started(timeout=60)
        yield server, tokenizer, folder, reference
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
