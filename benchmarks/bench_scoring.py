"""Compression overhead of one layer at prefill, against that layer's own attention.

At N prompt tokens (default 4096; H=3 KV heads, G=3, d=64, fp32, as SmolLM2-135M),
times the layer's causal prefill attention (F.scaled_dot_product_attention) and, beside
it, what compression adds: window scoring (SnapKV's and LAVa's, by the eager reference,
the torch lowering and the lowering compiled by Inductor), selection of 128 tokens per
head (the reference `select`, a plain top-k + gather of the kept rows, and the selection
kernels' torch lowering + the gather into pages, kvcompile.kernels.select, for SnapKV's
uniform heads, AdaKV's pooled top-k and DBudgetKV's threshold), and the ZSMerge residual
merge of the evicted tokens. Prints ms per call and % of the SDPA time.

    python3 benchmarks/bench_scoring.py [--tokens 4096] [--repeat 7] [--threads N]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kvcompile import reference
from kvcompile.store import Entries, LayerStore
from kvcompile.selection import select_with
from kvcompile.kernels import select as ks
from kvcompile.kernels.merge import merge_order, residual_merge
from kvcompile.kernels.window_scores import score_fused
from kvcompile.policies.scoring import Lava, Pooling, WindowAttention
from kvcompile.spec import load_spec

from bench_decode import timed  # benchmarks/ is the script's folder, so on sys.path


def topk_gather(scores, keys, values, budget: int, window: int):
    """Keep the last `window` tokens and the best others up to `budget` per head; gather them."""
    protected = scores.clone()
    protected[..., -window:] = float("inf")
    kept = protected.topk(budget, dim=-1).indices.sort(dim=-1).values  # (B, H, budget)
    index = kept[..., None].expand(-1, -1, -1, keys.shape[-1])
    return keys.gather(2, index), values.gather(2, index)


def select_gather(policy, scores, keys, values, positions, valid, lengths, total, impl="torch"):
    """The prefill path's selection kernel, then the kept rows written into fresh pages."""
    selection = ks.backend_for(impl, scores)
    kept = select_with(selection, policy, scores, positions, valid, lengths, total, 2)
    rows = Entries(keys, values, scores, positions, torch.ones_like(scores), kept)
    return LayerStore.build([rows], torch.zeros_like(lengths[:, None].expand(kept.shape[:2])), 16, 0,
                            gather=selection.gather_pages)


def reference_select_store(policy, scores, keys, values, positions, valid, lengths, total):
    """The same with reference.select and the plain row write (the path before the kernels)."""
    kept = reference.select(policy, scores, positions, valid, lengths, total, 2)
    rows = Entries(keys, values, scores, positions, torch.ones_like(scores), kept)
    return LayerStore.build([rows], torch.zeros_like(lengths[:, None].expand(kept.shape[:2])), 16, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=3, help="KV heads")
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--budget", type=int, default=128, help="tokens kept per KV head")
    parser.add_argument("--slots", type=int, default=16, help="ZSMerge residual slots per head")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    n, h, g, d = args.tokens, args.heads, args.group, args.dim
    q = torch.randn(1, h * g, n, d, generator=gen)
    k = torch.randn(1, h, n, d, generator=gen)
    v = torch.randn(1, h, n, d, generator=gen)
    snapkv = WindowAttention(window=32, pooling=Pooling(kind="avg", kernel=5), gqa="mean")
    lava = Lava(window=32, pooling=Pooling(kind="max", kernel=7), gqa="max")
    state = reference.LayerState(queries=q[:, :, -32:], keys=k, values=v)
    policy = load_spec("specs/snapkv.yaml")
    adakv, dbudgetkv = load_spec("specs/adakv.yaml"), load_spec("specs/dbudgetkv.yaml")
    scores = snapkv.score(state)
    positions = torch.arange(n).expand(1, h, n)
    valid = torch.ones(1, h, n, dtype=torch.bool)
    lengths, total = torch.tensor([n]), torch.tensor([args.budget * h])
    kept = reference.select(policy, scores, positions, valid, lengths, total, 0)
    evicted_k, evicted_v, num = merge_order(k, v, scores, valid & ~kept)
    empty = (torch.zeros(1, h, args.slots, d), torch.zeros(1, h, args.slots, d),
             torch.zeros(1, h, args.slots, dtype=torch.long))
    rows = {
        "prefill SDPA (causal, GQA)": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True),
        "snapkv score: reference": lambda: snapkv.score(state),
        "snapkv score: lowering, eager": lambda: score_fused(snapkv, state),
        "snapkv score: lowering, compiled": lambda: score_fused(snapkv, state, impl="compiled"),
        "lava score: reference": lambda: lava.score(state),
        "lava score: lowering, eager": lambda: score_fused(lava, state),
        "lava score: lowering, compiled": lambda: score_fused(lava, state, impl="compiled"),
        f"select {args.budget}/head: reference": lambda: reference.select(
            policy, scores, positions, valid, lengths, total, 0),
        f"select {args.budget}/head: top-k + gather": lambda: topk_gather(
            scores, k, v, args.budget, 32),
        f"select + store {args.budget}/head: reference": lambda: reference_select_store(
            policy, scores, k, v, positions, valid, lengths, total),
        f"select + gather {args.budget}/head: kernel": lambda: select_gather(
            policy, scores, k, v, positions, valid, lengths, total),
        f"  adakv pooled {args.budget}/head: kernel": lambda: select_gather(
            adakv, scores, k, v, positions, valid, lengths, total),
        "  adakv pooled: reference": lambda: reference_select_store(
            adakv, scores, k, v, positions, valid, lengths, total),
        "  dbudgetkv threshold: kernel": lambda: select_gather(
            dbudgetkv, scores, k, v, positions, valid, lengths, None),
        "  dbudgetkv threshold: reference": lambda: reference_select_store(
            dbudgetkv, scores, k, v, positions, valid, lengths, None),
        f"merge {int(num.max())}/head, {args.slots} slots: eager": lambda: residual_merge(
            *empty, evicted_k, evicted_v, num),
        f"merge {int(num.max())}/head, {args.slots} slots: compiled": lambda: residual_merge(
            *empty, evicted_k, evicted_v, num, impl="compiled"),
    }
    print(f"threads {torch.get_num_threads()}, N={n}, H={h} KV heads, G={g}, d={d}, fp32, "
          f"best of {args.repeat}")
    print(f"{'component':<40} {'ms/call':>9} {'% of SDPA':>10}")
    base = None
    for name, fn in rows.items():
        seconds = timed(fn, args.repeat if "merge" not in name else 1)
        base = base or seconds
        print(f"{name:<40} {seconds * 1e3:>9.2f} {100 * seconds / base:>9.1f}%")


if __name__ == "__main__":
    main()
