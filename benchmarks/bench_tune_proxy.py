"""How often does a cheap proxy order candidate policies as their generated answers do? For each calibration
sample and candidate: both of `kvcompile tune`'s proxies (tune.FullCacheKL, minus the mean KL from the full
cache's next-token distributions along the gold answer; tune.GoldLikelihood, the gold answer's mean
log-likelihood) and the task's score of the greedy answer, with the full cache's own score. Prints, over the
samples every candidate has, the share of candidate pairs each proxy orders as generation does (pairs tied in
either left out), on every sample and on the samples the full cache answers, and each candidate's means.
Resumes from --out (one JSON line per candidate and sample); the candidates: six scorers, each with a global
ranking of every entry and with uniform layers over pooled heads.

    nice python3 benchmarks/bench_tune_proxy.py --kv-fraction 0.25 --samples-used 18,20,10,16,6,12,14,19 \
        --out benchmarks/tune/proxy_agreement25_seed0.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

SCORERS = ("kvzip", "lava", "window_attention", "expected_attention", "key_norm", "recency")


def chosen(found):
    out = []
    for scorer in SCORERS:
        for layers, heads in (("global", "heads=pooled |"), ("uniform", "heads=pooled(")):
            out += [c for c in found if c.key.startswith(f"scoring={scorer}") and f"layers={layers}" in c.key
                    and heads in c.key and "schedule=prefill" in c.key][:1]
    return out


def agreement(rows: dict, keys: list[str], samples: list[int], signal: str) -> tuple[int, int]:
    agree = pairs = 0
    for a, b in itertools.combinations(keys, 2):
        dp = sum(rows[a][i][signal] - rows[b][i][signal] for i in samples)
        dc = sum(rows[a][i]["confirm"] - rows[b][i]["confirm"] for i in samples)
        if dp and dc:
            pairs += 1
            agree += (dp > 0) == (dc > 0)
    return agree, pairs


def main() -> None:
    from types import SimpleNamespace

    from kvcompile.tools import cli, tune

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-fraction", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=2, help="RULER samples per task (all 11 tasks, 4k tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples-used", default=None, help="sample indices to run (default: every one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--report-only", action="store_true", help="print the tables of --out, run nothing")
    args = parser.parse_args()
    if args.report_only:
        return report(Path(args.out))
    torch.set_num_threads(args.threads)
    cli.quiet_libraries()
    load = SimpleNamespace(model=None, quiet=True, threads=args.threads, dataset=None, max_new_tokens=None,
                           lengths=[4096], samples=args.samples, seed=args.seed)
    model, tokenizer = cli.load(load)
    rows = cli.ruler_samples_for(load, tokenizer, None, True)
    samples = tune.samples_from_ruler(tokenizer, rows, "agnostic")
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=args.kv_fraction),
                        max(r["max_new_tokens"] for r in rows), decode=decode, tokenizer=tokenizer)
    candidates = chosen(tune.candidates(tune.default_space(False))[0])
    out = Path(args.out)
    done = {(r["candidate"], r["sample"]) for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    used = range(len(samples)) if args.samples_used is None else [int(x) for x in args.samples_used.split(",")]
    for i in used:
        s = samples[i]
        if (tune.FULL_CACHE, i) not in done:
            with out.open("a") as f:
                f.write(json.dumps({"candidate": tune.FULL_CACHE, "sample": i, "task": s.task,
                                    "confirm": ev.full_score(i)}) + "\n")
        for c in candidates:
            if (c.key, i) in done:
                continue
            ev.measure = tune.FullCacheKL()
            kl = ev.proxy(c, i)
            ev.measure = tune.GoldLikelihood()
            logp = ev.proxy(c, i)
            with out.open("a") as f:
                f.write(json.dumps({"candidate": c.key, "sample": i, "task": s.task, "confirm": ev.confirm(c, i),
                                    "kl": kl, "logp": logp}) + "\n")
        print(f"sample {i} ({s.task}) done", flush=True)
    report(out)


def report(path: Path) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    full = {r["sample"]: r["confirm"] for r in records if r["candidate"] == "(the full cache)"}
    rows: dict[str, dict[int, dict]] = {}
    for r in records:
        if r["candidate"] != "(the full cache)":
            rows.setdefault(r["candidate"], {})[r["sample"]] = r
    keys = list(rows)
    every = sorted(set.intersection(*(set(v) for v in rows.values())) & set(full))
    answered = [i for i in every if full[i] > 0]
    print(f"samples: {every} (the full cache answers {answered})")
    print("| samples | pairs | kl agrees | logp agrees |\n|---|---|---|---|")
    for label, used in (("every sample", every), ("answered by the full cache", answered)):
        (ka, kp), (la, lp) = agreement(rows, keys, used, "kl"), agreement(rows, keys, used, "logp")
        print(f"| {label} ({len(used)}) | {kp} | {ka} ({ka / max(1, kp):.0%}) | {la} of {lp} ({la / max(1, lp):.0%}) |")
    print("\n| candidate | score (every) | kl | logp | score (answered) |\n|---|---|---|---|---|")
    for k in keys:
        mean = lambda s, used: sum(rows[k][i][s] for i in used) / max(1, len(used))  # noqa: E731
        print(f"| {k.split(' | ')[0]} {k.split(' | ')[1]} | {mean('confirm', every):.1f} | {mean('kl', every):.3f} "
              f"| {mean('logp', every):.3f} | {mean('confirm', answered):.1f} |")


if __name__ == "__main__":
    main()
