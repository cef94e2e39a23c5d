"""Compressing while prefilling in chunks (schedule: {prefill: {chunk: c}}) against one-pass compression at
equal budgets, on the embedded SmolLM2-135M and the embedded haystack: needle accuracy (found / prompts) and
prefill time, with the full cache as the ceiling, through generate() (greedy, eager entry).

    PYTHONPATH=. python3 benchmarks/bench_chunked.py      # the default run: about 9 minutes on 2 quiet cores
    PYTHONPATH=. python3 benchmarks/bench_chunked.py --lengths 400 --depths 0.5 --budgets 48 --chunks 128 \\
        --specs snapkv --max-new-tokens 4                  # a quick check that it runs end to end

Defaults: 2,000 and 4,000-token prompts with the needle at depths 0.25, 0.5 and 0.75 (6 prompts, a different
needle each), specs snapkv and lava at 512 and 1024 per KV head, one pass and chunks of 512 and 1024 tokens.
SmolLM2-135M's recall of a 4-digit number is brittle under compression: at 256-768 per head one pass finds
1-2 of these 6 needles and misses most others by a digit ("8292" for 8298), so besides the needles found
(the whole number) the table counts the near answers: a number that starts with the needle's first 3
digits (the needle survived compression, blurred), against made-up numbers (it was evicted).

Prefill time: from the generate() call to the first token's logits (a logits processor marks it); every
policy runs once on a short prompt first, so kernel builds and first-call compiles stay out of it. Prints one
JSON line per run, then a Markdown table: per prompt length the needles found, the near answers and the
mean prefill seconds, and the KV MiB held at the longest length; writes benchmarks/out/chunked.json.
"""
import argparse
import json
import re
import time
from pathlib import Path

import torch

import kvcompile
from kvcompile.tools import cli
from kvcompile.tools.data import answer_found, needle_suite
from kvcompile.tools.models import load_model

OUT = Path(__file__).resolve().parent / "out"
FULL = "full cache"


class FirstLogits:
    """A logits processor that notes when the first token's logits arrive (the prompt is done)."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def generate(model, tokenizer, ids, max_new_tokens):
    mark = FirstLogits()
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, logits_processor=[mark], return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    cache = out.past_key_values
    held = cache.memory_report()["bytes_held"] if hasattr(cache, "memory_report") else _full_bytes(cache)
    return text, mark.at - start, held


def near(text: str, answer: str) -> bool:
    """The answer has a number that starts with the needle's first 3 digits (the whole needle included)."""
    return re.search(rf"(?<!\d){re.escape(answer[:3])}", text) is not None


def _full_bytes(cache) -> int:
    """The bytes of a transformers cache's keys and values."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def policies(args):
    """(spec, per head, chunk, Policy or None for the full cache), in table order."""
    out = [(FULL, None, 0, None)]
    for spec in args.specs:
        for budget in args.budgets:
            one = kvcompile.load_spec(spec, per_head=budget)
            out.append((spec, budget, 0, one))
            for chunk in args.chunks:
                out.append((spec, budget, chunk, kvcompile.load_spec(one, schedule={"prefill": {"chunk": chunk}})))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", type=cli.names, default=["snapkv", "lava"])
    parser.add_argument("--budgets", type=cli.ints, default=[512, 1024])
    parser.add_argument("--chunks", type=cli.ints, default=[512, 1024])
    parser.add_argument("--lengths", type=cli.ints, default=[2000, 4000])
    parser.add_argument("--depths", type=cli.fractions, default=[0.25, 0.5, 0.75])
    parser.add_argument("--max-new-tokens", type=int, default=16)  # "The secret number is 1234." and a bit
    parser.add_argument("--no-full", action="store_true", help="skip the full cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=cli.positive, default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    prompts = needle_suite(tokenizer, cli.haystack(), args.lengths, args.depths, seed=args.seed)
    runs = [run for run in policies(args) if not (args.no_full and run[0] == FULL)]
    started = time.perf_counter()
    records = []
    for spec, budget, chunk, policy in runs:
        if policy is not None:
            kvcompile.compile(model, policy)
        try:
            warm = torch.tensor([prompts[0].input_ids[:chunk + 300]])  # two chunks of a chunked policy
            generate(model, tokenizer, warm, 2)  # kernel builds, first-call compiles, the chunked path
            for prompt in prompts:
                text, prefill, held = generate(model, tokenizer, torch.tensor([prompt.input_ids]),
                                               args.max_new_tokens)
                records.append({"spec": spec, "per_head": budget, "chunk": chunk, "length": prompt.length,
                                "target": prompt.target, "depth": prompt.depth, "needle": prompt.answer,
                                "correct": answer_found(text, prompt.answer), "near": near(text, prompt.answer),
                                "prefill_s": prefill,
                                "kv_bytes": held, "answer": text.strip()})
                print(json.dumps(records[-1]), flush=True)
        finally:
            kvcompile.uncompile(model)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunked.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args),
                                                       "threads": torch.get_num_threads(), "records": records},
                                                      indent=1, default=str))
    print(f"\n{len(prompts)} needle prompts ({', '.join(str(p.length) for p in prompts)} tokens), "
          f"torch threads {torch.get_num_threads()}, {time.perf_counter() - started:.0f} s\n")
    print(table(records, args.lengths))


def table(records, lengths) -> str:
    """Markdown: one row per (spec, per head, prefill); per target length the needles found, the near
    answers and the mean prefill seconds; both counts over all prompts; the mean KV MiB held at the
    longest length."""
    head = ["spec", "per head", "prefill"]
    for n in lengths:
        head += [f"needle {n}", f"near {n}", f"prefill s {n}"]
    head += ["needle all", "near all", f"KV MiB {max(lengths)}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r["spec"], r["per_head"], r["chunk"]) for r in records))
    for spec, budget, chunk in keys:
        rows = [r for r in records if (r["spec"], r["per_head"], r["chunk"]) == (spec, budget, chunk)]
        cells = [spec, "-" if budget is None else str(budget), f"chunks of {chunk}" if chunk else "one pass"]
        for n in lengths:
            at = [r for r in rows if r["target"] == n]
            cells += [f"{sum(r['correct'] for r in at)}/{len(at)}", f"{sum(r['near'] for r in at)}/{len(at)}",
                      f"{sum(r['prefill_s'] for r in at) / max(len(at), 1):.2f}"]
        longest = [r for r in rows if r["target"] == max(lengths)]
        cells += [f"{sum(r['correct'] for r in rows)}/{len(rows)}", f"{sum(r['near'] for r in rows)}/{len(rows)}",
                  f"{sum(r['kv_bytes'] for r in longest) / max(len(longest), 1) / 2 ** 20:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
