"""Decode attention of compressed requests inside vLLM: each (layer, KV head) over its packed entries
(kvcompile.integrations.vllm.packing) and its decode entries, read from vLLM's CPU cache. Torch and C++, no
vLLM: tested in kvcompile's environment (tests/test_vllm_packed_attention.py, tests/test_vllm_codes.py).

The cache (vLLM 0.32's CPU attention, "vec" ISA) is one tensor per layer, [blocks, KV heads, block,
2·head_dim]: each (block, column) cell holds its keys as [head_dim, block] (a dimension's keys contiguous
over the block's slots), then its values as [block, head_dim]. `key_view` and `value_view` read it; the
backend checks the layout against what vLLM wrote on every prompt.

A compressed request's (layer l, KV head h) attends its K_{l,h} packed entries (wherever packing put them:
any layer's tensor, block and column) and its decode entries (positions N, N + 1, … in layer l's own
tensor, column h, as vLLM writes them), causally for the decode part. Two backends compute it, one chosen
per model when vLLM sets up its attention (`choose`: the metadata builder), and a step's `DecodePlan` (built
once, FlashInfer's plan/run split) runs each layer with it:

- `PackedCpp`, the C++ kernel (packed_attention.cpp), where it runs: float32 caches, head dim and codes'
  group multiples of 16, a C++ compiler (`cpp_refusal`). Each layer is one call for every compressed
  request in the step. Packing puts a head's entries at consecutive offsets of one or two cells, so a head
  is a few *runs* (tensor, cell, first offset, length); the kernel reads a run's keys a vector of slots at a
  time (each dimension's keys are contiguous), one online-softmax step per vector (Milakov & Gimelshein
  2018), and accumulates P·V with the G query heads of the KV head in registers. Work items are (request,
  KV head), on OpenMP threads when the step's work is large enough.
- `PackedTorch` everywhere else (bfloat16 and float16 caches, other head dims and groups, no compiler):
  per request, each head's entries gathered into a padded batch (codes decoded), then a masked softmax
  attention in float32, cast to the output's dtype.

A policy whose storage quantizes every entry (int8, int4) packs its entries as codes
(kvcompile.integrations.vllm.codes: a layer's entries one byte string over its slots); the runs are then
the slots of each layer's string, and a head's entries a range of it. The kernel gathers a head's codes,
scales and zero points from its slots and attends them with kvcompile's paged kernel's work item over codes
(kvcompile/kernels/paged_attention.cpp, `partial<BITS>`: the codes dequantized in registers), its softmax state
then carried over the decode entries; the torch backend decodes them (Codes.decode). Before that, both replace
the key and value of each of the step's new tokens, as vLLM wrote them, by what kvcompile stores of them
(x̂ = code·scale + zero, kvcompile's quantizer bit for bit, in the cache's float32: settings.check_storage
refuses codes in other dtypes), so every later attention reads what kvcompile stores.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources

import torch
from torch import Tensor

from kvcompile.kernels import paged_attention_cpp as paged
from kvcompile.kernels.paged_attention_quant import CPP_GROUP
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

    def gather(self, caches: dict) -> tuple[Tensor, Tensor, Tensor]:
        """Keys and values (H, W, d) float32, W = max_h K_{l,h}, and valid (H, W): each head's entries, padded."""
        if self.codes is not None:
            keys, values = self._read_codes(caches)
        else:
            d = caches[0].shape[-1] // 2
            keys, values = torch.empty(self.where.shape[1], d), torch.empty(self.where.shape[1], d)
            tensor, block, column, offset = self.where
            for t in tensor.unique().tolist():
                at = tensor == t
                keys[at] = key_view(caches[t])[block[at], column[at], :, offset[at]].float()
                values[at] = value_view(caches[t])[block[at], column[at], offset[at]].float()
        index, valid = padded(self.counts)
        if not len(keys):  # nothing kept: an empty batch of the right shape
            return keys.new_empty(*index.shape, keys.shape[-1]), values.new_empty(*index.shape, keys.shape[-1]), valid
        return keys[index], values[index], valid

    def runs(self) -> tuple[Tensor, Tensor]:
        """The kernel's view of the layer: runs (R, 4) = (tensor, cell = block·H + column, first offset, length) of
        consecutive offsets in one cell, and heads (H, 4) = (first run, end run, first entry, entries) of each
        head. In the model's dtype a head's runs hold its entries (in position order); with codes the runs are
        the slots of the layer's byte string, in order, and a head's entries a range of that string's."""
        tensor, block, column, offset = self.where
        heads = len(self.counts)
        cell = block * heads + column
        string = self.codes is not None  # every head reads the layer's one byte string
        owner = torch.zeros_like(tensor) if string else torch.repeat_interleave(torch.arange(heads), self.counts)
        new = torch.ones(len(owner), dtype=torch.bool)  # a run starts at another owner, tensor or cell, or a gap
        new[1:] = ((owner[1:] != owner[:-1]) | (tensor[1:] != tensor[:-1]) | (cell[1:] != cell[:-1])
                   | (offset[1:] != offset[:-1] + 1))
        starts = new.nonzero().flatten()
        lengths = torch.diff(starts, append=torch.tensor([len(owner)]))
        runs = torch.stack([tensor[starts], cell[starts], offset[starts], lengths], 1).reshape(-1, 4)
        if string:
            spans = torch.tensor([[0, len(runs)]]).expand(heads, 2)
        else:
            per_head = torch.bincount(owner[starts], minlength=heads)
            spans = torch.stack([per_head.cumsum(0) - per_head, per_head.cumsum(0)], 1)
        return runs, torch.cat([spans, torch.stack([self.counts.cumsum(0) - self.counts, self.counts], 1)], 1)


@dataclass
class Record:
    """A compressed request: its prompt length N, the slots S its packed entries hold ([N − S, N)), each
    layer's entries, and the same for the kernel: runs (R, 4) of every layer, and heads (L, H, 4), layer l's
    head h reading runs[heads[l, h, 0]:heads[l, h, 1]] (PackedLayer.runs)."""

    prompt_length: int
    region: int
    layers: list  # [PackedLayer] per layer
    runs: Tensor = field(init=False)
    heads: Tensor = field(init=False)

    @property
    def codes(self) -> Codes | None:
        """The format of the request's packed entries where its storage quantizes them (one per request)."""
        return self.layers[0].codes if self.layers else None

    def __post_init__(self):
        per_layer = [layer.runs() for layer in self.layers]
        self.runs = torch.cat([r for r, _ in per_layer]).contiguous()
        offsets = torch.tensor([len(r) for r, _ in per_layer]).cumsum(0)
        self.heads = torch.stack([h for _, h in per_layer])
        self.heads[1:, :, :2] += offsets[:-1, None, None]

    @property
    def first_slot(self) -> int:
        """N − S: the blocks wholly before this position are freed."""
        return self.prompt_length - self.region


_ARGTYPES = ("const float*", "const int64_t", "float*", "const int64_t", "const int64_t*", "const int64_t",
             "const int64_t*", "const int64_t*", "const int64_t*", "const int64_t*", "const int64_t",
             "const int64_t", "const int64_t", "const int64_t", "const float", "const int64_t", "const int64_t")
FLOAT = 32  # the kernel's `bits` for entries in the cache's dtype
# paged_attention.cpp's text comes first with its entry renamed (cpp_prefix.h included before the rename, once)
_PRELUDE = "#include <torch/csrc/inductor/cpp_prefix.h>\n#define kernel kvcompile_paged_attention_quant\n"


def source(groups: int, head_dim: int, group: int | None) -> str:
    """The kernel's C++ for G query heads per KV head, head dim d and packed entries in float32 (group None) or
    as codes of `group` channels per scale: paged_attention.cpp (its entry renamed), for codes append_step.cpp
    (its entry renamed: its quantizer of one entry), then packed_attention.cpp."""
    def text(name):
        return resources.files(paged.__package__).joinpath(name).read_text(encoding="utf-8")

    step = "" if group is None else "#define kernel kvcompile_append_step\n" + text("append_step.cpp") + "\n#undef kernel\n"
    return (_PRELUDE + paged.source(groups, head_dim, group, group) + "\n#undef kernel\n" + step
            + text("packed_attention.cpp"))


@functools.cache
def _kernel(groups: int, head_dim: int, group: int | None):
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(list(_ARGTYPES), source(groups, head_dim, group))


def cpp_refusal(head_dim: int, dtype: torch.dtype, codes: Codes | None) -> str | None:
    """Why the C++ kernel cannot attend this model's compressed requests (None: it can): a cache not in float32, a
    head dim or a group of codes not a multiple of 16 (the widest vector; the codes' loads take one scale per
    vector), no C++ toolchain. The torch backend attends them instead (`choose`)."""
    if str(dtype) != "torch.float32":
        return f"the model runs in {dtype}, and the decode kernel reads float32 caches"
    if head_dim % CPP_GROUP:
        return f"the decode kernel takes head dims that are multiples of {CPP_GROUP}, not {head_dim}"
    if codes is not None and codes.group % CPP_GROUP:
        return (f"the decode kernel dequantizes {CPP_GROUP} channels with one scale: groups of codes must "
                f"be multiples of {CPP_GROUP} channels, not {codes.group}")
    if not paged.supports(torch.device("cpu"), torch.float32, head_dim):
        return "no C++ compiler for the decode kernel (Inductor's toolchain)"
    return None


class PackedCpp:
    """The C++ kernel (packed_attention.cpp) for G query heads per KV head and head dim d, built for the engine's
    format of packed entries (codes, or None: float32) when chosen (at engine start: not in a request's first
    decode step, which would otherwise wait for the C++ compiler when Inductor's disk cache is cold); a step's
    records name their format (another policy's, where the worker's policy is swapped: built on first use). It
    finds a cell of any layer from every layer cache's address (contiguous caches of one shape)."""

    needs_addresses = True

    def __init__(self, groups: int, head_dim: int, codes: Codes | None):
        _kernel(groups, head_dim, codes.group if codes is not None else None)

    def run(self, plan: DecodePlan, layer: int, query: Tensor, output: Tensor, caches: dict, addresses: Tensor,
            scale: float, threads: int | None) -> None:
        tokens, hq, d = query.shape
        cache = caches[layer]
        if not (query.dtype == output.dtype == cache.dtype == torch.float32 and query.stride(2) == 1
                and query.stride(1) == d and output.stride(2) == 1 and output.stride(1) == d):
            raise ValueError(f"packed decode attention: float32 query, output and cache, each row's heads contiguous; "
                             f"got {query.dtype} {tuple(query.stride())}, {output.dtype} {tuple(output.stride())}, "
                             f"cache {cache.dtype}")
        if addresses is None or len(addresses) != len(plan.heads):
            raise ValueError("packed decode attention: the address of every layer's cache is needed (contiguous "
                             "caches of one shape)")
        if plan.codes is not None and plan.codes.group % CPP_GROUP:  # another format than the engine's
            raise ValueError(f"packed decode attention: the kernel loads codes in groups of multiples of {CPP_GROUP} "
                             f"channels, not {plan.codes.group}")
        if threads is None:
            threads = torch.get_num_threads() if plan.work >= paged.PARALLEL_WORK else 1
        group, bits = (plan.codes.group, plan.codes.bits) if plan.codes is not None else (None, FLOAT)
        _kernel(hq // plan.kv_heads, d, group)(
            query, query.stride(0), output, output.stride(0), addresses, layer, plan.runs, plan.heads[layer],
            plan.requests, plan.block_table, plan.block_table.stride(0), len(plan.rows), plan.kv_heads,
            cache.shape[2], float(scale), threads, bits)


class PackedTorch:
    """Torch ops, for any cache dtype, head dim and group of codes: per request, each head's packed entries gathered
    into a padded batch (codes decoded) with its decode entries, and one masked softmax attention in float32."""

    needs_addresses = False

    def run(self, plan: DecodePlan, layer: int, query: Tensor, output: Tensor, caches: dict, addresses: Tensor | None,
            scale: float, threads: int | None) -> None:
        for i, record, q0, t, first in plan.rows:
            block_row = plan.block_table[i]
            if record.codes is not None:  # the step's new tokens (never a packed slot) as kvcompile stores them
                store_new(caches[layer], block_row, max(first, record.prompt_length), first + t, record.codes)
            output[q0:q0 + t] = self.attend(query[q0:q0 + t], caches, block_row, record, layer, first,
                                            scale).to(output.dtype)

    @staticmethod
    def attend(query: Tensor, caches: dict, block_row: Tensor, record: Record, layer: int, first: int,
               scale: float) -> Tensor:
        """Attention (T, Hq, d) float32 of T query rows (T, Hq, d) at positions [first, first + T) of a compressed
        request at `layer`: head h over its packed entries and the decode entries at positions [N, position] (zeros
        where it sees none, as kvcompile.reference.decode_attention)."""
        seq = first + len(query)
        new_keys, new_values = read_positions(caches[layer], block_row, record.prompt_length, seq)
        keys, values, valid = record.layers[layer].gather(caches)
        keys, values = torch.cat([keys, new_keys.float()], 1), torch.cat([values, new_values.float()], 1)
        qpos, kpos = torch.arange(first, seq), torch.arange(record.prompt_length, seq)
        mask = torch.cat([valid[:, None, :].expand(-1, len(qpos), -1),
                          (kpos[None, None, :] <= qpos[None, :, None]).expand(len(valid), -1, -1)], -1)  # (H, T, S)
        heads = keys.shape[0]
        q = query.float().transpose(0, 1).unflatten(0, (heads, -1))  # (H, G, T, d)
        logits = torch.einsum("hgtd,hsd->hgts", q, keys) * scale
        weights = logits.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
        weights = weights.masked_fill(~mask.any(-1)[:, None, :, None], 0.0)  # a row seeing no entry: zeros
        return torch.einsum("hgts,hsd->hgtd", weights, values).flatten(0, 1).transpose(0, 1)


def choose(groups: int, head_dim: int, dtype: torch.dtype, codes: Codes | None) -> PackedCpp | PackedTorch:
    """The backend that attends this model's compressed requests, chosen once: the C++ kernel where it runs
    (`cpp_refusal`), else torch."""
    return PackedCpp(groups, head_dim, codes) if cpp_refusal(head_dim, dtype, codes) is None else PackedTorch()


@dataclass
class DecodePlan:
    """One step's compressed requests, planned once (in the metadata builder) and run per layer by the model's
    backend (`choose`).

    rows: (batch row, record, first query row, query rows T, position of the first); requests (B, 5),
    runs (R, 4) and heads (L, B·H, 4) (the runs of every record, heads indexing into them): the same for the
    kernel (see packed_attention.cpp); block_table (rows, max blocks) long; codes: the records' one format
    (None: the cache's dtype); work: the multiply-adds of one layer (for the thread count)."""

    rows: list
    requests: Tensor
    runs: Tensor
    heads: Tensor
    block_table: Tensor
    kv_heads: int
    work: int
    backend: PackedCpp | PackedTorch
    codes: Codes | None = None

    @classmethod
    def plan(cls, rows: list, block_table: Tensor, heads: int, groups: int, head_dim: int,
             backend: PackedCpp | PackedTorch) -> DecodePlan:
        records = [row[1] for row in rows]
        formats = {r.codes for r in records}
        if len(formats) > 1:
            raise ValueError(f"one step's compressed requests are stored in {len(formats)} formats; the plan runs one")
        codes = formats.pop()
        counts = torch.tensor([len(r.runs) for r in records])
        runs = torch.cat([r.runs for r in records]).contiguous()
        per_head = torch.stack([r.heads for r in records], 1)  # (L, B, H, 4), each record's runs from its offset
        per_head[..., :2] += (counts.cumsum(0) - counts)[None, :, None, None]
        per_head = per_head.flatten(1, 2).contiguous()
        requests = torch.tensor([[q0, t, r.prompt_length, first, i] for i, r, q0, t, first in rows]).view(-1, 5)
        entries = int(per_head[..., 3].sum()) // max(len(records[0].layers), 1) + sum(
            t * (first + t - r.prompt_length) for _, r, _, t, first in rows) * heads
        return cls(rows, requests, runs, per_head, block_table.long().contiguous(), heads,
                   work=2 * entries * groups * head_dim, backend=backend, codes=codes)

    def run(self, layer: int, query: Tensor, output: Tensor, caches: dict, addresses: Tensor | None,
            scale: float, threads: int | None = None) -> None:
        """Writes the attention of every planned request at `layer` into its rows of output (tokens, Hq, d)
        (a view of vLLM's output). The C++ backend takes float32 with rows of Hq·d contiguous values and
        addresses, every layer cache's address (long: every cache one contiguous tensor of one shape), and
        threads, its OpenMP threads (default: torch's when the layer's work is at least PARALLEL_WORK, else 1);
        the torch backend needs neither. With codes, the step's new tokens' keys and values, as vLLM wrote them,
        are first replaced by what the storage keeps of them."""
        self.backend.run(self, layer, query, output, caches, addresses, scale, threads)
