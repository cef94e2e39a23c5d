"""A RULER table that accumulates (`kvcompile eval --suite ruler --resume PATH`): one JSON line per
(task, sample within its task, seed, length, spec, budget, query mode), appended as soon as it is scored and
flushed to disk (fsync), so an interrupted run loses only the record in flight; a later run with the
same file skips every key it holds. A last line cut short by a kill (no newline, not JSON) is dropped
when the file is opened again; a bad line anywhere else is an error naming the file and the line.

Each record of a policy carries its `definition` (Policy.definition: a digest of what the spec computes).
A spec name alone does not say what was run: a shipped spec or a part's default can change between
sessions. A run refuses to add records of a spec to a file whose records of that name were made under
another definition, or under an unrecorded one (records written before they carried it), and the report
refuses to pool them, so a row never mixes two definitions. Likewise a run refuses to add records to a file of
another model, and the report to pool two models' files (model_identity).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvcompile.tools.ruler import record_key, variant_key  # noqa: F401 (the key, re-exported)


class RecordsError(ValueError):
    """A records file that cannot be resumed (the message names the file and the line)."""


def unnumbered(path, number: int, row: dict) -> RecordsError | None:
    """A record of generated samples (it has a seed) written before records named their sample within its task
    (`sample`): its `index` was the row's number in that run, which depends on --samples and --tasks, so it
    cannot be matched with other runs' records; scripts/ruler_records_sample.py numbers such a file's records."""
    if row.get("seed") is not None and "sample" not in row:
        return RecordsError(f"{path}, line {number}: a record of a generated sample without its `sample` number "
                            "(written before records named their sample within its task); number them first: "
                            f"python3 scripts/ruler_records_sample.py {path}")
    return None


def model_identity(model: str | None) -> str | None:
    """What a record's `model` (the checkpoint folder it was made with) names: an embedded model's converted folder
    (`.../models/<name>`, whatever checkout or $KVCOMPILE_HOME holds it) is that model's name, so that records made
    in one checkout resume and pool with another's; any other folder is itself."""
    from kvcompile.tools.models import EMBEDDED

    if model is None:
        return None
    path = Path(model)
    return path.name if path.parent.name == "models" and path.name in EMBEDDED else str(model)


def _json_key(key: tuple) -> str:
    return json.dumps(key)


class RecordsFile:
    """The records of one JSONL file: `records` (in file order), `has(key)`, `append(record)`."""

    def __init__(self, path, model: str | None = None):
        self.path = Path(path)
        self.records: list[dict] = []
        self._keys: set[str] = set()
        self._lines: list[int] = []  # each record's line number in the file
        self.repaired = False
        if self.path.exists():
            self._read(model)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _read(self, model) -> None:
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        complete = lines[:-1]  # every line that ended with a newline
        tail = lines[-1]
        if tail.strip():  # the last line has no newline: a write cut short, or a whole record
            try:
                row = json.loads(tail)
            except ValueError:
                row = None
            if isinstance(row, dict):
                complete.append(tail)
                with open(self.path, "ab") as f:  # finish the line so that appends start on a new one
                    f.write(b"\n")
            else:
                with open(self.path, "r+b") as f:  # drop the partial line
                    f.truncate(len(raw) - len(tail))
                self.repaired = True
        for number, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise RecordsError(f"{self.path}, line {number}: not JSON ({exc}); only a cut-off last line is "
                                   "dropped by itself") from None
            missing = [k for k in ("task", "index", "length", "spec", "mode", "fraction", "score", "prediction")
                       if not isinstance(row, dict) or k not in row]
            if missing:
                raise RecordsError(f"{self.path}, line {number}: missing field(s) {', '.join(missing)}")
            if (error := unnumbered(self.path, number, row)) is not None:
                raise error
            if model is not None and model_identity(row.get("model")) not in (None, model_identity(model)):
                raise RecordsError(f"{self.path}, line {number}: a record of model {row.get('model')!r}; this run is "
                                   f"{model!r}: resume into another file")
            self.records.append(row)
            self._lines.append(number)
            self._keys.add(_json_key(record_key(row)))

    def check_definitions(self, definitions: dict[str, str]) -> None:
        """RecordsError naming the first record of a spec in `definitions` ({spec name: Policy.definition()},
        the specs this run will add) made under another definition or an unrecorded one: adding this run's
        records would pool two definitions under one name."""
        for number, row in zip(self._lines, self.records):
            want = definitions.get(row["spec"])
            if want is None or row.get("source", "kvcompile") != "kvcompile" or row.get("definition") == want:
                continue
            have = row.get("definition")
            why = (f"under another definition of it (digest {have}; the spec now has {want}: a field or a part's "
                   "default changed since)") if have else \
                "before records carried their spec's definition, so whether the spec changed since is unknown"
            stamp = "" if have else (f"; if it is unchanged since they were made, stamp them: python3 "
                                     f"scripts/ruler_records_definition.py {self.path} --spec {row['spec']}")
            raise RecordsError(f"{self.path}, line {number}: a record of spec {row['spec']!r} made {why}. This run's "
                               f"records would be pooled with it under one name: resume into another file{stamp}")

    def has(self, key: tuple) -> bool:
        return _json_key(key) in self._keys

    def append(self, record: dict) -> None:
        """Write one record as a line, flushed and fsync'ed before this returns."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)
        self._lines.append((self._lines[-1] if self._lines else 0) + 1)
        self._keys.add(_json_key(record_key(record)))


def read_records(paths) -> list[dict]:
    """Every record of these JSONL files (a cut-off last line is skipped, not repaired: read-only); RecordsError
    for records of two models (model_identity), which one table would pool."""
    out = []
    models: dict = {}  # each model's first record
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise RecordsError(f"{path}: no such file")
        lines = path.read_text(encoding="utf-8").split("\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                if number == len(lines):  # the last line, cut off by a kill: its run resumes it
                    continue
                raise RecordsError(f"{path}, line {number}: not JSON ({exc})") from None
            if not isinstance(row, dict) or any(k not in row for k in ("task", "index", "spec", "mode", "score")):
                raise RecordsError(f"{path}, line {number}: not a RULER record (task, index, spec, mode, score)")
            if (error := unnumbered(path, number, row)) is not None:
                raise error
            out.append(row)
            models.setdefault(model_identity(row.get("model")), f"{path}, line {number}")
    models.pop(None, None)  # records written before records named their model
    if len(models) > 1:
        (a, where_a), (b, where_b) = list(models.items())[:2]
        raise RecordsError(f"records of {len(models)} models: {a!r} ({where_a}) and {b!r} ({where_b}); a table "
                           "pools the records it is given, so report one model's files at a time")
    check_one_definition(out)
    return out


def check_one_definition(records: list[dict]) -> None:
    """RecordsError when records of one spec name were made under two definitions (Policy.definition; None for
    records written before records carried it): a table would pool them as one row."""
    seen: dict[str, set] = {}
    for row in records:
        if row["spec"] != "full" and row.get("source", "kvcompile") == "kvcompile":
            seen.setdefault(row["spec"], set()).add(row.get("definition"))
    mixed = {spec: kinds for spec, kinds in seen.items() if len(kinds) > 1}
    if mixed:
        spec, kinds = next(iter(mixed.items()))
        names = ", ".join(sorted("unrecorded" if k is None else k for k in kinds))
        raise RecordsError(f"records of spec {spec!r} were made under {len(kinds)} definitions ({names}): one row "
                           "would pool them; give the files of one definition, or rename the spec of the others")
