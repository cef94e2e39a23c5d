"""Asymmetric integer quantization of KV pages (int8, int4): the quantizer and its inverse.

The quantizer is the asymmetric round-to-nearest one of KIVI (Liu et al., 2024, arXiv
2402.02750: Q(X) = ⌊(X − z_X) / s_X⌉ with z_X = min X, s_X = (max X − min X) / (2^B − 1)) and of
MiKV (Yang et al., 2024, arXiv 2402.18096: the same quantizer per token, scale
α = (max − min) / (2^b − 1), zero point β = min). For one group x of values (fp32 arithmetic,
in this order):

    zero  = min(x)
    scale = (max(x) − min(x)) / (2^bits − 1),   replaced by 1 where that is 0
    code  = clamp(round((x − zero) / scale), 0, 2^bits − 1)      round: half to even (torch.round)
    x̂     = code · scale + zero                                   (dequantize: a product, then a sum)

Scale 1 where the quotient is 0 (a constant group, or a range below 2^bits − 1 subnormal steps)
makes every code 0 and x̂ = zero exactly for a constant group; elsewhere |x − x̂| ≤ scale / 2 up to
fp32 rounding. x must be finite (nothing is checked on the device: no host read per call).

Groups (KIVI: keys per channel, values per token):
- axis "token": `group` consecutive channels of one entry (default: all d). For pages (P, S, d):
  scale, zero (P, S, d // group). Values always, keys optionally.
- axis "channel": one channel over the page's S entries (KIVI's key quantization; its group of
  tokens is the page). For pages (P, S, d): scale, zero (P, d).

Codes (paged layout, docs/INTERNALS.md "Paged cache layout", with the float page (P, S, d)
replaced by): int8 (P, S, d) uint8; int4 (P, S, d // 2) uint8, two codes per byte, channel 2i in
the low nibble and channel 2i + 1 in the high nibble ("low nibble first").

Writing into pages:
- `quantize_into_pages`: one appended entry per head (per-token groups): codes, scale and zero of
  each entry written at (page, slot), given as tensors (no host read: the page and slot an append
  computes on the device).
- `quantize_pages_into`: whole pages (N, S, d) written at page ids (N,), either axis: a prompt's
  pages, or a per-channel key page once it is full.

KIVI's full-precision residual (keys per channel): a page's channel groups need all its S entries,
so a head's last, partly filled page cannot be quantized per channel. The caller keeps it in full
precision: each head's entries [0, n − n mod S) live in quantized pages (the block table and
`lengths` the quantized kernels read, lengths a multiple of S for per-channel keys), and its last
n mod S entries in a float residual page of its own, e.g. (B, H, S, d) k and v with a count per head.
A decode step appends into the residual page; when a head's residual page holds S entries, the
caller quantizes it with `quantize_pages_into(residual, ..., page=<the head's next page id>,
axis="channel")` (keys; values per token with `axis="token"`), points the head's next block-table
entry at it, adds S to its quantized length and empties the residual. Attention is then the
quantized kernel over the full pages and a float attention over the residual, the two combined by
their log-sum-exp (`kvcompile.kernels.paged_attention_quant.merge_partials`; the quantized kernels
return it with `return_lse=True`). KIVI also keeps a window of R recent tokens in full precision
(R a multiple of its group): with R = S the window is exactly this residual page; a larger R is
R / S float pages per head held the same way. An entry removed from a per-channel page changes the
page's groups: the page must be quantized again from its dequantized values (double rounding) or
the entry masked with a −inf bias (bias_pages); per-token pages take removals entry by entry.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

BITS = (4, 8)
AXES = ("token", "channel")


class QuantPages(NamedTuple):
    """Quantized pages: `codes` uint8 (…, S, d · bits / 8), `scale` and `zero` float32 (…, S,
    d // group) per token or (…, d) per channel. Unpacks as (codes, scale, zero)."""

    codes: Tensor
    scale: Tensor
    zero: Tensor


def levels(bits: int) -> int:
    """The largest code, 2^bits − 1."""
    return (1 << bits) - 1


def _check_bits(bits: int, fn: str) -> None:
    if bits not in BITS:
        raise ValueError(f"{fn}: bits must be one of {BITS}, got {bits!r}")


def _check_axis(axis: str, fn: str) -> None:
    if axis not in AXES:
        raise ValueError(f"{fn}: axis must be one of {AXES}, got {axis!r}")


def code_width(d: int, bits: int) -> int:
    """Bytes of codes per entry of head dim d."""
    return d * bits // 8


def pack_int4(codes: Tensor) -> Tensor:
    """Codes (…, d) with values in [0, 15] (any integer dtype) -> uint8 (…, d // 2): channel 2i in
    the low nibble of byte i, channel 2i + 1 in its high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4: the last dim must be even, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 (…, n) -> uint8 codes (…, 2n), the inverse of `pack_int4`."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4: packed codes must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _scale_zero(lo: Tensor, hi: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """scale = (hi − lo) / (2^bits − 1), 1 where that is 0; zero = lo (fp32)."""
    scale = (hi - lo) / levels(bits)
    return torch.where(scale == 0, torch.ones_like(scale), scale), lo


def _codes(x: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """clamp(round((x − zero) / scale), 0, 2^bits − 1) as uint8 (unpacked; x, scale, zero broadcast)."""
    return torch.round((x - zero) / scale).clamp_(0, levels(bits)).to(torch.uint8)


def quantize(x: Tensor, bits: int = 8, group: int | None = None, axis: str = "token") -> QuantPages:
    """Quantize pages x (…, S, d) (any float dtype, computed in fp32) -> QuantPages(codes, scale, zero).

    bits: 8 or 4. axis "token": groups of `group` consecutive channels of each entry (default d;
    d a multiple of it), scale and zero (…, S, d // group). axis "channel": each channel over the
    S entries (group must be None), scale and zero (…, d). codes uint8 (…, S, d) for int8,
    (…, S, d // 2) for int4 (d even). The formula is the module docstring's.
    """
    _check_bits(bits, "quantize")
    _check_axis(axis, "quantize")
    if x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"quantize: x must be float pages (…, S, d), got {x.dtype} {tuple(x.shape)}")
    s, d = x.shape[-2:]
    if bits == 4 and d % 2:
        raise ValueError(f"quantize: int4 packs two channels a byte, so d must be even, got {d}")
    x = x.float()
    if axis == "channel":
        if group is not None:
            raise ValueError("quantize: axis 'channel' groups a channel over the page's S entries; "
                             f"group must be None, got {group!r}")
        lo, hi = x.amin(dim=-2), x.amax(dim=-2)  # not aminmax: torch 2.13's CPU aminmax takes ms on some strides
        scale, zero = _scale_zero(lo, hi, bits)  # (…, d)
        codes = _codes(x, scale[..., None, :], zero[..., None, :], bits)
    else:
        group = d if group is None else group
        if not isinstance(group, int) or group <= 0 or d % group:
            raise ValueError(f"quantize: group must be a positive divisor of d = {d}, got {group!r}")
        xg = x.unflatten(-1, (d // group, group))  # (…, S, d // group, group)
        lo, hi = xg.amin(dim=-1), xg.amax(dim=-1)
        scale, zero = _scale_zero(lo, hi, bits)  # (…, S, d // group)
        codes = _codes(xg, scale[..., None], zero[..., None], bits).flatten(-2)
    return QuantPages(pack_int4(codes) if bits == 4 else codes, scale, zero)


def _check_pages(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, axis: str, fn: str) -> tuple[int, int]:
    """Validate a quantized layout; returns (d, group) (group = S for axis 'channel')."""
    _check_bits(bits, fn)
    _check_axis(axis, fn)
    if codes.dtype != torch.uint8:
        raise ValueError(f"{fn}: codes must be uint8, got {codes.dtype}")
    if scale.dtype != torch.float32 or zero.dtype != torch.float32:
        raise ValueError(f"{fn}: scale and zero must be float32, got {scale.dtype}, {zero.dtype}")
    if scale.shape != zero.shape:
        raise ValueError(f"{fn}: scale {tuple(scale.shape)} and zero {tuple(zero.shape)} differ")
    if codes.dim() < 2:
        raise ValueError(f"{fn}: codes must be (…, S, d · bits / 8), got {tuple(codes.shape)}")
    d = codes.shape[-1] * 8 // bits
    if axis == "channel":
        if scale.shape != codes.shape[:-2] + (d,):
            raise ValueError(f"{fn}: per-channel scale must be {tuple(codes.shape[:-2]) + (d,)} for codes "
                             f"{tuple(codes.shape)} at {bits} bits, got {tuple(scale.shape)}")
        return d, codes.shape[-2]
    if scale.shape[:-1] != codes.shape[:-1] or scale.shape[-1] == 0 or d % scale.shape[-1]:
        raise ValueError(f"{fn}: per-token scale must be {tuple(codes.shape[:-1])} + (d // group,) with "
                         f"d = {d} for codes {tuple(codes.shape)} at {bits} bits, got {tuple(scale.shape)}")
    return d, d // scale.shape[-1]


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, axis: str = "token") -> Tensor:
    """x̂ = code · scale + zero (fp32) of quantized pages -> (…, S, d) float32.

    axis "token": scale, zero (…, S, d // group); "channel": (…, d)."""
    d, group = _check_pages(codes, scale, zero, bits, axis, "dequantize")
    c = (unpack_int4(codes) if bits == 4 else codes).float()
    if axis == "channel":
        return c * scale[..., None, :] + zero[..., None, :]
    cg = c.unflatten(-1, (d // group, group))
    return (cg * scale[..., None] + zero[..., None]).flatten(-2)


def quantize_into_pages(x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, page: Tensor, slot: Tensor,
                        bits: int) -> None:
    """Write entries x (…, d) into per-token quantized pages at (page, slot) (long tensors of x's
    leading shape, e.g. (B, H): one appended entry per head): codes[page, slot], scale[page, slot]
    and zero[page, slot] become quantize(x[…, None, :], bits, group)'s, group = d // scale.shape[-1].
    In place; nothing is read back to the host. Per-channel pages take whole pages only
    (`quantize_pages_into`)."""
    d, group = _check_pages(codes, scale, zero, bits, "token", "quantize_into_pages")
    if codes.dim() != 3:
        raise ValueError(f"quantize_into_pages: codes must be pages (P, S, d · bits / 8), got {tuple(codes.shape)}")
    if x.shape[-1] != d or page.shape != x.shape[:-1] or slot.shape != x.shape[:-1]:
        raise ValueError(f"quantize_into_pages: x {tuple(x.shape)} must be (…, {d}) with page "
                         f"{tuple(page.shape)} and slot {tuple(slot.shape)} of its leading shape")
    q = quantize(x[..., None, :], bits, group, "token")
    codes[page, slot] = q.codes[..., 0, :]
    scale[page, slot] = q.scale[..., 0, :]
    zero[page, slot] = q.zero[..., 0, :]


def quantize_pages_into(x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, page: Tensor, bits: int,
                        axis: str = "token") -> None:
    """Write whole pages x (N, S, d) into quantized pages at page ids `page` (N,) long: per channel
    (KIVI's keys, once a head's residual page is full: the module docstring) or per token (group
    d // scale.shape[-1]). In place; nothing is read back to the host."""
    d, group = _check_pages(codes, scale, zero, bits, axis, "quantize_pages_into")
    if codes.dim() != 3 or x.dim() != 3 or x.shape[1:] != (codes.shape[1], d) or page.shape != x.shape[:1]:
        raise ValueError(f"quantize_pages_into: x {tuple(x.shape)} must be (N, {codes.shape[1]}, {d}) pages "
                         f"for codes {tuple(codes.shape)}, page (N,), got page {tuple(page.shape)}")
    q = quantize(x, bits, None if axis == "channel" else group, axis)
    codes[page] = q.codes
    scale[page] = q.scale
    zero[page] = q.zero


def quantize_pair_into_pages(k: Tensor, v: Tensor, k_pages: tuple[Tensor, Tensor, Tensor],
                             v_pages: tuple[Tensor, Tensor, Tensor], page: Tensor, slot: Tensor, bits: int) -> None:
    """`quantize_into_pages` of a key and a value per head at once (k_pages, v_pages: each (codes, scale, zero)):
    one quantization of the two stacked where their layouts match (a decode step's append), else two."""
    if k.shape != v.shape or k_pages[1].shape[1:] != v_pages[1].shape[1:]:
        quantize_into_pages(k, *k_pages, page, slot, bits)
        quantize_into_pages(v, *v_pages, page, slot, bits)
        return
    d, group = _check_pages(*k_pages, bits, "token", "quantize_pair_into_pages")
    q = quantize(torch.stack([k, v])[..., None, :], bits, group, "token")
    for i, (codes, scale, zero) in enumerate((k_pages, v_pages)):
        codes[page, slot] = q.codes[i, ..., 0, :]
        scale[page, slot] = q.scale[i, ..., 0, :]
        zero[page, slot] = q.zero[i, ..., 0, :]
