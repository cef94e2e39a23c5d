"""Needle-in-a-haystack sweep on the embedded SmolLM2: every paper spec and the hybrids, budgets of
32-256 tokens per head, prompts of 1k-4k tokens at several depths, plus the perplexity and
next-token agreement of a continuation against the full cache.

    python3 benchmarks/needle.py                       # the full sweep (hours on 2 CPU cores)
    python3 benchmarks/needle.py --lengths 1000 --depths 0.5 --specs snapkv,lava --budgets 64

Writes benchmarks/out/needle.json, needle_heatmap.png, quality_vs_budget.png and prints the
accuracy table as Markdown for benchmarks/RESULTS.md.  Same code as `kvcompile eval`.
"""
import argparse
import json
import time
from pathlib import Path

import torch

from kvcompile.tools import cli
from kvcompile.tools.data import needle_suite
from kvcompile.tools.models import load_model

SPECS = "snapkv,pyramidkv,adakv,lava,dbudgetkv,zsmerge,streamingllm,dbudget_lava,lava_residual,pyramid_pooled"
OUT = Path(__file__).resolve().parent / "out"


def markdown_table(records) -> str:
    """Accuracy per spec and budget, and the mean share of the full cache's KV bytes held."""
    budgets = sorted({r["per_head"] for r in records if r["per_head"] is not None})
    lines = ["| spec | " + " | ".join(f"{b}/head" for b in budgets) + " | own budget |",
             "|---|" + "---|" * (len(budgets) + 1)]
    for spec in dict.fromkeys(r["spec"] for r in records):
        cells = []
        for b in budgets + [None]:
            rows = [r for r in records if r["spec"] == spec and r["per_head"] == b]
            if not rows:
                cells.append("-")
                continue
            share = sum(r["kv_bytes"] / r["kv_bytes_full"] for r in rows) / len(rows)
            cells.append(f"{sum(r['correct'] for r in rows)}/{len(rows)} ({share:.0%} KV)")
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merged(paths) -> dict:
    """The needle and continuation records of several result files (runs split by seed or spec)."""
    result = {"needle": [], "continuation": [], "files": [str(p) for p in paths]}
    for path in paths:
        part = json.loads(Path(path).read_text())
        result["needle"] += part.get("needle", [])
        result["continuation"] += part.get("continuation", [])
    return result


def print_continuation(records, tokens) -> None:
    print(f"\nContinuation of {tokens} tokens: perplexity / next-token agreement with the full cache\n")
    print("| spec | per head | length | perplexity | agreement |\n|---|---|---|---|---|")
    for r in records:
        print(f"| {r['spec']} | {r['per_head'] or '-'} | {r['length']} | {r['perplexity']:.2f} | "
              f"{r['agreement']:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", type=cli.names, default=cli.names(SPECS))
    parser.add_argument("--budgets", type=cli.ints, default=[32, 64, 128, 256])
    parser.add_argument("--lengths", type=cli.ints, default=[1000, 2000, 4000])
    parser.add_argument("--depths", type=cli.fractions, default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--continuation", type=int, default=32, help="continuation tokens (0: skip)")
    parser.add_argument("--texts", type=cli.positive, default=1, help="continuation passages per length")
    parser.add_argument("--no-needle", action="store_true", help="only the continuation")
    parser.add_argument("--no-full", action="store_true", help="no full-cache needle runs (another file has them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=cli.positive, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--name", default="needle", help="writes OUT/NAME.json, NAME_heatmap.png, NAME_quality.png")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="no runs: merge these result files into OUT/NAME.json, print the tables, draw the plots")
    parser.add_argument("--keep-specs", type=cli.names, default=None,
                        help="with --merge: only these specs' needle records (full is kept too)")
    parser.add_argument("--keep-lengths", type=cli.ints, default=None, help="with --merge: only these lengths")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        result = merged(args.merge)
        result["needle"] = [r for r in result["needle"]
                            if (args.keep_specs is None or r["spec"] in args.keep_specs + [cli.FULL])
                            and (args.keep_lengths is None or r["length"] in args.keep_lengths)]
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        filler = cli.haystack()
        model, tokenizer = load_model(args.model)
        start = time.perf_counter()
        result = {"date": time.strftime("%Y-%m-%d"), "model": model.config.name_or_path,
                  "torch_threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()},
                  "needle": []}
        if not args.no_needle:
            prompts = needle_suite(tokenizer, filler, args.lengths, args.depths, seed=args.seed)
            result["needle"] = cli.eval_records(model, tokenizer, prompts, args.specs, args.budgets,
                                                args.max_new_tokens, full=not args.no_full)
        if args.continuation:
            result["continuation"] = cli.continuation_records(model, tokenizer, filler, args.lengths, args.specs,
                                                              args.budgets, args.continuation, args.seed,
                                                              texts=args.texts)
        result["seconds"] = time.perf_counter() - start
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    records = result["needle"]
    if records:
        cli.plot_needle(records, args.out / f"{args.name}_heatmap.png")
        cli.plot_quality(records, args.out / f"{args.name}_quality.png")
        lengths = sorted({r["length"] for r in records})
        print(f"## Needle in a haystack ({result.get('date', 'merged')}, "
              f"{len({(r['length'], r['depth'], r['expected']) for r in records})} prompts of "
              f"{', '.join(map(str, lengths))} tokens)\n")
        print(markdown_table(records))
    if result.get("continuation"):
        print_continuation(result["continuation"], args.continuation)
    print(f"\nfiles: {args.out}/{args.name}.json (+ _heatmap.png, _quality.png)")


if __name__ == "__main__":
    main()
