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
names the format: the page store (kvcompile.store) quantizes, and kvcompile.kernels.quantize holds the
formula's code.

Two parts keep each head's entries in two precisions, a high tier in the model's dtype and a low tier of
codes (the page store's `TieredStore`, kvcompile.store.tiers): `mixed` splits a head's kept entries by
score (MiKV), `kivi` by recency, with keys quantized per channel (KIVI). Attention over a head is the
attention over both tiers, combined by their log-sum-exp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvcompile.policies.fields import Part, bounded
from kvcompile.policies.registry import part


class Storage(Part):
    """Base of the storage parts. `bits`: None keeps the model's dtype, else the integer width of
    the codes; `group`: channels per scale and zero point (0: a whole entry, the head dim)."""

    bits: int | None = None
    group: int = 0
    tiered = False  # each head's entries in two tiers, the model's dtype and `low()` (TieredStore)
    key_axis = "token"  # keys quantized per token ("token") or each channel over a page ("channel", KIVI)
    new_token_tier = "low"  # the tier of a TieredStore a generated token joins ("high": the model's dtype)

    @property
    def quantizes(self) -> bool:
        return self.bits is not None

    def low(self) -> "Storage":
        """The format of the quantized entries (a tiered part's low tier; the part itself otherwise)."""
        return self

    def high_tokens(self, n):
        """(B, H) long: of heads of n (B, H) kept tokens, those a TieredStore keeps in the model's dtype (none:
        every token as codes, beside merge slots)."""
        return n * 0

    def tier_key(self, scores, positions):
        """The key by which a head's `high_tokens` highest tokens are kept in the model's dtype (ties: the later
        position)."""
        return positions

    def group_size(self, head_dim: int) -> int:
        """Channels per scale and zero point for a head dim."""
        return head_dim if not self.group else self.group

    def key_group(self, head_dim: int) -> int:
        """Channels per key scale for a head dim, as the quantized kernels take it (0: each channel its own scale
        over a page's tokens, `key_axis` "channel")."""
        return self.group_size(head_dim)

    @property
    def flushes_after(self) -> int | None:
        """Entries a head's float tier holds before a decode step turns its oldest group into codes (None: a
        generated token's tier never flushes)."""
        return None

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
        """Bytes of one entry's key and value (codes, scales and zero points included); for a tiered part,
        an upper bound: an entry of its high tier (what a request's admission reserves)."""
        if not self.quantizes or self.tiered:
            return 2 * head_dim * element_size
        groups = head_dim // self.group_size(head_dim)
        return 2 * (head_dim * self.bits // 8 + 2 * 4 * groups)

    def mean_entry_bytes(self, head_dim: int, element_size: int) -> float:
        """Bytes per kept entry on average over a long prompt (a tiered part's mix of its tiers)."""
        return self.entry_bytes(head_dim, element_size)

    def head_bytes(self, k: int, head_dim: int, element_size: int) -> float:
        """Key and value bytes of one head holding k entries (a tiered part: each entry in its tier's format)."""
        return k * self.entry_bytes(head_dim, element_size)

    def low_entry_bytes(self, head_dim: int) -> float:
        """Key and value bytes of one entry stored as codes (a per-channel page's scales shared out)."""
        groups = head_dim // self.group_size(head_dim)
        values = head_dim * self.bits // 8 + 2 * 4 * groups
        if self.key_axis == "channel":
            return values + head_dim * self.bits // 8 + 2 * 4 * head_dim / self.tokens
        return 2 * values


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


def _low(bits: int, group: int) -> Storage:
    return Int8(group=group) if bits == 8 else Int4(group=group)


@part("storage", "mixed")
@dataclass(frozen=True)
class MixedByScore(Storage):
    """Mixed precision by score (MiKV, Yang et al., 2024, "No Token Left Behind", arXiv 2402.18096, §3):
    of each head's n kept tokens, the round(full · n) highest-scored stay in the model's dtype and the
    rest are stored as `bits`-bit codes (per token, `group` channels per scale). Ties in score go to the
    later position. The policy's budget counts both tiers: "10 % of the prompt in full precision and 20 %
    more demoted to int4 instead of dropped" is a budget of 30 % with full = 1/3. Tokens generated after
    the prompt join the high tier; `decode: every` splits each head again by the new scores (an entry
    demoted earlier keeps the values its codes give)."""

    full: float = bounded(0.5, low=0, high=1, why="the share of each head's kept tokens in the model's dtype")
    bits: Literal[4, 8] = 4
    group: int = bounded(0, low=0, why="channels per scale; 0 means the whole head dim")
    tiered = True
    new_token_tier = "high"

    def low(self) -> Storage:
        return _low(self.bits, self.group)

    def high_tokens(self, n):
        return (n.double() * self.full).round().long()  # round(full · n), half to even

    def tier_key(self, scores, positions):
        return scores.float()

    def high_count(self, n: int) -> int:
        """Tokens of a head of n kept tokens in the model's dtype: round(full · n), half to even."""
        return round(self.full * n)

    def mean_entry_bytes(self, head_dim: int, element_size: int) -> float:
        return self.full * 2 * head_dim * element_size + (1 - self.full) * self.low_entry_bytes(head_dim)

    def head_bytes(self, k: int, head_dim: int, element_size: int) -> float:
        high = self.high_count(k)
        return high * 2 * head_dim * element_size + (k - high) * self.low_entry_bytes(head_dim)


@part("storage", "kivi")
@dataclass(frozen=True)
class Kivi(Storage):
    """KIVI (Liu et al., 2024, arXiv 2402.02750, §3.2, Alg. 1): keys quantized per channel over groups of
    `tokens` consecutive tokens, values per token (`group` channels per scale), the most recent tokens in
    the model's dtype. A head holding n tokens (in position order) keeps its first
    L(n) = tokens · ⌊(n − residual) / tokens⌋ (0 when n < residual) quantized, group j being tokens
    [j·tokens, (j + 1)·tokens), and its last n − L(n) (between `residual` and `residual + tokens − 1`)
    in full precision: as a decode step brings the full-precision tail to residual + tokens, its oldest
    `tokens` become one more quantized group. KIVI's 2-bit codes are not offered (the kernels hold 4 and
    8 bits). Entries leave only by prompt selection: online eviction and `decode: every` are refused."""

    bits: Literal[4, 8] = 4
    residual: int = bounded(128, low=0, why="recent tokens kept in the model's dtype")
    tokens: int = bounded(32, low=1, why="tokens per key channel's scale (KIVI's group size)")
    group: int = bounded(0, low=0, why="value channels per scale; 0 means the whole head dim")
    tiered = True
    key_axis = "channel"
    new_token_tier = "high"

    def low(self) -> Storage:
        return self  # its codes' format is its own: keys per channel, values per token

    def key_group(self, head_dim: int) -> int:
        return 0  # keys per channel over a page's `tokens`

    @property
    def flushes_after(self) -> int:
        return self.residual  # past residual + tokens, the oldest `tokens` become one group of codes

    def high_tokens(self, n):
        return n - (n - self.residual).clamp(min=0) // self.tokens * self.tokens  # n − L(n): the latest

    def quantized_count(self, n: int) -> int:
        """L(n): the tokens of a head of n that are stored as codes."""
        return 0 if n < self.residual else self.tokens * ((n - self.residual) // self.tokens)

    def mean_entry_bytes(self, head_dim: int, element_size: int) -> float:
        return self.low_entry_bytes(head_dim)  # over a long prompt nearly every entry is codes

    def head_bytes(self, k: int, head_dim: int, element_size: int) -> float:
        low = self.quantized_count(k)
        return (k - low) * 2 * head_dim * element_size + low * self.low_entry_bytes(head_dim)
