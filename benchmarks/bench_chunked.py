"""Compressing while prefilling in chunks (schedule: {prefill: {chunk: c}}) against one-pass
compression at equal budgets, on the embedded SmolLM2: needle accuracy, prefill time and the KV
bytes held, through generate() (greedy).

    python3 benchmarks/bench_chunked.py --lengths 2000,4000 --depths 0.3,0.7 --specs snapkv,lava \\
        --budgets 128,256 --chunks 512,1024

Prefill time: from the generate() call to the first token's logits (a logits processor marks it).
Prints a Markdown table for benchmarks/RESULTS.md and writes benchmarks/out/chunked.json.
"""
import argparse
import json
import time
from pathlib import Path

import torch

import kvcompile
from kvcompile import cli
from kvcompile.data import answer_found, needle_suite
from kvcompile.models import load_model

OUT = Path(__file__).resolve().parent / "out"


class FirstLogits:
    """A logits processor that notes when the first token's logits arrive (the prompt is done)."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def run(model, tokenizer, prompt, policy, max_new_tokens):
    ids = torch.tensor([prompt.input_ids])
    mark = FirstLogits()
    with kvcompile.compiled(model, policy), torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, logits_processor=[mark],
                             return_dict_in_generate=True)
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    return {"correct": answer_found(text, prompt.answer), "prefill_s": mark.at - start,
            "kv_bytes": out.past_key_values.memory_report()["bytes_held"], "answer": text.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", type=cli.names, default=["snapkv", "lava"])
    parser.add_argument("--budgets", type=cli.ints, default=[128, 256])
    parser.add_argument("--chunks", type=cli.ints, default=[512, 1024])
    parser.add_argument("--lengths", type=cli.ints, default=[2000, 4000])
    parser.add_argument("--depths", type=cli.fractions, default=[0.3, 0.7])
    parser.add_argument("--max-new-tokens", type=int, default=20)  # 4-digit answers: ~14 tokens
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=cli.positive, default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    prompts = needle_suite(tokenizer, cli.haystack(), args.lengths, args.depths, seed=args.seed)
    records = []
    for prompt in prompts:
        for spec in args.specs:
            for budget in args.budgets:
                for chunk in [0] + args.chunks:
                    policy = kvcompile.load_spec(spec, per_head=budget)
                    if chunk:
                        policy = kvcompile.load_spec(policy, schedule={"prefill": {"chunk": chunk}})
                    r = run(model, tokenizer, prompt, policy, args.max_new_tokens)
                    records.append({"spec": spec, "per_head": budget, "chunk": chunk, "length": prompt.length,
                                    "depth": prompt.depth, **r})
                    print(json.dumps(records[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunked.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args),
                                                       "threads": torch.get_num_threads(), "records": records},
                                                      indent=1, default=str))
    print(f"\n{len(prompts)} prompts of {', '.join(str(p.length) for p in prompts)} tokens; "
          f"torch threads {torch.get_num_threads()}\n")
    print("| spec | per head | prefill | needle | prefill s (mean) | KV MiB held (mean) |\n|---|---|---|---|---|---|")
    for spec in args.specs:
        for budget in args.budgets:
            for chunk in [0] + args.chunks:
                rows = [r for r in records if (r["spec"], r["per_head"], r["chunk"]) == (spec, budget, chunk)]
                print(f"| {spec} | {budget} | {'one pass' if not chunk else f'chunks of {chunk}'} | "
                      f"{sum(r['correct'] for r in rows)}/{len(rows)} | "
                      f"{sum(r['prefill_s'] for r in rows) / len(rows):.1f} | "
                      f"{sum(r['kv_bytes'] for r in rows) / len(rows) / 2 ** 20:.2f} |")


if __name__ == "__main__":
    main()
