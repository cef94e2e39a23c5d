"""Prefill cost of the query-agnostic scorers against the full cache (issue 22's target: ≤ 1.10×).

Times one forward over an N-token prompt of data/haystack.txt on SmolLM2 (fp32, CPU unless a GPU is
there): the plain model (full cache), then compiled with expected_attention and knorm (and snapkv for
comparison). Median of `--repeat` runs after one warm-up; prints ms and the ratio to the full cache.

    python3 benchmarks/bench_query_agnostic.py [--tokens 1024] [--repeat 3] [--per-head 128]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvcompile
from kvcompile.tools.models import home, load_model


def timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--per-head", type=int, default=128)
    parser.add_argument("--specs", default="expected_attention,knorm,snapkv")
    args = parser.parse_args()
    model, tokenizer = load_model()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    text = (home() / "data" / "haystack.txt").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.tokens].to(device)

    def prefill():
        with torch.no_grad():
            model(ids, attention_mask=torch.ones_like(ids))

    full = timed(prefill, args.repeat)
    print(f"{ids.shape[1]} tokens on {device}, {torch.get_num_threads()} threads")
    print(f"{'full cache':20s} {full * 1e3:9.1f} ms  1.00x")
    for spec in args.specs.split(","):
        with kvcompile.compiled(model, spec, per_head=args.per_head):
            t = timed(prefill, args.repeat)
        print(f"{spec:20s} {t * 1e3:9.1f} ms  {t / full:.2f}x")


if __name__ == "__main__":
    main()
