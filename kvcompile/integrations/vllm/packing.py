"""Where a compressed request's kept entries sit in vLLM's blocks: every (layer, KV head) packed into the
request's last S slots (docs/VLLM.md "Packing"). Pure torch, no vLLM: tested in kvcompile's environment.

vLLM hands a request blocks of `block_size` token slots, and a slot holds one key and one value for every
KV head of every layer (one cache tensor per layer, the same block ids in each). Once a prompt of N tokens
is compressed, (layer l, head h) keeps K_{l,h} entries, E = Σ K_{l,h} in all. Head-wise budgets (AdaKV,
LAVa) and layer-wise ones (PyramidKV, LAVa's entropy) make the K_{l,h} unequal, so right-aligning each head's
entries in its own column would hold max K_{l,h} slots per request. Instead the entries fill the slots of
positions [N − S, N), S = ⌈E / (L·H)⌉, as one pool of L·S·H locations (tensor t, slot r, column c):

- layer l first fills its own tensor's S·H locations, u = 0, 1, … (column u // S, slot u % S), with its
  entries in (head, position) order;
- what does not fit (E_l > S·H) goes to the free locations of the layers that hold fewer (E_t < S·H), in
  layer order.

The blocks wholly before position N − S go back to vLLM's pool: as many for a head-wise or layer-wise
policy as for a uniform one of the same total. The attention of
a compressed request gathers each head's entries from these locations (kvcompile.integrations.vllm.backend); decode
tokens follow at positions N, N + 1, … in their own layer and column, as vLLM writes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def region(counts: Tensor) -> int:
    """S = ⌈Σ K_{l,h} / (L·H)⌉: the slots a compressed request keeps, counts (L, H) = K_{l,h}."""
    layers, heads = counts.shape
    return -(-int(counts.sum()) // (layers * heads))


@dataclass
class Group:
    """A run of one layer's entries stored in one layer's tensor: `locations` u ∈ [0, S·H) of `tensor`'s
    region (column u // S, slot u % S), for the layer's entries [start, start + len(locations))."""

    tensor: int
    start: int
    locations: Tensor  # (n,) long


def assign(counts: Tensor) -> list[list[Group]]:
    """For each layer, the groups holding its E_l = Σ_h K_{l,h} entries in (head, position) order: its own
    tensor's first min(E_l, S·H) locations, then the free locations of the layers holding fewer than S·H.
    Every location of the L·S·H is used at most once, and every entry gets one."""
    layers, heads = counts.shape
    room = region(counts) * heads
    totals = counts.sum(1).tolist()
    free = [(t, e, room) for t, e in enumerate(totals) if e < room]  # (tensor, first free u, end)
    out = []
    for layer, total in enumerate(totals):
        own = min(total, room)
        groups = [Group(layer, 0, torch.arange(own))] if own else []
        start = own
        while start < total:
            t, first, end = free[0]
            take = min(end - first, total - start)
            groups.append(Group(t, start, torch.arange(first, first + take)))
            start += take
            free[0] = (t, first + take, end)
            if first + take == end:
                free.pop(0)
        out.append(groups)
    return out


def padded(counts: Tensor) -> tuple[Tensor, Tensor]:
    """One layer's heads as a padded batch: index (H, W) into the layer's entries in (head, position)
    order and valid (H, W) bool, W = max_h K_{l,h}; counts (H,)."""
    width = int(counts.max()) if counts.numel() else 0
    offsets = counts.cumsum(0) - counts
    j = torch.arange(width)
    index = offsets[:, None] + torch.minimum(j[None, :], (counts - 1).clamp(min=0)[:, None])
    # a head keeping nothing points at an entry that exists (masked): never past the layer's last one
    return index.clamp(max=max(int(counts.sum()) - 1, 0)), j[None, :] < counts[:, None]


def slots(locations: Tensor, prompt_length: int, region_slots: int, heads: int, block_row: Tensor,
          block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(block id, column, offset in the block), each (n,) long, of region locations u: column u // S, the
    slot of position N − S + u % S. Column by column, so a head's entries lie at consecutive offsets of
    a block's column (vLLM's "vec" layout stores a column's keys as [head_dim, block]: consecutive
    offsets are contiguous for each dimension), which is what the decode gather reads."""
    position = prompt_length - region_slots + locations % region_slots
    column = torch.div(locations, region_slots, rounding_mode="floor")
    return block_row[position // block_size].long(), column, position % block_size



def locations(counts: Tensor, prompt_length: int, block_row: Tensor, block_size: int) -> list[Tensor]:
    """For each layer, where (4, E_l) = (layer tensor, block id, column, offset) of its kept entries in
    (head, position) order: `assign`'s groups placed by `slots`."""
    size, heads = region(counts), counts.shape[1]
    out = []
    for groups in assign(counts):
        where = [torch.stack([torch.full_like(b, g.tensor), b, c, o]) for g in groups
                 for b, c, o in [slots(g.locations, prompt_length, size, heads, block_row, block_size)]]
        out.append(torch.cat(where, 1) if where else torch.zeros(4, 0, dtype=torch.long))
    return out

def kept_entries(policy, scores: list[Tensor]) -> list[Tensor]:
    """What `policy` keeps of one prompt, (1, H, N) bool per layer, from every layer's scores (1, H, N):
    kvcompile's reference selection (kvcompile.reference.compress: fixed budgets layer by layer, LAVa's
    cascade for layer-dynamic ones, DBudgetKV's threshold), the definition kvcompile's engine is tested
    against; LAVa's cascade with a nested heads rule is counted instead of re-selected (`counted_cascade`,
    the same entries). The policies the plugin runs drop what they evict (no merge), so the selection reads
    scores only: the states passed carry the shapes, not the keys."""
    from kvcompile.layer_state import LayerState
    from kvcompile.reference import compress

    if policy.merges:
        raise ValueError(f"{policy.name} merges evicted entries: its selection needs the keys, not only scores")
    if policy.budget.layers.ranks_entries:
        return global_selection(policy, scores)
    if policy.layer_dynamic and policy.budget.threshold is None and policy.budget.heads.nested:
        return counted_cascade(policy, scores)
    shape = (*scores[0].shape, 0)
    states = [LayerState(None, torch.empty(shape), torch.empty(shape)) for _ in scores]
    return compress(policy, states, scores=scores).kept


def global_selection(policy, scores: list[Tensor]) -> list[Tensor]:
    """`layers: global` over every layer's scores at once (all are known here): the layer totals of one
    ranking of every layer's entries (kvcompile.allocation.global_totals), then each layer's pooled
    selection with its total: reference.global_keep's entries (tests/test_vllm_packing.py)."""
    from kvcompile.allocation import global_totals, layer_pool
    from kvcompile.selection import select

    batch, heads, n = scores[0].shape
    valid = torch.ones(batch, heads, n, dtype=torch.bool)
    lengths = torch.full((batch,), n)
    positions = torch.arange(n).expand(batch, heads, n)
    reserved, pools = zip(*(layer_pool(policy, s, positions, valid, lengths) for s in scores))
    totals, _ = global_totals(policy, list(reserved), list(pools), lengths, len(scores), heads)
    return [select(policy, s, positions, valid, lengths, totals[:, j], j) for j, s in enumerate(scores)]


def counted_cascade(policy, scores: list[Tensor]) -> list[Tensor]:
    """LAVa's cascade (Alg. 2) for a heads rule that nests (`heads.nested`: the best k of the best k' ≥ k
    are the best k, as AdaKV's pooled top-k without a floor): a layer re-selected among what it holds, with
    a total never above what it holds, keeps what one selection over all its tokens with its last total
    keeps. So only the counts are followed through the L steps (after each, a layer holds max(protected,
    min(total, held)), the totals of the next step capped there), and each layer is selected once, with
    its total after the last layer: L selections instead of L(L + 1)/2 (kvcompile's engine does the same,
    "lazy cascade"). tests/test_vllm_packing.py checks it against the reference's literal cascade."""
    from kvcompile.allocation import layer_totals
    from kvcompile.reference import layer_entropy
    from kvcompile.selection import select

    batch, heads, n = scores[0].shape
    if batch != 1:
        raise ValueError("counted_cascade selects one prompt")
    valid = torch.ones(1, heads, n, dtype=torch.bool)
    lengths = torch.tensor([n])
    positions = torch.arange(n).expand(1, heads, n)
    protected = int(policy.ranking.protected(positions, lengths.view(-1, 1, 1)).sum())
    entropy, held, totals = [], [], None
    for layer_scores in scores:
        entropy.append(layer_entropy(layer_scores, valid))
        held.append(heads * n)  # a layer holds its whole prompt until its first selection
        totals = layer_totals(policy, lengths, len(scores), heads, entropy=torch.stack(entropy, dim=1),
                              capacity=torch.tensor([held]))
        held = [max(protected, min(int(t), h)) for t, h in zip(totals[0].tolist(), held)]
    return [select(policy, s, positions, valid, lengths, totals[:, j], j) for j, s in enumerate(scores)]
