"""Storage parts: the precision of the entries a policy keeps.

Eviction decides which entries stay; a storage part decides how many bytes each kept entry takes. The
model's own dtype is the default. `int8` and `int4` store every kept key and value as asymmetric integer
codes with a float32 scale and zero point per group of `group` consecutive channels of one entry (per
token; KIVI, Liu et al., 2024, arXiv 2402.02750, §3.1, and MiKV, Yang et al., 2024, arXiv 2402.18096,
§3.1, quantize values this way):

    zero = min(x),  scale = (max(x) − min(x)) / (2^bits − 1)  (1 where that is 0),
    code = clamp(round((x − zero) / scale), 0, 2^bits − 1),   x̂ = code · scale + zero

for each group x (round half to even), computed in float32. Attention reads x̂ (the kernels dequantize
in registers); scores, positions and merge counts stay in float32 / int64 beside the codes. A part only
names the format: the page store (kvcompile.engine.pages) quantizes, and kvcompile.kernels.quantize
holds the formula's code.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcompile.policies.fields import Part, bounded
from kvcompile.policies.registry import part


class Storage(Part):
    """Base of the storage parts. `bits`: None keeps the model's dtype, else the integer width of
    the codes; `group`: channels per scale and zero point (0: a whole entry, the head dim)."""

    bits: int | None = None
    group: int = 0

    @property
    def quantizes(self) -> bool:
        return self.bits is not None

    def group_size(self, head_dim: int) -> int:
        """Channels per scale and zero point for a head dim."""
        return head_dim if not self.group else self.group

    def check_head_dim(self, head_dim: int) -> str | None:
        """Why this format cannot hold entries of `head_dim` channels (None: it can)."""
        if not self.quantizes:
            return None
        g = self.group_size(head_dim)
        if head_dim % g:
            return f"group {g} does not divide the head dim {head_dim}"
        if self.bits == 4 and head_dim % 2:
            return f"int4 packs two channels a byte, and the head dim {head_dim} is odd"
        return None

    def entry_bytes(self, head_dim: int, element_size: int) -> int:
        """Bytes of one entry's key and value (codes, scales and zero points included)."""
        if not self.quantizes:
            return 2 * head_dim * element_size
        groups = head_dim // self.group_size(head_dim)
        return 2 * (head_dim * self.bits // 8 + 2 * 4 * groups)


@part("storage", "model_dtype")
@dataclass(frozen=True)
class ModelDtype(Storage):
    """Entries stored in the model's own dtype, as computed (no quantization)."""


@part("storage", "int8")
@dataclass(frozen=True)
class Int8(Storage):
    """Every kept key and value as 8-bit asymmetric codes, one float32 scale and zero point per
    `group` channels of an entry (0: the whole head dim)."""

    group: int = bounded(0, low=0, why="channels per scale; 0 means the whole head dim")
    bits = 8


@part("storage", "int4")
@dataclass(frozen=True)
class Int4(Storage):
    """Every kept key and value as 4-bit asymmetric codes (two a byte), one float32 scale and zero
    point per `group` channels of an entry (0: the whole head dim)."""

    group: int = bounded(0, low=0, why="channels per scale; 0 means the whole head dim")
    bits = 4
