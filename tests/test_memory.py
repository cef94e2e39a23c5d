"""Peak memory of a prefill with compression against the uncompressed run.

torch's CPU allocator keeps no statistics, so each run happens in a fresh process and
we read its peak resident set size (VmHWM): both runs pay the same imports and
weights, and the difference is the KV cache and what is built around it. glibc is told
to serve every allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed
tensors leave the resident set at once and the peak follows the live tensors.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from lane import Job, Lane

CHILD = r"""
import json, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from tiny import tiny_model, prompt
import kvcompile
model = tiny_model("llama", layers=8, heads=8, kv_heads=8, head_dim=64)
ids = prompt(4096, seed=3)
mode = sys.argv[1]
with torch.no_grad():
    if mode == "nocache":
        out = model(ids, use_cache=False)
        held = 0
    elif mode == "full":
        out = model(ids, use_cache=True)
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.past_key_values.layers)
    else:
        kvcompile.compile(model, mode, per_head=64)
        out = model(ids)
        held = out.past_key_values.memory_report()["bytes_held"]
# VmHWM: the peak resident set of this process image (ru_maxrss would carry the parent's over exec)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"peak_kb": peak, "held": held}}))
"""


SPECS = ["snapkv", "lava"]


def job(mode: str) -> Job:
    """The child process of one mode: "full", "nocache" or a spec's name."""
    code = CHILD.format(tests=str(Path(__file__).parent))
    return Job([sys.executable, "-c", code, mode], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
               str(Path(__file__).resolve().parent.parent), 600)


def queue_runs(lane: Lane, selected: set[str]) -> None:
    """The child processes, into the suite's background lane (tests/conftest.py, tests/lane.py): each measures
    its own peak, whatever runs beside it."""
    if "test_prefill_peak_memory_below_full_cache" in selected:
        for mode in ["full", "nocache", *SPECS]:
            lane.queue(f"memory:{mode}", job(mode))


def peak(lane: Lane, mode: str) -> dict:
    run = lane.result(f"memory:{mode}", job(mode))  # once per session: the lane keeps the result
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spec", SPECS)
def test_prefill_peak_memory_below_full_cache(spec, lane):
    full, compressed, nocache = peak(lane, "full"), peak(lane, spec), peak(lane, "nocache")
    evicted = full["held"] - compressed["held"]
    assert evicted > 100e6  # 8 layers x 8 heads x 4096 tokens x 64 x 2 x 4 bytes = 134 MB, minus what is kept
    saved = (full["peak_kb"] - compressed["peak_kb"]) * 1024
    # The compressed prefill never holds more than one layer's full KV: at least half of
    # what it evicts must show as a lower peak.
    assert saved > 0.5 * evicted, (full, compressed)
    # ... and beyond a forward pass that keeps no cache at all, it holds about one layer's
    # K and V (16.8 MB here) plus what it keeps.
    layer_kv = full["held"] / 8
    assert (compressed["peak_kb"] - nocache["peak_kb"]) * 1024 < 2 * layer_kv + compressed["held"], (
        compressed, nocache)
