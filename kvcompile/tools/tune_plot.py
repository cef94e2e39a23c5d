"""`kvcompile tune`'s plot: score against KV bytes, with the Pareto front, the shipped specs and the
reproductions of kvpress's presses marked.

A point is one policy scored on the calibration samples: its x is the KV bytes its budget holds, as a share
of the full cache's key and value bytes (mean over the samples), its y the search's proxy (the mean log p of
the gold answer). Only points scored on every calibration sample are comparable, so only they make the
Pareto front (no other point holds as few bytes or fewer and scores as well or better, one of them strictly);
candidates that successive halving dropped after fewer samples are drawn faint and left out of the front.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KINDS = ("candidate", "shipped", "kvpress")


@dataclass(frozen=True)
class Point:
    label: str
    kv_bytes: float  # share of the full cache's key and value bytes
    score: float
    kind: str = "candidate"  # candidate (of the search) | shipped (spec) | kvpress (a press's reproduction)
    complete: bool = True  # scored on every calibration sample (only these make the front)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"tune plot: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


def pareto_front(points) -> list[Point]:
    """The complete points no other complete point dominates (fewer or equal bytes and a higher or equal score,
    one of them strictly), by bytes ascending. Points equal in both are all kept."""
    pts = [p for p in points if p.complete]
    front = []
    for p in pts:
        if not any((q.kv_bytes <= p.kv_bytes and q.score >= p.score) and (q.kv_bytes < p.kv_bytes or q.score > p.score)
                   for q in pts):
            front.append(p)
    return sorted(front, key=lambda p: (p.kv_bytes, -p.score))


def labels(points, x_span: float, y_span: float, near: float = 0.03, line: float = 8.0) -> list[tuple[str, float, float, float]]:
    """The annotations of the labelled points (shipped specs and presses, complete ones): points at the same place
    (bytes and score equal to 4 decimals) share one label, names joined by " = "; a label whose point lies within
    `near` of the axes' spans from an earlier one's (by bytes, then score) is moved up by `line` points per label
    already there, so labels at equal bytes stack instead of overlapping. Returns (text, x, y, offset up in points)."""
    groups: dict[tuple[float, float], list[str]] = {}
    for p in points:
        if p.kind != "candidate" and p.complete:
            groups.setdefault((round(p.kv_bytes, 4), round(p.score, 4)), []).append(p.label)
    placed: list[tuple[str, float, float, float]] = []
    for (x, y), names in sorted(groups.items()):
        crowd = sum(1 for _, px, py, _ in placed
                    if abs(px - x) <= near * (x_span or 1.0) and abs(py - y) <= near * (y_span or 1.0) * 4)
        placed.append((" = ".join(dict.fromkeys(names)), x, y, 3.0 + crowd * line))
    return placed


def plot(points, path, title: str, best: str | None = None) -> Path:
    """Write the PNG: candidates (faint where not scored on every sample), shipped specs and kvpress's presses
    with their labels, the Pareto front as a step line, and the chosen candidate (`best`, a label) circled."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    points = list(points)
    if not points:
        raise ValueError("tune plot: no points to draw")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {"candidate": dict(marker="o", color="tab:blue", s=18),
              "shipped": dict(marker="s", color="tab:green", s=36),
              "kvpress": dict(marker="^", color="tab:red", s=44)}
    names = {"candidate": "tune candidates", "shipped": "shipped specs", "kvpress": "kvpress presses (reproduced)"}
    for kind in KINDS:
        for complete in (True, False):
            group = [p for p in points if p.kind == kind and p.complete == complete]
            if group:
                ax.scatter([p.kv_bytes for p in group], [p.score for p in group], alpha=1.0 if complete else 0.25,
                           label=names[kind] + ("" if complete else " (fewer samples)"), **styles[kind])
    xs, ys = [p.kv_bytes for p in points], [p.score for p in points]
    for text, x, y, up in labels(points, max(xs) - min(xs), max(ys) - min(ys)):
        ax.annotate(text, (x, y), fontsize=6, xytext=(3, up), textcoords="offset points")
    front = pareto_front(points)
    if front:
        ax.step([p.kv_bytes for p in front], [p.score for p in front], where="post", color="black", lw=1,
                label="Pareto front")
    chosen = [p for p in points if p.label == best]
    if chosen:
        ax.scatter([chosen[0].kv_bytes], [chosen[0].score], s=160, facecolors="none", edgecolors="black",
                   label="chosen")
    ax.set_xlabel("KV bytes (share of the full cache)")
    ax.set_ylabel("proxy: mean log p of the gold answer")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
