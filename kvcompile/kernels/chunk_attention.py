"""The attention of one chunk of a prompt compressed while prefilling in chunks (`schedule.prefill:
chunk`, reference.ChunkedPrefill): the chunk's queries (B, Hq, T, d) attend to the entries the layer
holds (kept tokens and merge slots, with the merge rule's logit bias) and to the chunk itself, causally
among its real tokens; a pad query sees itself only (and no held entry).

    out, sums = backend(q, k, v, held, real, scale, weights)

held: (keys (B, H, E, d), values, bias (B, H, E) the merge rule's α·log w of every held entry or None
(the policy drops), stored (B, H, E) bool: the entry holds something); real (B, T) bool the chunk's real
tokens; weights (T,) or None: the row weights of the column sums Σ_t w_t A[t, i] (B, Hq, E + T) over the
held entries and the chunk, which `sums` returns where the backend computes them (else None).

Backends (what `Plan.chunk_attention` holds):
- `SdpaChunkAttention`: SDPA with the (T × E + T) logit bias as its mask; no column sums.
- `ExplicitChunkAttention`: written out with a model's logit soft-cap (Gemma 2) and learned sinks (gpt-oss), the
  merge bias added after the cap; no column sums.
- `CppChunkAttention`: the column-sums C++ kernel (kvcompile.kernels.attention_column_sums) with the held
  entries as a biased prefix of the keys (fp32 CPU): no mask is built, and each block of queries reads only
  the keys up to itself; with weights it also gives the column sums.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile.kernels.backend import KernelBackend


def _held_bias(bias: Tensor | None, stored: Tensor) -> Tensor:
    """(B, H, E) float: the merge bias of every held entry, −inf where a head holds nothing."""
    return torch.where(stored, 0.0 if bias is None else bias.float(), float("-inf"))


@dataclass(frozen=True)
class ChunkAttention(KernelBackend):
    """A chunk attention backend (the module docstring)."""

    name: ClassVar[str | None]
    column_sums: ClassVar[bool] = False  # it can also give the column sums of its probabilities

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, held, real: Tensor, scale: float,
                 weights: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def describe(self) -> str:
        return str(self.name)


@dataclass(frozen=True)
class SdpaChunkAttention(ChunkAttention):
    """SDPA with the (T × E + T) logit bias as its mask."""

    name: ClassVar[str | None] = None  # the plan's chunk_impl: None

    def __call__(self, q, k, v, held, real, scale, weights=None):
        b, hq, t, d = q.shape
        h = k.shape[1]
        hk, hv, bias, stored = held
        held_bias = _held_bias(bias, stored)[:, :, None, :].expand(b, h, t, hk.shape[2])
        held_bias = held_bias.masked_fill(~real[:, None, :, None], float("-inf"))  # a pad query sees no held entry
        rows = torch.arange(t, device=q.device)
        own = (rows[None, :] <= rows[:, None])[None] & real[:, None, :]  # (B, T, T): real keys up to the query
        own = own | (torch.eye(t, dtype=torch.bool, device=q.device)[None] & ~real[:, :, None])
        chunk_bias = torch.zeros(b, t, t, device=q.device).masked_fill(~own, float("-inf"))
        logit_bias = torch.cat([held_bias, chunk_bias[:, None].expand(b, h, t, t)], dim=-1)
        logit_bias = logit_bias.repeat_interleave(hq // h, dim=1).to(q.dtype)
        keys, values = torch.cat([hk.to(k.dtype), k], dim=2), torch.cat([hv.to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=logit_bias, scale=scale, enable_gqa=hq != h)
        return out, None

    def describe(self) -> str:
        return "None (SDPA with a (T × E + T) mask)"


@dataclass(frozen=True, eq=False)
class ExplicitChunkAttention(ChunkAttention):
    """The attention written out (engine.explicit) for a model that soft-caps its logits (Gemma 2) or has
    learned sinks (gpt-oss): logit cap·tanh(q·k·scale / cap) + the merge rule's bias of a held entry (the
    cap first: a slot of w tokens weighs w^α·exp(capped logit)), the layer's sinks one more logit per query
    head in the denominator (reference.chunk_attention); no column sums. The plan's chunk attention of such a
    model (`with_sinks` gives a layer's: Plan.chunk_backend)."""

    name: ClassVar[str | None] = "explicit"
    softcap: float = 0.0
    sinks: Tensor | None = None  # (Hq,) one layer's sinks, else None

    def with_sinks(self, sinks: Tensor | None) -> "ExplicitChunkAttention":
        return ExplicitChunkAttention(self.softcap, sinks)

    def __call__(self, q, k, v, held, real, scale, weights=None):
        from kvcompile.engine.explicit import explicit_attention

        b, hq, t, d = q.shape
        hk, hv, bias, stored = held
        rows = torch.arange(t, device=q.device)
        own = (rows[None, :] <= rows[:, None])[None] & real[:, None, :]  # (B, T, T): real keys up to the query
        own = own | (torch.eye(t, dtype=torch.bool, device=q.device)[None] & ~real[:, :, None])
        seen = stored[:, :, None, :] & real[:, None, :, None]  # (B, H, T, E): a pad query sees no held entry
        allowed = torch.cat([seen, own[:, None].expand(b, k.shape[1], t, t)], dim=-1)
        group = hq // k.shape[1]
        logit_bias = None
        if bias is not None:
            held_bias = torch.where(stored, bias.float(), 0.0)  # (B, H, E): masked entries are not allowed anyway
            logit_bias = torch.cat([held_bias, held_bias.new_zeros(b, k.shape[1], t)], dim=-1)
            logit_bias = logit_bias.repeat_interleave(group, dim=1)[:, :, None, :].to(q.dtype)
        keys, values = torch.cat([hk.to(k.dtype), k], dim=2), torch.cat([hv.to(v.dtype), v], dim=2)
        out = explicit_attention(q, keys, values, allowed.repeat_interleave(group, dim=1), scale,
                                 self.softcap or None, self.sinks, logit_bias)
        return out, None

    def describe(self) -> str:
        return f"explicit (written out{f', logits soft-capped at {self.softcap:g}' if self.softcap else ''}" \
               f"{', learned sinks' if self.sinks is not None else ''})"


@dataclass(frozen=True)
class CppChunkAttention(ChunkAttention):
    """The column-sums C++ kernel with the held entries as a biased prefix of the keys (fp32 CPU)."""

    name: ClassVar[str | None] = "cpp"
    column_sums: ClassVar[bool] = True

    def __call__(self, q, k, v, held, real, scale, weights=None):
        from kvcompile.kernels.attention_column_sums import attention_column_sums

        hk, hv, bias, stored = held
        t = q.shape[2]
        prefix = _held_bias(bias, stored) if hk.shape[2] else None  # (B, H, E)
        keys, values = torch.cat([hk.to(k.dtype), k], dim=2), torch.cat([hv.to(v.dtype), v], dim=2)
        valid = None
        if not bool(real.all()):
            valid = torch.cat([torch.ones(real.shape[0], hk.shape[2], dtype=torch.bool, device=real.device), real], 1)
        out, sums = attention_column_sums(q, keys, values, valid, scale,
                                          torch.zeros(t) if weights is None else weights, bias=prefix)
        return out.to(q.dtype), None if weights is None else sums

    def build(self, group: int, head_dim: int) -> None:
        from kvcompile.kernels import attention_column_sums

        attention_column_sums._kernel(head_dim)

    def describe(self) -> str:
        return "cpp (the column-sums kernel, held entries as a biased prefix, torch's threads)"
