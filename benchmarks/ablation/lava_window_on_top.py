"""Experiment, not part of kvcompile: LAVa with its entropy split applied to the budget beyond the
protected window only, as the authors' code does (MGDDestiny/Lava: (base_capacity - window) x L
is shared in proportion to the layers' entropies and every layer keeps its window on top),
instead of to the whole budget as kvcompile's `layers: entropy` (docs/SPECS.md) does. For this one run it swaps
`kvcompile.reference.layer_totals` (which the runtime's cascade calls) for the variant below, and
writes benchmarks/out/needle_lava_window_on_top.json: the needle prompts of seeds 3-8, 1k and 2k
tokens, 64 and 128 per head (the prompts of RESULTS' LAVa/AdaKV ablation).

    nice -n 5 python3 benchmarks/ablation/lava_window_on_top.py      # 8 min on one core
"""
import json
from pathlib import Path

import torch

import kvcompile.reference as ref
from kvcompile.tools import cli
from kvcompile.tools.data import needle_suite
from kvcompile.tools.models import load_model

OUT = Path(__file__).resolve().parents[1] / "out" / "needle_lava_window_on_top.json"
DESIGN_SPLIT = ref.layer_totals


def window_on_top(policy, lengths, num_layers, num_heads, entropy=None, capacity=None):
    """Layer totals: every head's protected tokens, plus the rest of the budget in proportion
    to the entropies (water-filled under what each layer can still hold)."""
    budget = policy.budget
    if budget.threshold is not None or entropy is None:
        return DESIGN_SPLIT(policy, lengths, num_layers, num_heads, entropy, capacity)
    rows = []
    for b, n in enumerate(lengths.tolist()):
        protected = num_heads * min(policy.ranking.sinks + policy.ranking.window, n)
        caps = [num_heads * n] * entropy.shape[1]
        if capacity is not None:
            caps = [min(cap, int(c)) for cap, c in zip(caps, capacity[b].tolist())]
        rest = max(budget.total(n, num_heads, num_layers) - num_layers * protected, 0)
        extra = budget.layer_totals(rest, [max(c - protected, 0) for c in caps], entropy[b].tolist())
        rows.append([protected + x for x in extra])
    return torch.tensor(rows, dtype=torch.long).view(len(rows), entropy.shape[1])


def main() -> None:
    ref.layer_totals = window_on_top
    torch.set_num_threads(1)
    model, tokenizer = load_model(None)
    filler = cli.haystack()
    records = []
    for seed in [3, 4, 5, 6, 7, 8]:
        prompts = needle_suite(tokenizer, filler, [1000, 2000], [0.1, 0.3, 0.5, 0.7, 0.9], seed=seed)
        for r in cli.eval_records(model, tokenizer, prompts, ["lava"], [64, 128], 20, full=False):
            records.append(dict(r, spec="lava_window_on_top"))
    OUT.write_text(json.dumps({"needle": records}, indent=1))
    print(f"{sum(r['correct'] for r in records if r['per_head'] == 64)}/60 at 64 per head, "
          f"{sum(r['correct'] for r in records if r['per_head'] == 128)}/60 at 128; {OUT}")


if __name__ == "__main__":
    main()
