"""One layer of the batched decode step (kvcompile.engine.batch: `DecodeBatch.make`, then `run`) for R requests over one
page pool, by each step a plain policy could run on the batch: `append+attend` (what the serving engine runs: the
store's append as one C++ call, `store.pages.CppAppend`, then the paged C++ attention kernel), `torch append+attend`
(the store's append in torch ops, then the same kernel) and `fused` (the plan's C++ step for fp32 pages,
`CppAppendStep`: the append and the same kernel in one call).
Printed: the torch operators one layer dispatches (a C++ kernel's call is not one), and the median µs per layer and
step (its batch made, then run) over `--rounds` interleaved rounds of 20 steps each, wall and CPU time of the thread
(with one thread, the steadier measure on a loaded machine), with the load average.

    PYTHONPATH=. nice python3 benchmarks/bench_batched_step.py [--requests 16] [--entries 120] [--rounds 30]
"""
from __future__ import annotations

import argparse
import statistics
import time
import types
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcompile.engine import batch as engine_batch
from kvcompile.kernels import paged_attention
from kvcompile.kernels.append_step import FLOAT
from kvcompile.engine.online import TorchStep
from kvcompile.store.pages import CppAppend, CppAppendStep, Entries, LayerStore
from kvcompile.store.pool import PagePools


class Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Cache:
    """What DecodeBatch.make and run read of a request's cache."""

    def __init__(self, store, plan, length):
        self.stores, self.plan, self.seq_length = [store], plan, length
        self.decoding = types.SimpleNamespace(pad=torch.zeros(1, dtype=torch.long))

    def count_host_sync(self, name):
        pass

    def advance(self, n):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--entries", type=int, default=120, help="entries per head after the prompt")
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    r, h, g, d, n = args.requests, args.heads, args.group, args.head_dim, args.entries
    attention = paged_attention.backend("cpp")
    plan = types.SimpleNamespace(spare_pages=1, num_layers=1, online_eviction=False, running_scores=False,
                                 merge_bias=lambda counts: None, layer_sinks=lambda layer, device: None,
                                 decode_attention=attention, decode_backend=lambda layer, device: attention)
    gen = torch.Generator().manual_seed(0)
    prompts = [(torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)) for _ in range(r)]
    steps = {"append+attend": TorchStep(append=CppAppend()), "torch append+attend": TorchStep(),
             "fused": CppAppendStep(FLOAT, 0)}

    def make(kind):
        """Fresh requests in a fresh pool, and a function that runs one step of them (made, then run)."""
        pools = PagePools(1)
        caches = []
        for keys, values in prompts:
            entries = Entries(keys, values, torch.zeros(1, h, n), torch.arange(n).expand(1, h, n).clone(), torch.ones(1, h, n),
                              torch.ones(1, h, n, dtype=torch.bool))
            store = LayerStore.build([entries], torch.zeros(1, h, dtype=torch.long), 16, 1)
            caches.append(Cache(pools.adopt(0, store), plan, n + 5))
        tables = [None]

        def step():
            batch, _ = engine_batch.DecodeBatch.make(caches, list(range(r)), Counter(), tables, False, steps[kind])
            return batch.run(0, q, k, v, 0.125)
        return step

    # (1, heads, R, d) views of (1, R, heads, d), as a model's projections hand them to its attention
    q, k, v = (torch.randn(1, r, x, d).transpose(1, 2) for x in (h * g, h, h))
    kinds = list(steps)
    for kind in kinds:
        step = make(kind)
        step()  # builds the block table
        with Operators() as ops:
            step()
        print(f"{kind}: {sum(ops.counts.values())} torch operators a layer: {dict(sorted(ops.counts.items()))}")
    times, cpu_times = {kind: [] for kind in kinds}, {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            step = make(kind)
            step()
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(20):  # within the pages the heads own (no page taken)
                step()
            times[kind].append((time.perf_counter() - start) / 20 * 1e6)
            cpu_times[kind].append((time.thread_time() - cpu) / 20 * 1e6)
    print(f"{r} requests, {n} entries a head, {args.threads} thread(s): median µs "
          "a layer [min, max], wall: " + ", ".join(f"{kind} {statistics.median(t):.0f} [{min(t):.0f}, {max(t):.0f}]"
                                                  for kind, t in times.items())
          + "; CPU (this thread): " + ", ".join(f"{kind} {statistics.median(t):.0f} [{min(t):.0f}, {max(t):.0f}]"
                                                for kind, t in cpu_times.items())
          + f"; load {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
