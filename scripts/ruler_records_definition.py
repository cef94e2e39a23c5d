"""Stamp the records of one spec in a RULER records file with the spec's definition (Policy.definition), for
records written before records carried it.

A spec name alone does not say what was run (a shipped spec or a part's default can change), so a run refuses
to add records of a spec to a file holding records of that name with no definition, and `kvcompile report`
refuses to pool stamped and unstamped records of one name. Stamping says: these records were made under this
definition. Only the person who knows when they were made can say so; give `--as` the spec as it was then
(a file or a shipped name with its fields as they were) when it has changed since. Records that already carry
a definition are left as they are; the file is rewritten in place through a temporary file.

    python3 scripts/ruler_records_definition.py benchmarks/ruler/heldout25_4k_seed1.jsonl --spec kvzip \
        [--as 'specs/kvzip.yaml as it was']

`--rename NEW` then gives the spec's records of another definition than the spec's now (`--as`) a name of their own (for
a spec whose definition changed: its old records keep their scores under a name that says what they are, and
the new ones take the name), so that one report reads both.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def stamp(rows: list[dict], spec: str, definition: str) -> tuple[list[dict], int]:
    """The rows with `definition` set on spec's kvcompile records that lack one, and how many were stamped."""
    out, stamped = [], 0
    for row in rows:
        if row["spec"] == spec and row.get("source", "kvcompile") == "kvcompile" and "definition" not in row:
            row = {**row, "definition": definition}
            stamped += 1
        out.append(row)
    return out, stamped


def rename(rows: list[dict], spec: str, definition: str, name: str) -> tuple[list[dict], int]:
    """The rows with spec's kvcompile records of another recorded definition than `definition` renamed `name`
    (records without one are left: stamp them first, with the definition they were made under)."""
    out, renamed = [], 0
    for row in rows:
        if row["spec"] == spec and row.get("source", "kvcompile") == "kvcompile" and \
                row.get("definition") not in (None, definition):
            row = {**row, "spec": name}
            renamed += 1
        out.append(row)
    return out, renamed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--spec", required=True, help="the spec name the records carry (their `spec` field)")
    parser.add_argument("--as", dest="as_spec", default=None,
                        help="the spec they were made with (a name, a YAML file, NAME@STORAGE); default: --spec now")
    parser.add_argument("--rename", default=None, metavar="NEW",
                        help="instead: rename the spec's records made under another definition than --as's (the spec now)")
    args = parser.parse_args(argv)
    from kvcompile.tools.ruler import eval_spec
    from kvcompile.tools.ruler_records import RecordsFile

    rows = RecordsFile(args.file).records  # a file that cannot be read is refused before anything changes
    definition = eval_spec(args.as_spec or args.spec).definition()
    if args.rename:
        rows, renamed = rename(rows, args.spec, definition, args.rename)
        what = f"{renamed} record(s) of {args.spec!r} of another definition renamed {args.rename!r}"
    else:
        rows, stamped = stamp(rows, args.spec, definition)
        what = f"{stamped} record(s) of {args.spec!r} stamped with definition {definition}"
    temporary = args.file.with_suffix(args.file.suffix + ".tmp")
    temporary.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(temporary, args.file)
    print(f"{args.file}: {what}")


if __name__ == "__main__":
    main()
