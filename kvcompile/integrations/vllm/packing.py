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
policy as for a uniform one of the same total. Under quantized storage (`codes`, a
kvcompile.integrations.vllm.codes.Codes) a layer's entries are one byte string over its slots, so layer l
holds ⌈E_l·B / slot⌉ locations instead of E_l (B: an entry's bytes), placed the same way. The attention of
a compressed request gathers each head's entries from these locations (kvcompile.integrations.vllm.backend); decode
tokens follow at positions N, N + 1, … in their own layer and column, as vLLM writes them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


def layer_slots(counts: Tensor, codes=None, slot_bytes: int = 0) -> list[int]:
    """The locations each layer's entries take, counts (L, H) = K_{l,h}: E_l = Σ_h K_{l,h}, or with `codes`
    (quantized storage, slots of `slot_bytes`) ⌈E_l·B / slot_bytes⌉."""
    totals = counts.sum(1).tolist()
    return totals if codes is None else [codes.slots(e, slot_bytes) for e in totals]


def region(counts: Tensor, codes=None, slot_bytes: int = 0) -> int:
    """S = ⌈Σ_l (locations of layer l) / (L·H)⌉ (Σ K_{l,h} in the model's dtype): the slots a compressed
    request keeps, counts (L, H) = K_{l,h}."""
    layers, heads = counts.shape
    return -(-sum(layer_slots(counts, codes, slot_bytes)) // (layers * heads))


@dataclass
class Group:
    """A run of one layer's entries stored in one layer's tensor: `locations` u ∈ [0, S·H) of `tensor`'s
    region (column u // S, slot u % S), for the layer's entries [start, start + len(locations))."""

    tensor: int
    start: int
    locations: Tensor  # (n,) long


def assign(counts: Tensor, codes=None, slot_bytes: int = 0) -> list[list[Group]]:
    """For each layer, the groups holding its E_l = Σ_h K_{l,h} entries in (head, position) order (with
    `codes`: its slots of bytes, `layer_slots`): its own tensor's first min(E_l, S·H) locations, then the
    free locations of the layers holding fewer than S·H. Every location of the L·S·H is used at most once,
    and every entry gets one."""
    layers, heads = counts.shape
    room = region(counts, codes, slot_bytes) * heads
    totals = layer_slots(counts, codes, slot_bytes)
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



def locations(counts: Tensor, prompt_length: int, block_row: Tensor, block_size: int, codes=None,
              slot_bytes: int = 0) -> list[Tensor]:
    """For each layer, where (4, E_l) = (layer tensor, block id, column, offset) of its kept entries in
    (head, position) order (with `codes`: of its slots of bytes): `assign`'s groups placed by `slots`."""
    size, heads = region(counts, codes, slot_bytes), counts.shape[1]
    out = []
    for groups in assign(counts, codes, slot_bytes):
        where = [torch.stack([torch.full_like(b, g.tensor), b, c, o]) for g in groups
                 for b, c, o in [slots(g.locations, prompt_length, size, heads, block_row, block_size)]]
        out.append(torch.cat(where, 1) if where else torch.zeros(4, 0, dtype=torch.long))
    return out

def kept_entries(policy, scores: list[Tensor]) -> list[Tensor]:
    """What `policy` keeps of one prompt, (1, H, N) bool per layer, from every layer's scores (1, H, N): the
    plan's own selection, through the engine's prompt path (kvcompile.engine.prefill.compress_prompt_layer
    with the scores given, layer by layer: fixed budgets, LAVa's cascade, pooled heads, `layers: global`'s one
    ranking, DBudgetKV's threshold), exactly what compile()'s generate keeps of the prompt. The policies the
    plugin runs drop what they evict (no merge), so the selection reads scores only: the keys and values
    handed to the engine are placeholders one channel wide, and the kept positions are read back from the pages
    (tests/test_vllm_packing.py holds them to kvcompile.reference.compress)."""
    from kvcompile.cache import KVCompileCache
    from kvcompile.engine.prefill import compress_prompt_layer, start_prompt
    from kvcompile.policies.storage import ModelDtype

    if policy.merges:
        raise ValueError(f"{policy.name} merges evicted entries: its selection needs the keys, not only scores")
    if policy.storage.quantizes:  # how kept entries are stored decides their bytes, not which are kept: the
        policy = dataclasses.replace(policy, storage=ModelDtype())  # placeholders are one channel wide
    batch, heads, n = scores[0].shape
    cache = KVCompileCache(policy, Dims(len(scores), heads))
    placeholder = scores[0].new_zeros(batch, heads, n, Dims.head_dim)
    start_prompt(cache, None, batch, n, placeholder)
    queries = placeholder[:, :, :0]  # the scores are given: the scorer reads no query
    for layer, layer_scores in enumerate(scores):
        compress_prompt_layer(cache, queries, placeholder, placeholder, layer, 1.0, scores=layer_scores)
    return [cache.kept_positions(layer) for layer in range(len(scores))]


@dataclass(frozen=True)
class Dims:
    """The model dimensions the selection depends on (a config for kvcompile.plan.build_plan): layers and KV heads;
    the head dimension of the placeholder keys is any the plan accepts."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim = 1
