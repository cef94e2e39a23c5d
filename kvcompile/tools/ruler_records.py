"""A RULER table that accumulates (`kvcompile eval --suite ruler --resume PATH`): one JSON line per
(task, sample within its task, seed, length, spec, budget, query mode), appended as soon as it is scored and
flushed to disk (fsync), so an interrupted run loses only the record in flight; a later run with the
same file skips every key it holds. A last line cut short by a kill (no newline, not JSON) is dropped
when the file is opened again; a bad line anywhere else is an error naming the file and the line.
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


def _json_key(key: tuple) -> str:
    return json.dumps(key)


class RecordsFile:
    """The records of one JSONL file: `records` (in file order), `has(key)`, `append(record)`."""

    def __init__(self, path, model: str | None = None):
        self.path = Path(path)
        self.records: list[dict] = []
        self._keys: set[str] = set()
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
            if model is not None and row.get("model") not in (None, model):
                raise RecordsError(f"{self.path}, line {number}: a record of model {row.get('model')!r}; this run is "
                                   f"{model!r}: resume into another file")
            self.records.append(row)
            self._keys.add(_json_key(record_key(row)))

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
        self._keys.add(_json_key(record_key(record)))


def read_records(paths) -> list[dict]:
    """Every record of these JSONL files (a cut-off last line is skipped, not repaired: read-only)."""
    out = []
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
    return out
