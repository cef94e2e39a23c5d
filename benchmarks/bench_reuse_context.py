"""Time to first token of a conversation's second turn through `kvcompile serve`, with and without
`--reuse-context`.

The server runs in this process (KVCompileServer on 127.0.0.1, the embedded SmolLM2-135M, fp32), first
without reuse, then with it. For each of `--repeats` conversations (a different stretch of data/haystack.txt
each, so that no conversation reuses another's cache): turn 1 is a chat request whose user message is
`--context` tokens of text and a question, answered greedily with `--new-tokens` tokens; turn 2 sends
the conversation so far (turn 1, its answer, a new question), streamed, as a chat client does. TTFT is
measured by the client: from sending the request to the first chunk carrying text. With reuse, turn 2
continues turn 1's kept compressed cache and prefills only the tokens after it ("prefilled"); without,
it prefills the whole prompt. One machine, one run: ratios from a loaded machine are indicative only.

    python3 benchmarks/bench_reuse_context.py [--spec expected_attention] [--per-head 128] [--context 2048]
        [--new-tokens 32] [--repeats 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

QUESTION1 = "\n\nWhat is this text about? Answer in two sentences."
QUESTION2 = "Which places does it name? List them."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def contexts(tokenizer, count: int, length: int) -> list[str]:
    """`count` texts of `length` tokens, consecutive stretches of the haystack (wrapping around)."""
    from kvcompile.tools.data import load_haystack

    ids = tokenizer(load_haystack(), add_special_tokens=False)["input_ids"]
    need = count * length
    ids = (ids * (need // len(ids) + 1))[:need]
    return [tokenizer.decode(ids[i * length:(i + 1) * length]) for i in range(count)]


def chat(server, messages: list[dict], max_tokens: int) -> tuple[str, float, float]:
    """A streamed greedy chat request: (the answer, seconds to the first chunk with text, total seconds)."""
    import requests

    body = {"model": server.options.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    first, text = None, ""
    with requests.post(f"http://127.0.0.1:{server.options.port}/v1/chat/completions", json=body, stream=True,
                       timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first if first is not None else time.perf_counter() - start
                text += delta
    return text, first, time.perf_counter() - start


def run(args, reuse: bool, texts: list[str]) -> list[dict]:
    from kvcompile.tools.models import default_model_dir
    from kvcompile.integrations.server import KVCompileServer, ServeOptions

    server = KVCompileServer(ServeOptions(spec=args.spec, model=str(default_model_dir()),
                                          overrides={"per_head": args.per_head}, port=free_port(),
                                          kv_tokens=args.kv_tokens, max_batch_tokens=args.max_batch_tokens,
                                          log_level="error", log_requests=False, reuse_context=reuse))
    server.start()
    rows = []
    try:
        server.wait_started(timeout=120)
        chat(server, [{"role": "user", "content": "Hello!"}], 4)  # warm-up
        for text in texts:
            turn1 = [{"role": "user", "content": text + QUESTION1}]
            answer, ttft1, _ = chat(server, turn1, args.new_tokens)
            time.sleep(0.3)  # the kept cache is settled once the response has ended; leave the engine idle
            turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTION2}]
            ids = server.tokenizer.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]
            reused_before = server.metrics()["requests_reused"]
            entry = server.kept.match(ids) if server.kept is not None else None
            _, ttft2, total2 = chat(server, turn2, args.new_tokens)
            reused = server.metrics()["requests_reused"] - reused_before
            prefilled = len(ids) - (len(entry.ids) - 1 if entry is not None and reused else 0)
            rows.append({"ttft1": ttft1, "ttft2": ttft2, "total2": total2, "prompt2": len(ids),
                         "prefilled": prefilled, "reused": reused})
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="expected_attention",
                        help="a query-agnostic spec (default expected_attention)")
    parser.add_argument("--per-head", type=int, default=128, help="entries kept per head (default 128)")
    parser.add_argument("--context", type=int, default=2048, help="tokens of text in turn 1 (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens of each answer (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="conversations per mode (default 3)")
    parser.add_argument("--kv-tokens", type=int, default=16384, help="the engine's pool (default 16384)")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens one forward packs (default 2048)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from kvcompile.tools.models import default_model_dir

    torch.set_num_threads(args.threads)
    texts = contexts(AutoTokenizer.from_pretrained(default_model_dir()), args.repeats, args.context)
    results = {mode: run(args, mode == "reuse", texts) for mode in ("prefill", "reuse")}

    print(f"SmolLM2-135M fp32, {args.spec} per_head={args.per_head}, turn 1: {args.context}-token text + question, "
          f"{args.new_tokens} new tokens per turn, {args.repeats} conversations per mode, {args.threads} threads")
    print(f"{'turn 2':<9}{'prompt':>8}{'prefilled':>11}{'reused':>8}{'TTFT1 s':>10}{'TTFT2 s':>10}{'TTFT2 min':>11}"
          f"{'turn2 total s':>15}")
    median = {}
    for mode, rows in results.items():
        median[mode] = statistics.median(r["ttft2"] for r in rows)
        print(f"{mode:<9}{statistics.median(r['prompt2'] for r in rows):>8.0f}"
              f"{statistics.median(r['prefilled'] for r in rows):>11.0f}{sum(r['reused'] for r in rows):>5}/{len(rows)}"
              f"{statistics.median(r['ttft1'] for r in rows):>10.3f}{median[mode]:>10.3f}"
              f"{min(r['ttft2'] for r in rows):>11.3f}{statistics.median(r['total2'] for r in rows):>15.3f}")
    print(f"turn-2 TTFT, prefill / reuse (medians): {median['prefill'] / median['reuse']:.1f}x")


if __name__ == "__main__":
    main()
