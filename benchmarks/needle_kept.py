"""Which of a RULER sample's answer tokens does each policy keep, layer by layer and head by head? The sample's
prompt is captured once (as `kvcompile eval --suite ruler` does), each spec replayed over it at the kept share,
and for every gold answer found in the context the script prints, per layer, how many of the KV heads keep each of
its tokens (one digit a token: 3 = every head of SmolLM2-135M), the share of (layer, head, token) entries kept,
and the policy's greedy answer after the question — why a policy loses a needle, not only that it does.

    nice python3 benchmarks/needle_kept.py --task niah_single_1 --sample 0 --mode aware --kv-fraction 0.25 \\
        --specs tova,kvpress:snapkv,observed_attention
"""
from __future__ import annotations

import argparse

import torch


def located(ids: list[int], tokenizer, answer: str) -> tuple[int, int] | None:
    """(first position, token count) of `answer`'s tokens in `ids` (as written, or after a space), or None."""
    for text in (answer, " " + answer):
        want = tokenizer.encode(text, add_special_tokens=False)
        for p in range(len(ids) - len(want) + 1):
            if ids[p:p + len(want)] == want:
                return p, len(want)
    return None


def main(argv=None) -> None:
    from kvcompile.tools import ruler
    from kvcompile.tools.cli import haystack
    from kvcompile.tools.models import default_model_dir, load_model, model_summary
    from kvcompile.tools.sweep import capture, feed, greedy_together, replay

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="niah_single_1", choices=sorted(ruler.TASKS))
    ap.add_argument("--sample", type=int, default=0, help="the sample's number within its task (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--mode", default="aware", choices=("aware", "agnostic"))
    ap.add_argument("--kv-fraction", type=float, default=0.25)
    ap.add_argument("--specs", default="tova,kvpress:snapkv,observed_attention",
                    help="comma-separated, as `kvcompile eval --specs` takes them (kvpress:PRESS included)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    filler = haystack()  # a clear exit naming the set-up command where data/haystack.txt is missing

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(default_model_dir())
    sample = ruler.generate_sample(tokenizer, args.task, args.length, args.seed, args.sample, filler)
    ids, question = ruler.mode_prompt(tokenizer, sample, args.mode)
    spans = {a: located(ids, tokenizer, a) for a in sample["answers"]}
    missing = [a for a, span in spans.items() if span is None]
    if missing:
        raise SystemExit(f"{args.task} #{args.sample}: the answer(s) {missing} are not whole tokens of the context "
                         f"(this script reads needle tasks, whose answers the context holds)")
    print(f"{args.task} #{args.sample} (seed {args.seed}), {args.mode}, {len(ids)} tokens, "
          f"{args.kv_fraction:.0%} kept; answers at " + ", ".join(f"{a!r}: {p}..{p + k - 1}" for a, (p, k) in spans.items()))
    shape = model_summary(model)
    geometry = (shape["head_dim"], next(model.parameters()).element_size())
    states, _ = capture(model, torch.tensor([ids]))
    for spec in [s for s in args.specs.split(",") if s]:
        for _, policy in ruler.policies_for(spec, len(ids), [args.kv_fraction], None, None, geometry):
            cache = replay(policy, model.config, states, headroom=len(question) + args.new_tokens, model=model,
                           tokenizer=tokenizer)
            kept = [cache.kept_positions(layer)[0] for layer in range(len(cache))]  # (heads, positions) a layer
            logits = feed(model, cache, torch.tensor([question]), tokenizer=tokenizer)
            (tokens,), _ = greedy_together(model, [cache], [logits], args.new_tokens, ruler.eos_ids(model),
                                           tokenizer=tokenizer)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            print(f"\n{policy.name} ({policy.budget.per_head} a head): answers {text!r}, "
                  f"score {100 * ruler.score(args.task, text, sample['answers']):.0f}")
            for answer, (p, k) in spans.items():
                rows = [layer[:, p:p + k] for layer in kept]
                share = sum(int(r.sum()) for r in rows) / sum(r.numel() for r in rows)
                print(f"  {answer!r}: {share:.0%} of its (layer, head, token) entries kept; heads keeping each "
                      f"token, layer 0 first:")
                print("    " + " ".join("".join(str(int(c)) for c in r.sum(0).tolist()) for r in rows))


if __name__ == "__main__":
    main()
