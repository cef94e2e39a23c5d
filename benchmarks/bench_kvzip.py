"""Prefill cost of scoring: kvzip (KVzip's context reconstruction) against the full cache's prefill, on the
embedded SmolLM2-135M and a context cut from the embedded haystack (issue 22's target: at most 2.0x).

    PYTHONPATH=. python3 benchmarks/bench_kvzip.py                       # ~2k tokens, chunk 2048
    PYTHONPATH=. python3 benchmarks/bench_kvzip.py --tokens 2000 --chunk 512 --repeats 3
    PYTHONPATH=. python3 benchmarks/bench_kvzip.py --tokens 4096 --prefill-chunk 1024   # also chunk by chunk

Timed, each the median of --repeats runs after one warm-up, in the same process (one thread unless
--threads): the plain model's forward over the context with a DynamicCache (the full cache; logits at the
last position, as generate()'s prefill), and the kvzip-compiled model's forward over it (prefill with every
entry kept, the reconstruction forwards, every layer's selection); with --prefill-chunk C, also kvzip under
`schedule: {prefill: {chunk: C}}` (each chunk's forward over the held entries, its reconstruction, the
selection; the chunks given one per call, logits at the last position, as generate() feeds them). Prints one
JSON line: the times, their ratios to the full cache's, the reconstruction tokens (context + repeat prompts)
and the chunk sizes.
"""
import argparse
import json
import statistics
import time

import torch

import kvcompile
from kvcompile.tools.data import load_haystack, user_turn
from kvcompile.tools.models import load_model


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up: kernel builds and first-call work stay out of the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000, help="context length in tokens (default 2000)")
    parser.add_argument("--chunk", type=int, default=2048, help="kvzip's reconstruction chunk (default 2048)")
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="also time kvzip with schedule: {prefill: {chunk: C}} (default 0: not)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    text = load_haystack()
    ids = tokenizer(user_turn(tokenizer, text[: args.tokens * 6]), return_tensors="pt").input_ids
    ids = torch.cat([ids[:, : args.tokens - 20], ids[:, -20:]], dim=1)  # the user turn's end kept
    n = ids.shape[1]

    def full():
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)

    full_s = seconds(full, args.repeats)
    policy = kvcompile.load_spec("kvzip", per_head=args.per_head, scoring={"kvzip": {"chunk": args.chunk}})
    with kvcompile.compiled(model, policy, tokenizer=tokenizer):
        def kvzip():
            with torch.no_grad():
                model(ids, use_cache=True, logits_to_keep=1)

        kvzip_s = seconds(kvzip, args.repeats)
    chunked_s = None
    if args.prefill_chunk:
        from kvcompile.cache import KVCompileCache

        c = args.prefill_chunk
        with kvcompile.compiled(model, kvcompile.load_spec(policy, schedule={"prefill": {"chunk": c}}),
                                tokenizer=tokenizer):
            def chunked():
                cache = KVCompileCache.from_plan(model.kvcompile_plan)
                cache.expect_prompt(n)
                with torch.no_grad():
                    for start in range(0, n, c):
                        model(ids[:, start:start + c], past_key_values=cache, use_cache=True, logits_to_keep=1)

            chunked_s = seconds(chunked, args.repeats)
    from kvcompile.kvzip import RepeatPrompt

    repeat = RepeatPrompt.from_tokenizer(tokenizer)
    spans = policy.scoring.chunks(n)
    rebuilt = sum(x.shape[1] for x in repeat.inputs(ids, spans, policy.scoring.overlap))
    print(json.dumps({"tokens": n, "chunk": args.chunk, "chunks": len(spans), "reconstruction_tokens": rebuilt,
                      "full_cache_prefill_s": round(full_s, 3), "kvzip_prefill_s": round(kvzip_s, 3),
                      "ratio": round(kvzip_s / full_s, 3), "threads": args.threads,
                      **({} if chunked_s is None else {
                          "prefill_chunk": args.prefill_chunk, "kvzip_chunked_prefill_s": round(chunked_s, 3),
                          "chunked_ratio": round(chunked_s / full_s, 3)})}))


if __name__ == "__main__":
    main()
