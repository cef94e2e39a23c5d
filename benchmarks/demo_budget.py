"""Which budget should `kvcompile run` default to? The demo's own prompts (one per seed, at
the demo's length and depth), the full cache and a spec at several budgets, through the same
`generate()` path as `kvcompile run` (no prefill reuse), the model loaded once.

    python3 benchmarks/demo_budget.py                                  # lava, seeds 0-3, 128,192,256
    python3 benchmarks/demo_budget.py --spec snapkv --seeds 0,1 --budgets 64,128

Prints one row per seed: the needle, the full cache's verdict and each budget's
(right / wrong, with the answer when wrong). benchmarks/HISTORY.md, "Demo default budget".
"""
from __future__ import annotations

import argparse
import time

from kvcompile.tools import cli


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=cli.DEFAULT_SPEC)
    p.add_argument("--seeds", type=cli.ints, default=[0, 1, 2, 3])
    p.add_argument("--budgets", type=cli.ints, default=[128, 192, 256])
    p.add_argument("--length", type=cli.positive, default=2000)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--max-new-tokens", type=cli.positive, default=32)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=cli.positive, default=None)
    p.add_argument("--no-full", action="store_true", help="skip the full cache (already known)")
    args = p.parse_args()
    args.quiet = True
    policies = [cli.policy_for(args.spec, b) for b in args.budgets]
    filler = cli.haystack()
    model, tokenizer = cli.load(args)

    from kvcompile.tools.data import answer_found
    from kvcompile.tools.models import generate

    started = time.perf_counter()
    rows = []
    for seed in args.seeds:
        prompt = cli.demo_prompt(tokenizer, filler, args.length, args.depth, seed)
        generate(model, tokenizer, prompt.input_ids[:64], 2)  # warm-up, as the demo does
        cells = []
        for policy in ([] if args.no_full else [None]) + policies:
            if policy is None:
                g = generate(model, tokenizer, prompt.input_ids, args.max_new_tokens)
            else:
                g = cli.run_policy(model, tokenizer, prompt.input_ids, policy, args.max_new_tokens)
            ok = answer_found(g.text, prompt.answer)
            cells.append("right" if ok else f"wrong ({cli.one_line(g.text)[-24:]})")
            print(f"seed {seed} {'full' if policy is None else cli.budget_label(policy)}: {cells[-1]} "
                  f"[{time.perf_counter() - started:.0f} s]", flush=True)
        rows.append((seed, prompt.length, prompt.answer, cells))
    head = ["seed", "tokens", "needle"] + ([] if args.no_full else ["full"]) + [f"{args.spec} {b}" for b in args.budgets]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for seed, n, answer, cells in rows:
        print(f"| {seed} | {n} | {answer} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
