"""Decode attention of compressed requests inside vLLM: each (layer, KV head) over its packed entries
(kvcompile.integrations.vllm.packing) and its decode entries, read from vLLM's CPU cache. Pure torch and C++, no vLLM:
tested in kvcompile's environment (tests/test_vllm_packing.py).

The cache (vLLM 0.32's CPU attention, "vec" ISA) is one tensor per layer, [blocks, KV heads, block,
2·head_dim]: each (block, column) cell holds its keys as [head_dim, block] (a dimension's keys contiguous
over the block's slots), then its values as [block, head_dim]. `key_view` and `value_view` read it; the
backend checks the layout against what vLLM wrote on every prompt.

A compressed request's (layer l, KV head h) attends its K_{l,h} packed entries (wherever packing put them:
any layer's tensor, block and column) and its decode entries (positions N, N + 1, … in layer l's own
tensor, column h, as vLLM writes them), causally for the decode part. Two implementations of that one
contract, chosen when a step is planned:

- `attend_reference`: gathers each head's entries into a padded (H, W) batch and runs one masked
  torch attention. Plain, any dtype: the specification.
- the C++ kernel (packed_attention.cpp, fp32): a step's `DecodePlan` is built once (FlashInfer's plan/run
  split), then each layer is one call for every compressed request in the step. Packing puts a head's
  entries at consecutive offsets of one or two cells, so a head is a few *runs* (tensor, cell, first offset,
  length); the kernel reads a run's keys a vector of slots at a time (each dimension's keys are
  contiguous), one online-softmax step per vector (Milakov & Gimelshein 2018), and accumulates P·V with
  the G query heads of the KV head in registers. Work items are (request, KV head), on OpenMP threads
  when the step's work is large enough.

A policy whose storage quantizes every entry (int8, int4) packs its entries as codes
(kvcompile.integrations.vllm.codes: a layer's entries one byte string over its slots); its requests attend
through the reference, which decodes them (the kernel reads the cache's dtype only), and `store_new` replaces
their decode tokens by what kvcompile stores of them as vLLM writes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile.kernels.paged_attention_cpp import PARALLEL_WORK, load_cpp, supports
from kvcompile.integrations.vllm.codes import Codes, as_bits, slot_bytes
from kvcompile.integrations.vllm.packing import padded


def key_view(kv_cache: Tensor) -> Tensor:
    """Keys of a layer's cache, (blocks, KV heads, head_dim, block)."""
    blocks, heads, block_size, width = kv_cache.shape
    return kv_cache.view(blocks, heads, 2, width // 2, block_size)[:, :, 0]


def value_view(kv_cache: Tensor) -> Tensor:
    """Values of a layer's cache, (blocks, KV heads, block, head_dim)."""
    blocks, heads, block_size, width = kv_cache.shape
    return kv_cache.view(blocks, heads, 2, block_size, width // 2)[:, :, 1]


def read_entries(kv_cache: Tensor, block_row: Tensor, head: Tensor, position: Tensor):
    """Keys and values (..., d) of a request's entries at KV heads `head` and logical positions `position`
    (long tensors broadcast together; block_row its block ids)."""
    block_size = kv_cache.shape[2]
    blocks, offsets = block_row[position // block_size].long(), position % block_size
    return key_view(kv_cache)[blocks, head, :, offsets], value_view(kv_cache)[blocks, head, offsets]


def read_positions(kv_cache: Tensor, block_row: Tensor, begin: int, end: int):
    """Keys and values (H, end − begin, d) of every KV head at logical positions [begin, end)."""
    return read_entries(kv_cache, block_row, torch.arange(kv_cache.shape[1])[:, None], torch.arange(begin, end))


def store_new(kv_cache: Tensor, block_row: Tensor, begin: int, end: int, codes: Codes) -> None:
    """Replaces the keys and values vLLM wrote at logical positions [begin, end) (every KV head) by x̂, what
    kvcompile stores of them under `codes`."""
    block_size = kv_cache.shape[2]
    position = torch.arange(begin, end)
    blocks, offsets, head = block_row[position // block_size].long(), position % block_size, \
        torch.arange(kv_cache.shape[1])[:, None]
    keys, values = read_entries(kv_cache, block_row, head, position)
    key_view(kv_cache)[blocks, head, :, offsets] = codes.stored(keys)
    value_view(kv_cache)[blocks, head, offsets] = codes.stored(values)


@dataclass
class PackedLayer:
    """One layer's kept entries of a compressed request: where (4, E) = (layer tensor, block, column,
    offset) of each, in (head, position) order, and counts (H,) = K_{l,h}. With `codes` (quantized
    storage), `where` places the slots of the layer's entries as one byte string instead
    (kvcompile.integrations.vllm.codes), ⌈E·B / slot⌉ of them."""

    where: Tensor
    counts: Tensor
    codes: Codes | None = None

    def write(self, caches: dict, keys: Tensor, values: Tensor) -> None:
        """Stores the layer's kept keys and values (E, d), in (head, position) order, at their places."""
        if self.codes is not None:
            return self._write_codes(caches, keys, values)
        tensor, block, column, offset = self.where
        for t in tensor.unique().tolist():
            at = tensor == t
            key_view(caches[t])[block[at], column[at], :, offset[at]] = keys[at]
            value_view(caches[t])[block[at], column[at], offset[at]] = values[at]

    def _write_codes(self, caches: dict, keys: Tensor, values: Tensor) -> None:
        tensor, block, column, offset = self.where
        width = caches[0].shape[-1] // 2
        data = self.codes.encode(keys, values).flatten()
        size = slot_bytes(caches[0]) * len(tensor)
        data = torch.cat([data, data.new_zeros(size - len(data))])
        words = data.view(as_bits(caches[0]).dtype).view(len(tensor), 2 * width)  # one row per slot
        for t in tensor.unique().tolist():
            at = tensor == t
            key_view(as_bits(caches[t]))[block[at], column[at], :, offset[at]] = words[at, :width]
            value_view(as_bits(caches[t]))[block[at], column[at], offset[at]] = words[at, width:]

    def _read_codes(self, caches: dict) -> tuple[Tensor, Tensor]:
        """x̂ of the layer's keys and values (E, d) float32, decoded from its slots."""
        tensor, block, column, offset = self.where
        width = caches[0].shape[-1] // 2
        words = as_bits(caches[0]).new_empty(len(tensor), 2 * width)
        for t in tensor.unique().tolist():
            at = tensor == t
            words[at, :width] = key_view(as_bits(caches[t]))[block[at], column[at], :, offset[at]]
            words[at, width:] = value_view(as_bits(caches[t]))[block[at], column[at], offset[at]]
        entries = int(self.counts.sum())
        data = words.flatten().view(torch.uint8)[:entries * self.codes.entry_bytes]
        return self.codes.decode(data.view(entries, self.codes.entry_bytes))

    def gather(self, caches: dict, like: Tensor):
        """Keys and values (H, W, d), W = max_h K_{l,h}, and valid (H, W): each head's entries, padded."""
        if self.codes is not None:
            keys, values = (x.to(like.dtype) for x in self._read_codes(caches))
        else:
            keys = like.new_empty(self.where.shape[1], like.shape[-1])
            values = like.new_empty(self.where.shape[1], like.shape[-1])
            tensor, block, column, offset = self.where
            for t in tensor.unique().tolist():
                at = tensor == t
                keys[at] = key_view(caches[t])[block[at], column[at], :, offset[at]].to(like.dtype)
                values[at] = value_view(caches[t])[block[at], column[at], offset[at]].to(like.dtype)
        index, valid = padded(self.counts)
        if not len(keys):  # nothing kept: an empty batch of the right shape
            return keys.new_empty(*index.shape, like.shape[-1]), values.new_empty(*index.shape, like.shape[-1]), valid
        return keys[index], values[index], valid

    def runs(self) -> tuple[Tensor, Tensor]:
        """The entries as runs (R, 4) = (tensor, cell = block·H + column, first offset, length) of
        consecutive offsets in one cell, in (head, position) order, and each head's number of runs (H,)."""
        tensor, block, column, offset = self.where
        heads = len(self.counts)
        head = torch.repeat_interleave(torch.arange(heads), self.counts)
        cell = block * heads + column
        new = torch.ones(len(head), dtype=torch.bool)
        new[1:] = ((head[1:] != head[:-1]) | (tensor[1:] != tensor[:-1]) | (cell[1:] != cell[:-1])
                   | (offset[1:] != offset[:-1] + 1))
        starts = new.nonzero().flatten()
        lengths = torch.diff(starts, append=torch.tensor([len(head)]))
        runs = torch.stack([tensor[starts], cell[starts], offset[starts], lengths], 1)
        return runs, torch.bincount(head[starts], minlength=heads)


@dataclass
class Record:
    """A compressed request: its prompt length N, the slots S its packed entries hold ([N − S, N)), each
    layer's entries, and the same as runs for the kernel: runs (R, 4) of every layer, and head_runs (L, H, 2),
    layer l's head h's runs being runs[head_runs[l, h, 0]:head_runs[l, h, 1]] (none for entries stored as
    codes: the kernel does not read them)."""

    prompt_length: int
    region: int
    layers: list  # [PackedLayer] per layer
    runs: Tensor = field(init=False)
    head_runs: Tensor = field(init=False)

    @property
    def codes(self) -> Codes | None:
        """The format of the request's packed entries where its storage quantizes them (one per request)."""
        return self.layers[0].codes if self.layers else None

    def __post_init__(self):
        if self.codes is not None:
            self.runs = torch.zeros(0, 4, dtype=torch.long)
            self.head_runs = torch.zeros(len(self.layers), len(self.layers[0].counts), 2, dtype=torch.long)
            return
        per_layer = [layer.runs() for layer in self.layers]
        self.runs = torch.cat([r for r, _ in per_layer]).contiguous()
        counts = torch.stack([c for _, c in per_layer])  # (L, H)
        ends = counts.flatten().cumsum(0).view_as(counts)
        self.head_runs = torch.stack([ends - counts, ends], -1)

    @property
    def first_slot(self) -> int:
        """N − S: the blocks wholly before this position are freed."""
        return self.prompt_length - self.region


def attend_reference(query: Tensor, caches: dict, block_row: Tensor, record: Record, layer: int, first: int,
                     scale: float) -> Tensor:
    """Attention (T, Hq, d) of T query tokens (T, Hq, d) at positions [first, first + T) of a compressed
    request at `layer`: head h over its packed entries and the decode entries at positions [N, position]."""
    seq = first + len(query)
    packed = record.layers[layer]
    new_keys, new_values = read_positions(caches[layer], block_row, record.prompt_length, seq)
    keys, values, valid = packed.gather(caches, query)
    keys, values = torch.cat([keys, new_keys.to(query.dtype)], 1), torch.cat([values, new_values.to(query.dtype)], 1)
    qpos, kpos = torch.arange(first, seq), torch.arange(record.prompt_length, seq)
    mask = torch.cat([valid[:, None, :].expand(-1, len(qpos), -1),
                      (kpos[None, None, :] <= qpos[None, :, None]).expand(len(valid), -1, -1)], -1)
    q = query.transpose(0, 1)  # (Hq, T, d)
    groups = q.shape[0] // keys.shape[0]
    out = F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True,
                                         attn_mask=mask.repeat_interleave(groups, 0))
    return out.transpose(0, 1)


_ARGTYPES = ("const float*", "const int64_t", "float*", "const int64_t", "const int64_t*", "const int64_t",
             "const int64_t*", "const int64_t*", "const int64_t*", "const int64_t*", "const int64_t",
             "const int64_t", "const int64_t", "const int64_t", "const float", "const int64_t")


def _kernel(groups: int, head_dim: int):
    return load_cpp(_ARGTYPES, "packed_attention.cpp", G=groups, D=head_dim)


def prepare(groups: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Builds the kernel for this model now (at engine start: not in a request's first decode step, which
    would otherwise wait for the C++ compiler when Inductor's disk cache is cold); whether it runs here."""
    if not supports(torch.device("cpu"), dtype, head_dim):
        return False
    _kernel(groups, head_dim)
    return True


@dataclass
class DecodePlan:
    """One step's compressed requests, planned once (in the metadata builder) and run per layer.

    rows: (batch row, record, first query row, query rows T, position of the first); requests (B, 5),
    runs (R, 4) and head_runs (L, B·H, 2) (the runs of every record, head_runs indexing into them): the same
    for the kernel (see packed_attention.cpp); block_table (rows, max blocks) long; work: the multiply-adds
    of one layer (for the thread count)."""

    rows: list
    requests: Tensor
    runs: Tensor
    head_runs: Tensor
    block_table: Tensor
    heads: int
    work: int
    quantized: list = field(default_factory=list)  # rows whose entries are codes: (batch row, record, first, T)

    @classmethod
    def plan(cls, rows: list, block_table: Tensor, heads: int, groups: int, head_dim: int) -> DecodePlan:
        records = [row[1] for row in rows]
        counts = torch.tensor([len(r.runs) for r in records])
        offsets = (counts.cumsum(0) - counts).tolist()
        runs = torch.cat([r.runs for r in records]).contiguous()
        head_runs = torch.stack([r.head_runs + o for r, o in zip(records, offsets)], 1)  # (L, B, H, 2)
        head_runs = head_runs.flatten(1, 2).contiguous()
        requests = torch.tensor([[q0, t, r.prompt_length, first, i] for i, r, q0, t, first in rows]).view(-1, 5)
        entries = int(runs[:, 3].sum()) // max(len(records[0].layers), 1) + sum(
            t * (first + t - r.prompt_length) for _, r, _, t, first in rows) * heads
        quantized = [(i, r, first, t) for i, r, _, t, first in rows if r.codes is not None]
        return cls(rows, requests, runs, head_runs, block_table.long().contiguous(), heads,
                   work=2 * entries * groups * head_dim, quantized=quantized)

    def run(self, layer: int, query: Tensor, output: Tensor, caches: dict, addresses: Tensor | None,
            scale: float, threads: int | None = None) -> None:
        """Writes the attention of every planned request at `layer` into its rows of output (tokens, Hq, d)
        (a view of vLLM's output): the kernel when it runs here (fp32, head dim a multiple of 16, a
        toolchain; addresses: every layer cache's address, long, given only when every cache is one
        contiguous tensor of the same shape), else the reference. threads: the
        kernel's OpenMP threads (default: torch's when the layer's work is at least PARALLEL_WORK, else 1).
        A request whose entries are codes first has its new tokens' keys and values, as vLLM wrote them,
        replaced by what its storage keeps of them (`store_new`), and attends through the reference."""
        tokens, hq, d = query.shape
        for i, record, first, t in self.quantized:
            store_new(caches[layer], self.block_table[i], max(first, record.prompt_length), first + t,
                      record.codes)  # never a packed slot
        kernel = not self.quantized and addresses is not None and \
            query.dtype == output.dtype == caches[layer].dtype and \
            supports(query.device, query.dtype, d) and query.stride(2) == 1 and query.stride(1) == d and \
            output.stride(2) == 1 and output.stride(1) == d
        if not kernel:
            for i, record, q0, t, first in self.rows:
                output[q0:q0 + t] = attend_reference(query[q0:q0 + t], caches, self.block_table[i], record,
                                                     layer, first, scale).to(output.dtype)
            return
        if threads is None:
            threads = torch.get_num_threads() if self.work >= PARALLEL_WORK else 1
        _kernel(hq // self.heads, d)(query, query.stride(0), output, output.stride(0), addresses, layer, self.runs,
                                     self.head_runs[layer], self.requests, self.block_table,
                                     self.block_table.stride(0), len(self.rows), self.heads,
                                     caches[layer].shape[2], float(scale), threads)
