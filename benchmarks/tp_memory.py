"""Memory per rank of a GQA model under tensor parallelism with kvcompile: weights, the full KV cache,
and the compressed cache at a budget per KV head (docs/DISTRIBUTED.md; tests/test_distributed_doc.py
checks the page's table against this script, and the formulas against a real KVCompileCache).

    python3 benchmarks/tp_memory.py                     # Llama-3-70B shape, 8 ranks, 128 per head
    python3 benchmarks/tp_memory.py --ranks 4 --per-head 256 --contexts 8192,131072 --batches 1,16

Formulas (B batch, T tokens in the sequence, L layers, H KV heads, P ranks, d head dim, e bytes per
element, S page size, n the budget per KV head and layer):
- weights per rank: transformers' Llama tp_plan (`model.tp_plan`) splits q/k/v/gate/up by columns,
  o/down by rows, lm_head by columns and the embedding by vocabulary rows (1/P each); the norms are
  whole on every rank;
- full KV per rank: B·T·L·(H/P)·2·d·e (K and V of every token, this rank's KV heads);
- compressed KV per rank: B·L·(H/P)·S·ceil(n/S)·2·d·e, whatever T: pages of S entries, each head's
  own; with head-wise budgets (AdaKV, LAVa pooling) the average stays n and page rounding adds less
  than one page per head: at most B·L·(H/P)·(S−1)·2·d·e more;
- metadata: 16 bytes per entry slot of every page (score fp32, position int64, merge count fp32);
- while decoding: every generated token adds one entry per head (B·L·(H/P)·2·d·e per token), and
  generate() reserves up to 4 spare pages per head (plan.SPARE_RUN) for them;
- prefill peak: one layer's full K and V of this rank's heads (B·T·(H/P)·2·d·e), compressed as soon
  as the layer's attention is done, before the next layer runs.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

META_BYTES = 4 + 8 + 4  # per entry slot: score float32, position int64, merge count float32
SPARE_RUN = 4  # kvcompile.plan.SPARE_RUN: the most spare pages a head gets for its decode appends


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool  # lm_head shares the embedding
    elt: int  # bytes per element (bf16: 2)


LLAMA3_70B = Shape(layers=80, heads=64, kv_heads=8, head_dim=128, hidden=8192, intermediate=28672, vocab=128256,
                   tied=False, elt=2)


def weight_params(s: Shape, ranks: int = 1) -> int:
    """Parameters one rank holds (ranks=1: the whole model)."""
    if s.heads % ranks or s.kv_heads % ranks or s.intermediate % ranks or s.vocab % ranks:
        raise ValueError(f"{ranks} ranks do not divide the heads, KV heads, MLP or vocabulary")
    attn = s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads)  # q, o and k, v
    mlp = 3 * s.hidden * s.intermediate
    layer = (attn + mlp) // ranks + 2 * s.hidden  # the two norms are whole on every rank
    embed = s.vocab * s.hidden // ranks  # embed_tokens: embedding_rowwise (the vocabulary split)
    head = 0 if s.tied else s.vocab * s.hidden // ranks  # lm_head: colwise_gather_output
    return s.layers * layer + embed + head + s.hidden  # + the final norm


def entry_bytes(s: Shape) -> int:
    """K and V of one token in one KV head."""
    return 2 * s.head_dim * s.elt


def heads_per_rank(s: Shape, ranks: int) -> int:
    if s.kv_heads % ranks:
        raise ValueError(f"{s.kv_heads} KV heads do not divide over {ranks} ranks")
    return s.kv_heads // ranks


def full_kv(s: Shape, tokens: int, batch: int, ranks: int) -> int:
    return batch * tokens * s.layers * heads_per_rank(s, ranks) * entry_bytes(s)


def pages(per_head: int, page: int) -> int:
    return math.ceil(per_head / page)


def compressed_kv(s: Shape, per_head: int, batch: int, ranks: int, page: int = 16) -> int:
    return batch * s.layers * heads_per_rank(s, ranks) * pages(per_head, page) * page * entry_bytes(s)


def rounding_bound(s: Shape, batch: int, ranks: int, page: int = 16) -> int:
    return batch * s.layers * heads_per_rank(s, ranks) * (page - 1) * entry_bytes(s)


def metadata(s: Shape, per_head: int, batch: int, ranks: int, page: int = 16) -> int:
    return batch * s.layers * heads_per_rank(s, ranks) * pages(per_head, page) * page * META_BYTES


def per_token(s: Shape, batch: int, ranks: int) -> int:
    return batch * s.layers * heads_per_rank(s, ranks) * entry_bytes(s)


def spares(s: Shape, batch: int, ranks: int, page: int = 16) -> int:
    return batch * s.layers * heads_per_rank(s, ranks) * SPARE_RUN * page * entry_bytes(s)


def prefill_peak(s: Shape, tokens: int, batch: int, ranks: int) -> int:
    return batch * tokens * heads_per_rank(s, ranks) * entry_bytes(s)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def rows(s: Shape, ranks: int, per_head: int, contexts, batches, page: int = 16) -> list[tuple[str, ...]]:
    """(context, batch, full KV, compressed KV, page rounding bound, metadata, prefill peak) per rank."""
    out = []
    for tokens in contexts:
        for batch in batches:
            out.append((f"{tokens // 1024}k", str(batch), gib(full_kv(s, tokens, batch, ranks)),
                        mib(compressed_kv(s, per_head, batch, ranks, page)), mib(rounding_bound(s, batch, ranks, page)),
                        mib(metadata(s, per_head, batch, ranks, page)), mib(prefill_peak(s, tokens, batch, ranks))))
    return out


HEADER = ("context", "batch", "full KV", f"compressed KV", "+ rounding ≤", "metadata", "prefill peak")


def table(s: Shape, ranks: int, per_head: int, contexts, batches, page: int = 16) -> str:
    """The markdown table of docs/DISTRIBUTED.md."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(s, ranks, per_head, contexts, batches, page)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--per-head", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="1,8")
    args = p.parse_args()
    s = LLAMA3_70B
    total, mine = weight_params(s), weight_params(s, args.ranks)
    print(f"Llama-3-70B shape: {total:,} parameters = {gib(total * s.elt)} in bf16; per rank of {args.ranks}: "
          f"{mine:,} = {gib(mine * s.elt)}")
    print(f"KV heads per rank {heads_per_rank(s, args.ranks)}; one token, all layers, per rank: "
          f"{per_token(s, 1, args.ranks):,} B; spare pages per sequence per rank: {mib(spares(s, 1, args.ranks))}")
    print(table(s, args.ranks, args.per_head, [int(x) for x in args.contexts.split(",")],
                [int(x) for x in args.batches.split(",")], args.page_size))


if __name__ == "__main__":
    main()
