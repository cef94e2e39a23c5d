"""The RULER tables from accumulated records (`kvcompile report benchmarks/ruler/*.jsonl`): per query mode,
one row per (method, budget), each task's score and the average (the mean of the task means), each with a
paired bootstrap 95 % interval and its number of samples; then every row's difference against the full
cache and, with `--baseline NAME`, against that method at the same budget; then where the time went.

The bootstrap (Efron & Tibshirani, 1993, percentile interval): for task t with sample ids S_t (length,
seed, sample), B replicates each draw |S_t| ids from S_t with replacement; a replicate's task score is the
mean over its draws, its average the mean of its task scores; the interval is the 2.5th and 97.5th
percentiles of the B replicates. The draws depend only on (seed, task, S_t), so every row with the same
samples is resampled with the same ids: intervals and differences are paired. A difference is computed on
the samples both rows have (a row still filling up is compared on what it has; its n says so).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kvcompile.tools.ruler import budget_key, budget_text
from kvcompile.tools.ruler import sample_id as ruler_sample_id

RESAMPLES = 1000
FULL = "full"


@dataclass(frozen=True)
class Estimate:
    """A score in percent with its bootstrap interval and the samples it rests on."""

    point: float
    low: float
    high: float
    n: int

    def text(self, signed: bool = False) -> str:
        fmt = "{:+.1f}" if signed else "{:.1f}"
        return f"{fmt.format(self.point)} [{fmt.format(self.low)}, {fmt.format(self.high)}] ({self.n})"


def sample_id(r: dict) -> tuple:
    """(length, seed, the sample's number within its task: ruler.sample_id)."""
    return (r.get("length"), r.get("seed"), ruler_sample_id(r))


def table(records: list[dict]) -> dict:
    """{mode: {(method, budget key): {task: {sample id: score}}}}; a key seen twice keeps its last record."""
    out: dict = {}
    for r in records:
        row = out.setdefault(r["mode"], {}).setdefault((r["spec"], budget_key(r)), {})
        row.setdefault(r["task"], {})[sample_id(r)] = float(r["score"])
    return out


def draws(task: str, ids: list, resamples: int, seed: int) -> np.ndarray:
    """(resamples, len(ids)) positions into `ids` (sorted), drawn with replacement; the same for the same
    (seed, task, ids) whatever the row."""
    digest = hashlib.sha256(repr((task, sorted(ids))).encode()).digest()
    rng = np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])
    return rng.integers(0, len(ids), size=(resamples, len(ids)))


def estimate(values: dict, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """values {task: {sample id: score in [0, 1] (or a paired difference)}} → {task: Estimate, "average":
    Estimate} in percent; the average is the mean of the task means, resampled within each task."""
    tasks = [t for t in values if values[t]]
    out, replicates = {}, []
    for t in tasks:
        ids = sorted(values[t])
        x = 100 * np.array([values[t][i] for i in ids], dtype=np.float64)
        rep = x[draws(t, ids, resamples, seed)].mean(axis=1)
        replicates.append(rep)
        out[t] = Estimate(float(x.mean()), *_percentiles(rep), len(ids))
    if tasks:
        rep = np.mean(replicates, axis=0)
        out["average"] = Estimate(float(np.mean([out[t].point for t in tasks])), *_percentiles(rep),
                                  min(out[t].n for t in tasks))
    return out


def _percentiles(rep: np.ndarray) -> tuple[float, float]:
    low, high = np.percentile(rep, [2.5, 97.5])
    return float(low), float(high)


def paired(a: dict, b: dict) -> dict:
    """{task: {id: a − b}} over the tasks and sample ids both rows have."""
    return {t: {i: a[t][i] - b[t][i] for i in a[t].keys() & b[t].keys()} for t in a.keys() & b.keys()}


def press_labels(records: list[dict]) -> dict[str, str]:
    """{spec: its label} for the specs of these records that are a kvpress press as kvcompile reproduces it under
    their shipped name (their records' definition is the reproduction's, ruler.KVPRESS_REPRODUCTIONS):
    `kvzip = kvpress kvzip`. Rows run as `kvpress:PRESS` are named `kvpress PRESS` already."""
    from kvcompile.tools.ruler import KVPRESS_REPRODUCTIONS, eval_spec

    presses: dict = {}
    for press in KVPRESS_REPRODUCTIONS:
        presses.setdefault(eval_spec(f"kvpress:{press}").definition(), []).append(f"kvpress {press}")
    return {r["spec"]: " = ".join([r["spec"], *presses[r["definition"]]]) for r in records
            if r.get("definition") in presses and not r["spec"].startswith("kvpress ")}


def _row_label(key, labels: dict | None = None) -> tuple[str, str]:
    method, budget = key
    return (labels or {}).get(method, method), budget_text(budget)


def _order(rows) -> list:
    return sorted(rows, key=lambda k: (k[0] != FULL, k[1][0], -(k[1][1] or 0), k[0]))


def _markdown(title: str, tasks: list[str], rows: list[tuple[tuple, dict]], signed: bool,
              labels: dict | None = None) -> list[str]:
    lines = [f"\n{title}\n", "| method | budget | " + " | ".join(tasks + ["average"]) + " |",
             "|---|---|" + "---|" * (len(tasks) + 1)]
    for key, est in rows:
        method, budget = _row_label(key, labels)
        cells = [est[t].text(signed) if t in est else "-" for t in tasks + ["average"]]
        lines.append(f"| {method} | {budget} | " + " | ".join(cells) + " |")
    return lines


def report(records: list[dict], baseline: str | None = None, resamples: int = RESAMPLES, seed: int = 0) -> str:
    """The tables (markdown) of these records: scores, differences against the full cache and the baseline,
    and where the time went."""
    lines = [f"RULER score (%), mean [95 % paired bootstrap interval, {resamples} resamples, seed {seed}] "
             "(samples; for the average: the fewest of any task)"]
    data = table(records)
    labels = press_labels(records)
    for mode in ("aware", "agnostic"):
        if mode not in data:
            continue
        rows = data[mode]
        tasks = list(dict.fromkeys(t for key in _order(rows) for t in rows[key]))
        order = _order(rows)
        lines += _markdown(f"### query-{mode}: score", tasks,
                           [(k, estimate(rows[k], resamples, seed)) for k in order], False, labels)
        full = [k for k in rows if k[0] == FULL]
        if full:
            diffs = [(k, estimate(paired(rows[k], rows[full[0]]), resamples, seed)) for k in order if k[0] != FULL]
            lines += _markdown(f"### query-{mode}: difference against the full cache (same samples)", tasks,
                               diffs, True, labels)
        if baseline is not None:
            diffs = []
            for k in order:
                ref = (baseline, k[1])
                if k[0] not in (baseline, FULL) and ref in rows:
                    diffs.append((k, estimate(paired(rows[k], rows[ref]), resamples, seed)))
            lines += _markdown(f"### query-{mode}: difference against {baseline} at the same budget (same samples)",
                               tasks, diffs, True, labels)
    lines += time_table(records)
    return "\n".join(lines)


def verdict(records: list[dict], baseline: str, resamples: int = RESAMPLES, seed: int = 0) -> str:
    """The verdict's layout (`kvcompile report --verdict --baseline NAME`): one table per kind of budget (the share
    of the entries kept, then the share of the full cache's bytes), a row per method and a column per (query mode,
    budget), each cell the row's average [interval] (n) and its paired difference against `baseline` at the same
    budget, mode and samples; the full cache's average in every column of its mode. The same estimates as
    `report`'s average column and its baseline differences."""
    data = table(records)
    labels = press_labels(records)
    modes = [m for m in ("agnostic", "aware") if m in data]
    full = {m: next((estimate(rows, resamples, seed)["average"].text() for (method, _), rows in data[m].items()
                     if method == FULL), "") for m in modes}  # its average, in every column of its mode
    lines = [f"RULER average (%), mean [95 % paired bootstrap interval, {resamples} resamples, seed {seed}] (the "
             f"fewest samples of any task); then the paired difference against {baseline} at the same budget"]
    for kind, title in (("fraction", "entries"), ("bytes", "bytes")):
        budgets = sorted({k[1] for m in modes for k in data[m] if k[1][0] == kind}, key=lambda b: -b[1])
        columns = [(m, b) for m in modes for b in budgets if any(k[1] == b for k in data[m])]
        if not columns:
            continue
        methods = sorted({k[0] for m, b in columns for k in data[m] if k[1] == b and k[0] != FULL})
        lines += ["", f"| method ({title}) | " + " | ".join(f"{m} {budget_text(b)}" for m, b in columns) + " |",
                  "|---|" + "---|" * len(columns)]
        lines.append("| full cache | " + " | ".join(full[m] for m, _ in columns) + " |")
        for method in methods:
            cells = []
            for m, b in columns:
                rows = data[m]
                if (method, b) not in rows:
                    cells.append("")
                    continue
                cell = estimate(rows[(method, b)], resamples, seed)["average"].text()
                if method != baseline and (baseline, b) in rows:
                    diff = estimate(paired(rows[(method, b)], rows[(baseline, b)]), resamples, seed)
                    cell += f"; {diff['average'].text(signed=True)} vs {baseline}" if diff else ""
                cells.append(cell)
            lines.append(f"| {labels.get(method, method)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_table(records: list[dict]) -> list[str]:
    """Seconds per record by phase (prefill or capture, compression, the question and decode), wall and CPU,
    per row, and the answer tokens generated: what each variant of a sample costs."""
    sums: dict = {}
    for r in records:
        if not r.get("seconds"):
            continue
        acc = sums.setdefault((r["mode"], r["spec"], budget_key(r)), {"n": 0, "tokens": 0, "wall": [0.0] * 3,
                                                                      "cpu": [0.0] * 3})
        acc["n"] += 1
        acc["tokens"] += r.get("new_tokens") or 0
        for kind, field in (("wall", "seconds"), ("cpu", "cpu_seconds")):
            for i, phase in enumerate(("prefill", "compress", "decode")):
                acc[kind][i] += (r.get(field) or {}).get(phase, 0.0)
    if not sums:
        return []
    lines = ["\n### where the time went: seconds per record, wall (CPU of the process, all threads); prefill: the "
             "context's prefill or capture, paid once per sample and mode by its first record; compress: scoring, "
             "selection and merging (KVzip's reconstruction included), paid once per context by the spec's first "
             "record; decode: the question's forward and the greedy answer\n",
             "| mode | method | budget | records | prefill | compress | decode | answer tokens |",
             "|---|---|---|---|---|---|---|---|"]
    wall = cpu = 0.0
    for (mode, method, budget), acc in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1] != FULL, kv[0][1],
                                                                          str(kv[0][2]))):
        n = acc["n"]
        wall += sum(acc["wall"])
        cpu += sum(acc["cpu"])
        phases = " | ".join(f"{w / n:.2f} ({c / n:.2f})" for w, c in zip(acc["wall"], acc["cpu"]))
        lines.append(f"| {mode} | {method} | {budget_text(budget)} | {n} | {phases} | {acc['tokens'] / n:.1f} |")
    units = {(r["mode"], r["task"], sample_id(r)) for r in records if r.get("seconds")}
    lines.append(f"\ntotal {wall / 3600:.2f} hours wall, {cpu / 3600:.2f} CPU-hours, over "
                 f"{sum(v['n'] for v in sums.values())} records of {len(units)} samples and modes: "
                 f"{cpu / len(units):.0f} CPU-s a sample and mode for the rows it holds")
    return lines
