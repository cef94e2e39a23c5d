"""Number the records of a RULER records file by their sample within its task (`sample`), for files written
before records carried that number.

Such a record's `index` was its row's number in the run that wrote it, which depends on --samples and
--tasks: `--samples 5` named niah_single_2's first sample index 5, `--samples 10` index 10, so a file grown
by `--samples 5`, then 10, held the same sample twice under two keys (and `kvcompile report` counted it
twice). A generated sample is the same text for (task, length, seed, sample) whatever else a run makes, so
each record's sample is found by regenerating its task's samples and matching the record's gold answers
(they are drawn at random per sample; a record whose answers match no sample, or several, is an error).
A sample recorded twice under one spec, budget and mode keeps its first record; the rest are dropped and
counted. The file is rewritten in place (through a temporary file); a file already numbered is unchanged.

    python3 scripts/ruler_records_sample.py benchmarks/ruler/full_4k_seed0.jsonl [--search 40]
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path


def number(rows: list[dict], generate, search: int) -> tuple[list[dict], int]:
    """The rows with `sample` set (rows without a seed, from a dataset file, as they are) and the number of
    duplicates dropped. `generate(task, length, seed, i)` gives sample i's gold answers."""
    from kvcompile.tools.ruler import record_key

    found: dict[tuple, dict[tuple, int]] = {}
    out, seen, dropped = [], set(), 0
    for row in rows:
        if row.get("seed") is not None and "sample" not in row:
            group = (row["task"], row["length"], row["seed"])
            if group not in found:
                found[group] = defaultdict(list)
                for i in range(search):
                    found[group][tuple(generate(*group, i))].append(i)
            matches = found[group].get(tuple(row["answers"]), [])
            if len(matches) != 1:
                what = f"samples {matches}" if matches else f"no sample (give a larger --search than {search})"
                raise SystemExit(f"{row['task']} index {row['index']}: its answers match {what}")
            row = {**row, "sample": matches[0]}
        key = json.dumps(record_key(row))
        if key in seen:
            dropped += 1
            continue
        seen.add(key)
        out.append(row)
    return out, dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--search", type=int, default=40, help="samples per task to regenerate (default 40)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from kvcompile.tools.data import load_haystack
    from kvcompile.tools.ruler import generate_sample

    filler, tokenizers = load_haystack(), {}

    for path in args.files:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

        def generate(task, length, seed, i, model=rows[0].get("model") if rows else None):
            if model not in tokenizers:
                tokenizers[model] = AutoTokenizer.from_pretrained(model)
            return generate_sample(tokenizers[model], task, length, seed, i, filler)["answers"]

        out, dropped = number(rows, generate, args.search)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
        os.replace(tmp, path)
        print(f"{path}: {len(rows)} records, {len(out)} kept, {dropped} duplicates of a sample dropped")


if __name__ == "__main__":
    main()
