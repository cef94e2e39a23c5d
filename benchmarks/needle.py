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

from kvcompile import cli
from kvcompile.data import needle_suite
from kvcompile.models import load_model

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", type=cli.names, default=cli.names(SPECS))
    parser.add_argument("--budgets", type=cli.ints, default=[32, 64, 128, 256])
    parser.add_argument("--lengths", type=cli.ints, default=[1000, 2000, 4000])
    parser.add_argument("--depths", type=cli.fractions, default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--continuation", type=int, default=32, help="continuation tokens (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    filler = cli.haystack()
    model, tokenizer = load_model(args.model)
    prompts = needle_suite(tokenizer, filler, args.lengths, args.depths, seed=args.seed)
    start = time.perf_counter()
    records = cli.eval_records(model, tokenizer, prompts, args.specs, args.budgets, args.max_new_tokens)
    result = {"date": time.strftime("%Y-%m-%d"), "model": model.config.name_or_path,
              "torch_threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()},
              "needle": records}
    if args.continuation:
        result["continuation"] = cli.continuation_records(model, tokenizer, filler, args.lengths, args.specs,
                                                          args.budgets, args.continuation, args.seed)
    result["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "needle.json").write_text(json.dumps(result, indent=1))
    cli.plot_needle(records, args.out / "needle_heatmap.png")
    cli.plot_quality(records, args.out / "quality_vs_budget.png")
    print(f"## Needle in a haystack ({result['date']}, {len(prompts)} prompts of "
          f"{', '.join(map(str, args.lengths))} tokens)\n")
    print(markdown_table(records))
    if args.continuation:
        print(f"\nContinuation of {args.continuation} tokens: perplexity (full cache) / agreement with it\n")
        print("| spec | per head | length | perplexity | agreement |\n|---|---|---|---|---|")
        for r in result["continuation"]:
            print(f"| {r['spec']} | {r['per_head'] or '-'} | {r['length']} | {r['perplexity']:.2f} | "
                  f"{r['agreement']:.0%} |")
    print(f"\nfiles: {args.out}/needle.json, needle_heatmap.png, quality_vs_budget.png")


if __name__ == "__main__":
    main()
