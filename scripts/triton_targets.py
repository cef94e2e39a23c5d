"""Registers, shared memory, stack and spills of every Triton kernel of kvcompile, compiled
for NVIDIA targets on this machine (no GPU needed): kvcompile/kernels/targets.py.

    python3 scripts/triton_targets.py                      # sm_80 and sm_90, bf16 and fp16
    python3 scripts/triton_targets.py --arch 90 --dtypes bf16 --json usage.json

One process per (target, dtype), --jobs at once. Shared memory is what a block uses
(Triton's dynamic shared memory + the cubin's static), against the target's per-block limit.
"""
import argparse
import concurrent.futures
import json
import os

from kvcompile.kernels import targets

COLUMNS = [("kernel", "kernel", "{}"), ("case", "case", "{}"), ("arch", "target", "{}"),
           ("dtype", "dtype", "{}"), ("num_warps", "warps", "{}"), ("num_stages", "stages", "{}"),
           ("registers", "regs", "{}"), ("shared", "shared KB", "{:.1f}"), ("stack", "stack B", "{}"),
           ("local", "local B", "{}"), ("spills", "spill st/ld B", "{}")]


def cells(row: dict) -> list[str]:
    if "error" in row:
        return [row["kernel"], row["case"], row["arch"], row["dtype"], "compile error: " + row["error"][:80]]
    values = dict(row, shared=row["shared"] / 1024, spills=f"{row['spill_stores']}/{row['spill_loads']}")
    return [fmt.format(values[key]) for key, _, fmt in COLUMNS]


def table(rows: list[dict]) -> str:
    lines = [[title for _, title, _ in COLUMNS]] + [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(COLUMNS))]
    return "\n".join(" | ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Triton kernels of kvcompile on GPU targets (no GPU needed)")
    parser.add_argument("--arch", type=int, nargs="+", choices=targets.ARCHS, default=list(targets.ARCHS))
    parser.add_argument("--dtypes", nargs="+", choices=tuple(targets.DTYPES), default=list(targets.DTYPES))
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="processes at once")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    jobs = [(arch, (dtype,)) for arch in args.arch for dtype in args.dtypes]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = [row for report in pool.map(lambda job: targets.run_report(*job), jobs) for row in report]
    print(table(rows))
    worst = {a: max((r["shared"] for r in rows if r["arch"] == f"sm_{a}" and "error" not in r), default=0)
             for a in args.arch}
    print("shared memory limit per block: " + ", ".join(
        f"sm_{a} {targets.SHARED_PER_BLOCK[a] / 1024:.0f} KB (largest here {worst[a] / 1024:.1f} KB)" for a in args.arch))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
