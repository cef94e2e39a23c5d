"""What KVzip costs `kvcompile tune` per calibration sample: one RULER sample's captured prefill
(sweep.capture), one computation of KVzip's reconstruction scores over it (sweep.reconstruction_scores, paid
once per sample and scorer configuration), and the replays that reuse them (sweep.replay) beside other
scorers' replays, with the direct compiled kvzip prefill (sweep.prefilled) for comparison; checks that each
replayed kvzip spec keeps the entries and gives the last logits of its compiled prefill. Wall and CPU seconds.

    nice python3 benchmarks/bench_tune_kvzip.py --task niah_single_1 --length 4096 --threads 1
"""
from __future__ import annotations

import argparse
import time

import torch

import kvcompile
from kvcompile.policy import policy_to_mapping


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    from kvcompile.tools import ruler, tune
    from kvcompile.tools.cli import haystack, quiet_libraries
    from kvcompile.tools.models import load_model
    from kvcompile.tools.sweep import capture, prefilled, reconstruction_scores, replay

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--query", default="agnostic", choices=["agnostic", "aware"])
    parser.add_argument("--kv-fraction", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--direct", nargs="*", default=["kvzip"],
                        help="the kvzip specs also run through their compiled prefill, to compare (each costs one)")
    parser.add_argument("--specs", nargs="+", default=["kvzip", "kvzip_adakv", "kvzip_uniform", "snapkv",
                                                       "expected_attention"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_libraries()
    model, tok = load_model(None)
    rows = ruler.ruler_samples(tok, [args.task], [args.length], 1, args.seed, haystack())
    sample = tune.samples_from_ruler(tok, rows, args.query)[0]
    ids = torch.tensor([sample.context])
    n = ids.shape[1]
    budget = tune.Budget(kv_fraction=args.kv_fraction)
    print(f"{args.task} #0 seed {args.seed}, {args.query}: {n} context tokens, {args.threads} thread(s)", flush=True)

    def show(what, wall, cpu, extra=""):
        print(f"{what:<58} wall {wall:7.2f} s  cpu {cpu:7.2f} s{extra}", flush=True)

    with torch.no_grad():
        (states, last), wall, cpu = timed(lambda: capture(model, ids))
        show("capture (one prefill, nothing evicted)", wall, cpu)
        for spec in args.specs:
            policy = budget.policy(policy_to_mapping(kvcompile.load_spec(spec)), n, model)
            kvzip = getattr(policy.scoring, "reconstructs", False)
            if kvzip and not states.scores:
                _, wall, cpu = timed(lambda: reconstruction_scores(model, policy, states, tok))
                show("kvzip reconstruction scores (once per sample)", wall, cpu)
            cache, wall, cpu = timed(lambda: replay(policy, model.config, states, headroom=64, model=model,
                                                    tokenizer=tok))
            show(f"replay {spec} ({policy.budget.per_head}/head)", wall, cpu)
            if spec in args.direct:
                (own, own_last), wall, cpu = timed(lambda: prefilled(model, policy, ids, headroom=64, tokenizer=tok))
                same = torch.equal(own_last, last) and torch.equal(own.kept(), cache.kept()) and all(
                    torch.equal(own.kept_positions(layer), cache.kept_positions(layer))
                    for layer in range(cache.num_layers))
                show("  its compiled prefill (prefill + reconstruction + select)", wall, cpu,
                     f"  replay identical: {same}")
        evaluator = tune.Evaluator(model, [sample], budget, 32, tokenizer=tok)
        evaluator._states[0], evaluator._scores[0] = (states, last), states.scores  # this sample, captured above
        for spec in ("kvzip", "snapkv"):
            candidate = tune.Candidate(spec, policy_to_mapping(kvcompile.load_spec(spec)))
            value, wall, cpu = timed(lambda: evaluator.proxy(candidate, 0))
            show(f"tune proxy {spec} (replay, question, gold teacher-forced)", wall, cpu, f"  log p {value:.4f}")


if __name__ == "__main__":
    main()
