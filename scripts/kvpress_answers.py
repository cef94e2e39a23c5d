"""kvpress's own answers against kvcompile's, sample by sample (the direct end-to-end check of the reproduced presses).

kvpress's side: `scripts/kvpress_compare.py ruler` in kvpress's venv on a dumped RULER dataset (its records name the
dataset row, `index`); kvcompile's side: `kvcompile eval --suite ruler --resume` records (task, sample, spec, fraction).
A pair agrees when the two predictions are equal over their common prefix: kvcompile stops at the end of the answer
("answered"), kvpress's pipeline at the task's token bound.

    python3 scripts/kvpress_answers.py --samples S.jsonl --kvpress KVPRESS.jsonl RECORDS.jsonl [RECORDS.jsonl ...]
"""
from __future__ import annotations

import argparse
import json



def specs_of(press: str) -> list[str]:
    """The names kvcompile's records of kvpress's `press` (kvpress_compare.py's registry name) carry: `kvpress PRESS`
    (`kvcompile eval --specs kvpress:PRESS`), and the shipped spec's own name where it reproduces the press as it is
    (kvcompile.tools.ruler.KVPRESS_REPRODUCTIONS)."""
    from kvcompile.tools.ruler import KVPRESS_REPRODUCTIONS

    if press == "full":
        return ["full"]
    spec, overrides = KVPRESS_REPRODUCTIONS[press]
    return [f"kvpress {press}"] + ([] if overrides else [spec])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", required=True, help="the dataset both sides answered (--dump-dataset)")
    parser.add_argument("--kvpress", required=True, help="kvpress_compare.py ruler's predictions")
    parser.add_argument("--seed", type=int, default=0, help="the dataset's seed (default 0)")
    parser.add_argument("records", nargs="+", help="kvcompile eval --resume files")
    args = parser.parse_args()
    rows = {r["index"]: r for r in map(json.loads, open(args.samples))}
    ours = {}
    for path in args.records:
        for r in map(json.loads, open(path)):
            if r["seed"] == args.seed:
                ours[(r["mode"], r["task"], r["sample"], r["spec"], r.get("fraction"))] = r
    agree = differ = missing = 0
    for k in map(json.loads, open(args.kvpress)):
        row = rows[k["index"]]
        fraction = None if k["method"] == "kvpress:full" else k["fraction"]
        found = [(spec, ours.get((k["mode"], row["task"], row["sample"], spec, fraction)))
                 for spec in specs_of(k["method"].split(":", 1)[1])]
        spec, mine = next(((s, r) for s, r in found if r is not None), found[0])
        if mine is None:
            missing += 1
            continue
        a, b = k["prediction"].strip(), mine["prediction"].strip()
        n = min(len(a), len(b))
        same = a[:n] == b[:n]
        agree += same
        differ += not same
        print(f"{'agree ' if same else 'DIFFER'} {k['mode']} {row['task']} #{row['sample']} {spec}: kvpress {a[:40]!r} "
              f"kvcompile {b[:40]!r}")
    print(f"{agree} agree, {differ} differ, {missing} without a kvcompile record")


if __name__ == "__main__":
    main()
