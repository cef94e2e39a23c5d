"""Soak of `kvcompile serve` (issue 25): many concurrent clients send a random mix of requests for a while;
at the end every valid answer must equal `generate()` for its request, every invalid one must have got its
4xx, the server must still answer, every block must be back in the pool and memory must not have grown.

The mix (weights in MIX): completions and chat completions, greedy or sampled with a seed, with stop strings,
streamed or not; invalid bodies (each refused with 400 naming its field); streams the client drops after two
chunks; prompts the KV pool can never hold (400 `kv_pool_exceeded`) and prompts past the model's context
(400 `context_length_exceeded`); pathological values (PATHOLOGICAL: a temperature whose probabilities are not
finite, seeds beyond int64, lone UTF-16 surrogates, a 4 MiB prompt: each its own 400; a valid top_p of 1e-300,
answered as generate() answers it) beside the others, which they must not harm. The server runs in this process, on a thread, on 127.0.0.1.

    python3 benchmarks/soak.py [--minutes 30] [--clients 4] [--spec snapkv] [--per-head 64]
        [--kv-tokens 4096] [--max-batch-tokens 512] [--max-tokens 32] [--check 200] [--threads 2] [--timeout 600]

(from a worktree: PYTHONPATH=. so that the worktree's kvcompile is the one imported)

prints the requests by outcome, the answers checked against generate() (a random sample of --check valid
ones; 0: all), the server's metrics and the RSS after warm-up and at the end. Exit status 1 on any mismatch.
tests/test_serve_soak.py runs the same workload, bounded, on a tiny model.
"""
import argparse
import json
import random
import resource
import string
import sys
import threading
import time
from dataclasses import dataclass, field

MIX = {"greedy": 4, "chat": 3, "sampled": 2, "stop": 2, "stream": 3, "invalid": 3, "cancel": 2, "oversize": 1,
       "too_long": 1, "pathological": 2}
INVALID = [  # (path, change, the param the 400 must name)
    ("/v1/chat/completions", {"messages": None}, "messages"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"n": 3}, "n"),
    ("/v1/completions", {"whatever": 1}, "whatever"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"tools": []}, "tools"),
]
HUGE = "x " * 2**21  # a 4 MiB prompt: refused by its size, before it is tokenized
PATHOLOGICAL = [  # (path, change, the param the 400 must name, its code); None: a valid request
    ("/v1/completions", {"temperature": 1e-300, "seed": 1}, "temperature", None),
    ("/v1/chat/completions", {"temperature": 1e-300}, "temperature", None),
    ("/v1/completions", {"seed": 2**64}, "seed", None),
    ("/v1/completions", {"seed": -2**70}, "seed", None),
    ("/v1/completions", {"prompt": "\ud800abc"}, "prompt", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages.0.content", None),
    ("/v1/completions", {"prompt": HUGE}, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"temperature": 0.7, "top_p": 1e-300, "seed": 3}, None, None),
]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box jam and "
         "every small kettle sings of rain before the long night ends").split()


def rss_mib() -> float:
    """This process's resident memory now (Linux /proc), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Sent:
    """One request and what came back."""

    kind: str
    path: str
    body: dict
    status: int = 0
    text: str | None = None
    error: dict | None = None
    expect_param: str | None = None
    expect_code: str | None = None
    outcome: str = ""  # ok | refused | cancelled | wrong | transport


@dataclass
class Soak:
    """The workload against a server at `base` serving `model_name`."""

    base: str
    model_name: str
    tokenizer: object
    pool_tokens: int
    context: int
    max_batch_tokens: int
    max_tokens: int = 16
    timeout: float = 120.0
    sent: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def text(self, rng: random.Random, words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."

    def long_text(self, rng: random.Random, low: int, high: int) -> str:
        """A prompt of between `low` and `high` tokens: the shortest prefix of a long text with `low` tokens."""
        def tokens(text: str) -> int:
            return len(self.tokenizer(text)["input_ids"])

        text = self.text(rng, 16)
        while tokens(text) < low:
            text += " " + self.text(rng, len(text.split()))
        lo, hi = 1, len(text)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if tokens(text[:mid]) < low else (lo, mid)
        text = text[:lo]
        assert low <= tokens(text) <= high, (tokens(text), low, high)
        return text

    def make(self, rng: random.Random) -> Sent:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        new = rng.randint(1, self.max_tokens)
        prompt = self.text(rng, rng.randint(3, 40))
        completion = {"model": self.model_name, "prompt": prompt, "max_tokens": new, "temperature": 0}
        chat = {"model": self.model_name, "messages": [{"role": "user", "content": prompt}], "max_tokens": new,
                "temperature": 0}
        if kind == "greedy":
            return Sent(kind, "/v1/completions", completion)
        if kind == "chat":
            return Sent(kind, "/v1/chat/completions", chat)
        if kind == "sampled":
            return Sent(kind, "/v1/completions", {**completion, "temperature": round(rng.uniform(0.5, 1.5), 2),
                                                  "seed": rng.randint(0, 2**31)})
        if kind == "stop":
            return Sent(kind, "/v1/completions", {**completion, "max_tokens": self.max_tokens,
                                                  "stop": [rng.choice("aeiou") + rng.choice(" tnrs"), "zz"]})
        if kind == "stream":
            path, body = rng.choice([("/v1/completions", completion), ("/v1/chat/completions", chat)])
            return Sent(kind, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        if kind == "cancel":
            return Sent(kind, "/v1/completions", {**completion, "max_tokens": 4 * self.max_tokens, "stream": True})
        if kind == "oversize":  # past the pool, within the context: refused at admission
            low = max(self.pool_tokens, self.max_batch_tokens) + 16
            if low + 8 >= self.context:
                return Sent("too_long", "/v1/completions", {**completion, "max_tokens": self.context},
                            expect_param="max_tokens", expect_code="context_length_exceeded")
            return Sent(kind, "/v1/completions", {**completion, "prompt": self.long_text(rng, low, self.context - 8),
                                                  "max_tokens": 1},
                        expect_param="prompt", expect_code="kv_pool_exceeded")
        if kind == "too_long":
            return Sent(kind, "/v1/completions", {**completion, "max_tokens": self.context},
                        expect_param="max_tokens", expect_code="context_length_exceeded")
        if kind == "pathological":
            path, change, param, code = rng.choice(PATHOLOGICAL)
            body = {**(chat if "chat" in path else completion), **change}
            return Sent(kind, path, body, expect_param=param, expect_code=code)
        path, change, param = rng.choice(INVALID)
        body = dict(chat if "chat" in path else completion)
        body.update(change)
        return Sent(kind, path, {k: v for k, v in body.items() if v is not None}, expect_param=param)

    def send(self, sent: Sent) -> Sent:
        import requests

        url = self.base + sent.path
        try:
            if not sent.body.get("stream"):
                reply = requests.post(url, json=sent.body, timeout=self.timeout)
                sent.status = reply.status_code
                data = reply.json()
                if reply.status_code == 200:
                    choice = data["choices"][0]
                    sent.text = choice["message"]["content"] if "message" in choice else choice["text"]
                else:
                    sent.error = data.get("error")
            else:
                with requests.post(url, json=sent.body, timeout=self.timeout, stream=True) as reply:
                    sent.status = reply.status_code
                    if reply.status_code != 200:
                        sent.error = reply.json().get("error")
                    else:
                        parts, chunks = [], 0
                        for line in reply.iter_lines(decode_unicode=True):
                            if not line or not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                break
                            data = json.loads(line[6:])
                            if "error" in data:
                                sent.error = data["error"]
                                break
                            chunks += 1
                            if sent.kind == "cancel" and chunks >= 2:
                                break  # the client goes away mid-stream
                            for choice in data.get("choices", []):
                                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                        sent.text = "".join(parts)
        except Exception as exc:  # noqa: BLE001 - recorded as the request's outcome
            sent.status, sent.error = -1, {"message": f"{type(exc).__name__}: {exc}"}
        sent.outcome = self.judge(sent)
        with self.lock:
            self.sent.append(sent)
        return sent

    def judge(self, sent: Sent) -> str:
        """What the server's answer says before it is compared with generate()."""
        if sent.status == -1:
            return "transport"
        if sent.expect_param is not None or sent.expect_code is not None:
            ok = (sent.status == 400 and sent.error is not None and sent.error.get("param") == sent.expect_param
                  and (sent.expect_code is None or sent.error.get("code") == sent.expect_code))
            return "refused" if ok else "wrong"
        if sent.kind == "cancel":
            return "cancelled" if sent.status == 200 and sent.error is None else "wrong"
        return "ok" if sent.status == 200 and sent.error is None else "wrong"

    def run(self, clients: int, seed: int, requests_per_client: int | None = None,
            seconds: float | None = None) -> None:
        end = None if seconds is None else time.monotonic() + seconds

        def client(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            count = 0
            while (requests_per_client is None or count < requests_per_client) and (end is None or
                                                                                     time.monotonic() < end):
                self.send(self.make(rng))
                count += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def expected(self, model, sent: Sent) -> str:
        """generate()'s answer to a valid request (greedy, or sampled with torch seeded as the request's seed
        seeds its generator), cut at its first stop string."""
        import torch

        body = sent.body
        if "messages" in body:
            ids = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        else:
            ids = self.tokenizer(body["prompt"])["input_ids"]
        settings = {"do_sample": False}
        if body.get("temperature"):
            settings = {"do_sample": True, "temperature": body["temperature"]}
            if "top_p" in body:
                settings["top_p"] = body["top_p"]
            torch.manual_seed(body["seed"])
        out = model.generate(torch.tensor([ids]), max_new_tokens=body["max_tokens"], **settings)
        text = self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        stops = [s for s in body.get("stop") or [] if s in text]
        return text[:min(text.find(s) for s in stops)] if stops else text

    def check(self, model, sample: int = 0, seed: int = 0) -> tuple[int, list[Sent]]:
        """Compare the valid answers (all, or a random `sample` of them) with generate()'s: how many were
        compared, and those that differ (their outcome becomes "wrong")."""
        valid = [s for s in self.sent if s.outcome == "ok"]
        if sample and len(valid) > sample:
            valid = random.Random(seed).sample(valid, sample)
        wrong = [s for s in valid if s.text != self.expected(model, s)]
        for s in wrong:
            s.outcome = "wrong"
        return len(valid), wrong

    def counts(self) -> dict:
        out: dict = {}
        for s in self.sent:
            out.setdefault(s.kind, {}).setdefault(s.outcome, 0)
            out[s.kind][s.outcome] += 1
        return out


def wait_idle(server, timeout: float = 60.0) -> dict:
    """The server's metrics once no request runs or waits (a dropped stream's cancellation reaches the
    engine at its next step)."""
    end = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if metrics["requests_running"] == 0 and metrics["requests_waiting"] == 0 or time.monotonic() > end:
            return metrics
        time.sleep(0.05)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--spec", default="snapkv")
    parser.add_argument("--per-head", type=int, default=64)
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens a request asks")
    parser.add_argument("--check", type=int, default=200, help="valid answers compared with generate() (0: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a client waits for one answer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import socket

    import torch

    from kvcompile.tools.models import default_model_dir
    from kvcompile.integrations.server import KVCompileServer, ServeOptions

    torch.set_num_threads(args.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = str(default_model_dir())
    server = KVCompileServer(ServeOptions(spec=args.spec, overrides={"per_head": args.per_head}, model=folder,
                                          port=port, kv_tokens=args.kv_tokens, max_batch_tokens=args.max_batch_tokens,
                                          log_level="error", log_requests=False))
    server.start()
    server.wait_started(60)
    soak = Soak(f"http://127.0.0.1:{port}", folder, server.tokenizer, server.cache.pool_tokens(), server.context,
                args.max_batch_tokens, max_tokens=args.max_tokens, timeout=args.timeout)
    started = time.monotonic()
    try:
        warm = min(60.0, args.minutes * 60 / 10)
        soak.run(args.clients, args.seed, seconds=warm)
        rss_warm = rss_mib()
        soak.run(args.clients, args.seed + 1, seconds=max(0.0, args.minutes * 60 - warm))
        elapsed = time.monotonic() - started
        metrics = wait_idle(server)
        rss_end = rss_mib()
        alive = server.engine_alive()
    finally:
        server.stop()
    # the served model itself, the engine stopped: generate() on it is the reference
    checked, wrong = soak.check(server.model, sample=args.check, seed=args.seed)
    print(f"kvcompile serve soak: {len(soak.sent)} requests in {elapsed / 60:.1f} min, {args.clients} clients, "
          f"{args.spec} {args.per_head}/head, pool {args.kv_tokens} tokens")
    for kind, outcomes in sorted(soak.counts().items()):
        print(f"  {kind:9s} " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    print(f"  answers compared with generate(): {checked} valid, {len(wrong)} differ")
    print(f"  server alive at the end: {alive}; blocks free {metrics['blocks_free']}/{metrics['blocks_total']}; "
          f"soft resets {metrics['soft_resets']}; failed engine steps {metrics['failed_engine_steps']}")
    print(f"  RSS after warm-up {rss_warm:.0f} MiB, at the end {rss_end:.0f} MiB")
    bad = [s for s in soak.sent if s.outcome in ("wrong", "transport")]
    for s in bad[:10]:
        print(f"  BAD {s.kind} {s.path} {json.dumps(s.body)[:200]} -> {s.status} {s.error} {s.text!r:.80}")
    ok = not bad and alive and metrics["blocks_free"] == metrics["blocks_total"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
