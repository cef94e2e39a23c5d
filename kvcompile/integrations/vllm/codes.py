"""Quantized storage (`storage: int8 | int4`) inside vLLM: a compressed request's kept entries as codes in its
packed region (docs/VLLM.md "Quantized storage"). Pure torch, no vLLM: tested in kvcompile's environment
(tests/test_vllm_codes.py).

A kept entry is stored as kvcompile's page store stores it (kvcompile.kernels.quantize, per entry, groups of
`storage.group_size(d)` channels): its key's and its value's codes, then the key's scales and zero points and
the value's (float32). That is B = 2·(d·bits/8 + 8·d/group) bytes, against a slot of vLLM's cache, which holds
one key and one value in the cache's dtype: 2·d·itemsize bytes (512 for d = 64 in float32: an int8 entry of one
group takes 144, an int4 one 80). A layer's entries, in (head, position) order, are one byte string cut into
slots: ⌈E_l·B / slot⌉ of them, which packing places as it places full-precision entries (one slot per entry).
So an int8 request keeps about 3.6 times fewer slots than a full-precision one of the same budget and returns
that many more blocks to vLLM's pool.

Decode tokens stay where vLLM writes them (one slot each, position N + t); the plugin replaces each one's key
and value by x̂ = code·scale + zero in the step that writes it, before any attention reads it, so every later
attention reads what kvcompile stores (its slot keeps the cache's dtype: the bytes of decode tokens do not
shrink).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompile.kernels.quantize import code_width, dequantize, quantize


@dataclass(frozen=True)
class Codes:
    """The byte format of one quantized entry of a `storage` part (bits, group) and head dim d."""

    bits: int
    group: int
    head_dim: int

    @classmethod
    def of(cls, storage, head_dim: int) -> "Codes | None":
        """The format of a storage part that quantizes every entry (int8, int4), None for the model's dtype."""
        if not storage.quantizes:
            return None
        if storage.tiered:
            raise ValueError(f"storage {type(storage).name} splits each head into two tiers: not a per-entry format")
        return cls(storage.bits, storage.group_size(head_dim), head_dim)

    @property
    def code_bytes(self) -> int:
        return code_width(self.head_dim, self.bits)

    @property
    def groups(self) -> int:
        return self.head_dim // self.group

    @property
    def entry_bytes(self) -> int:
        """B: a key's and a value's codes, scales and zero points."""
        return 2 * (self.code_bytes + 8 * self.groups)

    def slots(self, entries: int, slot_bytes: int) -> int:
        """The slots of `slot_bytes` that `entries` entries take, as one byte string."""
        return -(-entries * self.entry_bytes // slot_bytes)

    def encode(self, keys: Tensor, values: Tensor) -> Tensor:
        """Entries (E, d) -> their bytes (E, B) uint8, quantized from float32."""
        k = quantize(keys.float(), self.bits, self.group)
        v = quantize(values.float(), self.bits, self.group)
        floats = torch.cat([k.scale, k.zero, v.scale, v.zero], 1).contiguous()  # (E, 4·groups) float32
        return torch.cat([k.codes, v.codes, floats.view(torch.uint8)], 1)

    def decode(self, data: Tensor) -> tuple[Tensor, Tensor]:
        """Bytes (E, B) uint8 -> x̂ of the keys and values (E, d) float32."""
        c, g = self.code_bytes, self.groups
        floats = data[:, 2 * c:].contiguous().view(torch.float32)  # (E, 4·groups)
        k_scale, k_zero, v_scale, v_zero = floats.split(g, 1)
        return (dequantize(data[:, :c].contiguous(), k_scale.contiguous(), k_zero.contiguous(), self.bits),
                dequantize(data[:, c:2 * c].contiguous(), v_scale.contiguous(), v_zero.contiguous(), self.bits))

    def stored(self, x: Tensor) -> Tensor:
        """x̂ of entries x (…, d) in x's dtype: what kvcompile stores of them."""
        q = quantize(x.reshape(-1, x.shape[-1]).float(), self.bits, self.group)
        return dequantize(q.codes, q.scale, q.zero, self.bits).reshape(x.shape).to(x.dtype)


def as_bits(kv_cache: Tensor) -> Tensor:
    """A layer's cache viewed as integers of its element size: slots copied through it keep their bytes."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return kv_cache.view(ints[kv_cache.element_size()])


def slot_bytes(kv_cache: Tensor) -> int:
    """Bytes of one slot (a key and a value of one KV head) of a layer's cache [blocks, H, block, 2·d]."""
    return kv_cache.shape[-1] * kv_cache.element_size()
