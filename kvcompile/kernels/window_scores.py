"""Fused window scoring for one layer (SnapKV / PyramidKV / AdaKV, LAVa).

For KV head h, query head h·G + g and the last w' = min(window, N) prompt queries j:
    A[j, i]  = softmax_i(scale · q_j·k_i) over the keys i the query sees (causal + real),
    s_g[i]   = Σ_j A[j, i] / (real rows among the w'),   a pad query's row is 0,
    s[i]     = mean_g or max_g of s_g[i]                   (GQA reduce),
    s[i]     = avg or max over the real tokens of [i − k//2, i + k//2]   (pooling),
    s[i]    *= max over real k of ‖V_h[k]‖₁                (LAVa Eq. 6, optional),
and −inf at pad tokens: SnapKV (Li et al., 2024, §4.2–4.3), LAVa (Eq. 6, §4.3). The
ground truth is `score()` of `WindowAttention` and `Lava` in kvcompile/policies/scoring.py,
whose docstrings fix the details (padding, GQA order, pooling at the ends).

Only the w' window rows of QKᵀ are computed: O(w'·N·d) per head, never the N×N matrix.

- `window_scores_triton`: three kernels. (1) per (sequence, KV head): the softmax row
  statistics (max, denominator) of its G·w' rows, one pass over K, and the value norm
  max_k ‖V[k]‖₁ in the same pass; (2) per (sequence, KV head, block of keys): the
  normalized probabilities, summed over rows and reduced over the group; (3) pooling,
  value weight and pad mask.
- `window_scores_torch`: the lowering for CPU (Inductor compiles it): the G query heads of
  a group are one matmul against their KV head (no repeat of K), then masked softmax,
  row sum, GQA reduce, pooling by unfold.

Backends (`Plan.prompt_scores` where the fused kernel scores the prompt): `TritonWindowScores`,
`TorchWindowScores`, `CompiledWindowScores`, one call signature; `backend(name)` makes one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile.kernels.backend import KernelBackend
from kvcompile.kernels.choice import resolve

try:  # Triton is optional: the torch lowering covers machines without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

NEG_INF = float("-inf")


def window_scores(queries: Tensor, keys: Tensor, values: Tensor | None, mask: Tensor | None,
                  scale: float | None, *, window: int, gqa: str = "mean",
                  pooling: str = "none", kernel: int = 1, value_weight: bool = False,
                  impl: str | None = None) -> Tensor:
    """Window scores (B, H, N) float32, −inf at pads.

    queries (B, Hq, R, d) the last R ≥ min(window, N) prompt queries after RoPE;
    keys, values (B, H, N, d); mask (B, N) bool True = real token (None = no padding);
    pooling: none | avg | max with odd `kernel`; value_weight: multiply by LAVa's
    max_k ‖V[k]‖₁. impl: "triton" | "torch" (eager) | "compiled" (the torch lowering
    through Inductor) | None (Triton on CUDA, else torch), resolved by
    `kvcompile.kernels.choice.resolve("window_scores", ...)`.
    """
    name = resolve("window_scores", impl, queries.device, queries.dtype)
    return backend(name)(queries, keys, values, mask, scale, window=window, gqa=gqa, pooling=pooling,
                         kernel=kernel, value_weight=value_weight)


def score_fused(scorer, state, impl: str | None = None) -> Tensor:
    """`scorer.score(state)` through the fused kernel, for the parts that are window scorers
    (their `fused_window()` gives the kernel's arguments: `WindowAttention`, `Lava`)."""
    return backend(resolve("window_scores", impl, state.queries.device, state.queries.dtype)).score(scorer, state)


@dataclass(frozen=True)
class WindowScores(KernelBackend):
    """A window-scoring backend (what `Plan.prompt_scores` holds where the fused kernel scores the prompt):
    `backend(queries, keys, values, mask, scale, *, window, gqa, pooling, kernel, value_weight)` -> (B, H, N),
    and `backend.score(scorer, state)`: a window scorer part's prompt scores through it."""

    name: ClassVar[str]
    in_attention: ClassVar[bool] = False  # the prompt's attention does not compute these scores

    @property
    def label(self) -> str:
        """The plan's name of this way of scoring the prompt (Plan.score_impl)."""
        return "fused:" + self.name

    def __call__(self, queries, keys, values, mask, scale, *, window: int, gqa: str = "mean", pooling: str = "none",
                 kernel: int = 1, value_weight: bool = False) -> Tensor:
        _check(queries, keys, values, mask, window, gqa, pooling, kernel, value_weight)
        return self.run(queries, keys, values, mask, scale, window=window, gqa=gqa, pooling=pooling, kernel=kernel,
                        value_weight=value_weight)

    def run(self, queries, keys, values, mask, scale, **options) -> Tensor:
        raise NotImplementedError

    def score(self, scorer, state) -> Tensor:
        fused = scorer.fused_window() if hasattr(scorer, "fused_window") else None
        if fused is None:
            raise ValueError(f"window_scores covers the window scorers (window_attention, lava), "
                             f"not {getattr(scorer, 'name', scorer)!r}")
        return self(state.queries, state.keys, state.values, state.mask, state.scale, **fused)

    def build(self, group: int, head_dim: int) -> None:
        """Nothing is built ahead of time (Triton and Inductor compile on first use)."""

    def describe(self) -> str:
        return f"fused:{self.name} (kernels.window_scores)"


@dataclass(frozen=True)
class TritonWindowScores(WindowScores):
    """Three Triton kernels (`window_scores_triton`)."""

    name: ClassVar[str] = "triton"

    def run(self, queries, keys, values, mask, scale, **options):
        return window_scores_triton(queries, keys, values, mask, scale, **options)


@dataclass(frozen=True)
class TorchWindowScores(WindowScores):
    """The torch lowering, eager (`window_scores_torch`)."""

    name: ClassVar[str] = "torch"

    def run(self, queries, keys, values, mask, scale, **options):
        return window_scores_torch(queries, keys, values, mask, scale, **options)


@dataclass(frozen=True)
class CompiledWindowScores(WindowScores):
    """The torch lowering through Inductor."""

    name: ClassVar[str] = "compiled"

    def run(self, queries, keys, values, mask, scale, **options):
        return _compiled()(queries, keys, values, mask, scale, **options)


def backend(name: str) -> WindowScores:
    """The backend of impl `name` (one `choice.resolve("window_scores", ...)` returned)."""
    return {"triton": TritonWindowScores, "torch": TorchWindowScores, "compiled": CompiledWindowScores}[name]()


def _check(queries, keys, values, mask, window, gqa, pooling, kernel, value_weight) -> None:
    b, hq, r, d = queries.shape
    _, h, n, dk = keys.shape
    if keys.shape[0] != b or dk != d or hq % h:
        raise ValueError(f"window_scores: queries {tuple(queries.shape)} and keys "
                         f"{tuple(keys.shape)} do not match")
    if not 1 <= min(window, n) <= r:
        raise ValueError(f"window_scores: window {window} needs 1 <= min(window, N={n}) <= R={r}")
    if gqa not in ("mean", "max") or pooling not in ("none", "avg", "max") or kernel % 2 != 1:
        raise ValueError(f"window_scores: bad gqa {gqa!r}, pooling {pooling!r} or kernel {kernel}")
    if value_weight and (values is None or values.shape != keys.shape):
        raise ValueError("window_scores: value_weight needs values shaped like keys")
    if mask is not None and mask.shape != (b, n):
        raise ValueError(f"window_scores: mask {tuple(mask.shape)} must be {(b, n)}")


# --------------------------------------------------------------------------- torch

def window_scores_torch(queries: Tensor, keys: Tensor, values: Tensor | None,
                        mask: Tensor | None, scale: float | None, *, window: int,
                        gqa: str = "mean", pooling: str = "none", kernel: int = 1,
                        value_weight: bool = False) -> Tensor:
    """The torch lowering (CPU; Inductor compiles it). Same math as the module docstring."""
    b, hq, r, d = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    g, rows = hq // h, min(window, n)
    scale = d ** -0.5 if scale is None else scale
    real = torch.ones(b, n, dtype=torch.bool, device=keys.device) if mask is None else mask.bool()

    q = queries[:, :, r - rows:].float().reshape(b, h, g * rows, d)  # a group's rows together
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) * scale  # (B, H, G·w', N)
    query_pos = torch.arange(n - rows, n, device=keys.device).repeat(g)  # (G·w',)
    visible = (torch.arange(n, device=keys.device) <= query_pos[:, None]) & real[:, None, None, :]
    probs = torch.softmax(logits.masked_fill(~visible, NEG_INF), dim=-1)
    real_rows = real[:, n - rows:]  # (B, w')
    probs = torch.where(real_rows.repeat(1, g)[:, None, :, None], probs, 0.0)  # pad rows: 0
    per_query_head = probs.view(b, h, g, rows, n).sum(3) / real_rows.sum(-1).clamp(min=1)[:, None, None, None]
    scores = per_query_head.mean(2) if gqa == "mean" else per_query_head.amax(2)  # (B, H, N)
    scores = _pool(scores, real, pooling, kernel)
    if value_weight:
        value_l1 = values.float().abs().sum(-1).masked_fill(~real[:, None], 0.0)  # (B, H, N)
        scores = scores * value_l1.amax(-1, keepdim=True)
    return scores.masked_fill(~real[:, None], NEG_INF)


@functools.cache
def _compiled():
    return torch.compile(window_scores_torch)


def _pool(scores: Tensor, real: Tensor, pooling: str, kernel: int) -> Tensor:
    """Stride-1 pooling over the real tokens of each window (avg: their mean, max: their max)."""
    if pooling == "none" or kernel == 1:
        return scores
    half = kernel // 2
    real_h = real[:, None].expand_as(scores)
    if pooling == "max":
        padded = F.pad(scores.masked_fill(~real_h, NEG_INF), (half, half), value=NEG_INF)
        return padded.unfold(-1, kernel, 1).amax(-1)
    # each window's terms added left to right, as the specification's pooling (policies.scoring.window_sum) and
    # the Triton kernel do: windows over the same real tokens give the same float (ties stay ties)
    windows = F.pad(scores.masked_fill(~real_h, 0.0), (half, half)).unfold(-1, kernel, 1)
    total = windows[..., 0]
    for j in range(1, kernel):
        total = total + windows[..., j]
    count = F.pad(real_h.float(), (half, half)).unfold(-1, kernel, 1).sum(-1)
    return total / count.clamp(min=1.0)


# -------------------------------------------------------------------------- triton

def window_scores_triton(queries: Tensor, keys: Tensor, values: Tensor | None,
                         mask: Tensor | None, scale: float | None, *, window: int,
                         gqa: str = "mean", pooling: str = "none", kernel: int = 1,
                         value_weight: bool = False, block_n: int = 32) -> Tensor:
    """Window scores by three Triton kernels (see the module docstring)."""
    if triton is None:
        raise RuntimeError("window_scores_triton needs triton")
    b, hq, r, d = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    g, rows = hq // h, min(window, n)
    scale = d ** -0.5 if scale is None else scale
    dev = keys.device
    q = queries.contiguous()
    k = keys.contiguous()
    v = values.contiguous() if value_weight else k  # a dummy pointer without value weight
    real = (torch.ones(b, n, device=dev, dtype=torch.int8) if mask is None
            else mask.to(torch.int8).contiguous())
    block_g = triton.next_power_of_2(g)
    block_w = max(16 // block_g, triton.next_power_of_2(rows))  # tl.dot wants >= 16 rows
    block_d = max(16, triton.next_power_of_2(d))
    block_n = max(16, block_n)
    row_max = torch.empty(b * h, block_g * block_w, device=dev, dtype=torch.float32)
    row_sum = torch.empty_like(row_max)
    value_max = torch.empty(b * h, device=dev, dtype=torch.float32)
    # q·Kᵀ in the inputs' dtype where both are 16-bit (tensor cores, exact products, fp32
    # sums), else in fp32: the (G·w', d) queries in fp32 do not fit a warp group's registers.
    dot_fp32 = q.dtype != k.dtype or k.dtype == torch.float32
    meta = dict(G=g, ROWS=rows, D=d, BLOCK_G=block_g, BLOCK_W=block_w, BLOCK_D=block_d,
                BLOCK_N=block_n, DOT_FP32=dot_fp32,
                num_warps=8 if dot_fp32 else 4)  # fp32 queries: twice the threads to hold them
    _row_stats_kernel[(b * h,)](q, k, v, real, row_max, row_sum, value_max, scale, h, n, r,
                                VALUE_WEIGHT=value_weight, **meta)
    raw = torch.empty(b, h, n, device=dev, dtype=torch.float32)
    _window_scores_kernel[(b * h, triton.cdiv(n, block_n))](
        q, k, real, row_max, row_sum, raw, scale, h, n, r, GQA_MAX=gqa == "max", **meta)
    out = torch.empty_like(raw)
    kernel = 1 if pooling == "none" else kernel
    _pool_kernel[(b * h, triton.cdiv(n, block_n))](
        raw, real, value_max, out, h, n, KERNEL=kernel, POOL_MAX=pooling == "max",
        VALUE_WEIGHT=value_weight, BLOCK_N=block_n)
    return out


if triton is not None:

    @triton.jit
    def _window_rows(q_ptr, real_ptr, bh, H, N, R, G: tl.constexpr, ROWS: tl.constexpr,
                     D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
        """The G·w' window queries of one KV head as (BLOCK_G·BLOCK_W, BLOCK_D) (fp32 if
        DOT_FP32, else in their own dtype, for a tensor-core q·Kᵀ with fp32 sums), row
        g·BLOCK_W + j = query head h·G + g at prompt index N − w' + j; whether each row
        is a real query (pad queries and padding rows see nothing); its prompt index."""
        b = bh // H
        h = bh % H
        offs_r = tl.arange(0, BLOCK_G * BLOCK_W)
        g = offs_r // BLOCK_W
        j = offs_r % BLOCK_W
        row_ok = (g < G) & (j < ROWS)
        row_ok = row_ok & (tl.load(real_ptr + b * N + N - ROWS + j, mask=row_ok, other=0) != 0)
        offs_d = tl.arange(0, BLOCK_D)
        q_row = ((b * H + h) * G + g).to(tl.int64) * R + (R - ROWS + j)
        q = tl.load(q_ptr + q_row[:, None] * D + offs_d[None, :],
                    mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        return q, row_ok, N - ROWS + j  # queries, valid rows, absolute query positions

    @triton.jit
    def _logits(q, k_ptr, real_ptr, bh, H, N, offs_n, query_pos, row_ok, scale,
                D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
        """scale · q·k over a block of keys, −inf where a query does not see the key
        (causal, pad key, pad or missing row); also returns whether each key is real."""
        b = bh // H
        offs_d = tl.arange(0, BLOCK_D)
        key_ok = offs_n < N
        real = tl.load(real_ptr + b * N + offs_n, mask=key_ok, other=0) != 0
        k = tl.load(k_ptr + (bh.to(tl.int64) * N + offs_n)[:, None] * D + offs_d[None, :],
                    mask=key_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # fp32 sums
        seen = (row_ok[:, None] & (real & key_ok)[None, :]
                & (offs_n[None, :] <= query_pos[:, None]))
        return tl.where(seen, logits, float("-inf")), real & key_ok

    @triton.jit
    def _row_stats_kernel(q_ptr, k_ptr, v_ptr, real_ptr, max_ptr, sum_ptr, vmax_ptr,
                          scale, H, N, R, VALUE_WEIGHT: tl.constexpr,
                          G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        """Softmax max and denominator of every window row of one KV head (online over
        key blocks), and max over its real keys of ‖V[k]‖₁."""
        bh = tl.program_id(0)
        q, row_ok, query_pos = _window_rows(q_ptr, real_ptr, bh, H, N, R, G, ROWS, D,
                                            BLOCK_G, BLOCK_W, BLOCK_D, DOT_FP32)
        offs_d = tl.arange(0, BLOCK_D)
        m_i = tl.full([BLOCK_G * BLOCK_W], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G * BLOCK_W], tl.float32)
        v_max = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, N, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            logits, real = _logits(q, k_ptr, real_ptr, bh, H, N, offs_n, query_pos, row_ok,
                                   scale, D, BLOCK_D, DOT_FP32)
            m_new = tl.maximum(m_i, tl.max(logits, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
            m_i = m_new
            if VALUE_WEIGHT:
                v = tl.load(v_ptr + (bh.to(tl.int64) * N + offs_n)[:, None] * D + offs_d[None, :],
                            mask=real[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
                v_max = tl.maximum(v_max, tl.sum(tl.abs(v), axis=1))
        offs_r = tl.arange(0, BLOCK_G * BLOCK_W)
        tl.store(max_ptr + bh * BLOCK_G * BLOCK_W + offs_r, m_i)
        tl.store(sum_ptr + bh * BLOCK_G * BLOCK_W + offs_r, l_i)
        tl.store(vmax_ptr + bh, tl.max(v_max, axis=0))

    @triton.jit
    def _window_scores_kernel(q_ptr, k_ptr, real_ptr, max_ptr, sum_ptr, out_ptr,
                              scale, H, N, R, GQA_MAX: tl.constexpr,
                              G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                              DOT_FP32: tl.constexpr):
        """Unpooled scores of one block of keys: probabilities summed over the window
        rows, divided by the real rows, reduced over the G query heads."""
        bh = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        q, row_ok, query_pos = _window_rows(q_ptr, real_ptr, bh, H, N, R, G, ROWS, D,
                                            BLOCK_G, BLOCK_W, BLOCK_D, DOT_FP32)
        logits, real = _logits(q, k_ptr, real_ptr, bh, H, N, offs_n, query_pos, row_ok,
                               scale, D, BLOCK_D, DOT_FP32)
        offs_r = tl.arange(0, BLOCK_G * BLOCK_W)
        m_i = tl.load(max_ptr + bh * BLOCK_G * BLOCK_W + offs_r)
        l_i = tl.load(sum_ptr + bh * BLOCK_G * BLOCK_W + offs_r)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        probs = tl.exp(logits - m_safe[:, None]) / tl.where(l_i > 0, l_i, 1.0)[:, None]
        per_head = tl.sum(tl.reshape(probs, (BLOCK_G, BLOCK_W, BLOCK_N)), axis=1)
        b = bh // H
        offs_w = tl.arange(0, BLOCK_W)
        row_real = tl.load(real_ptr + b * N + N - ROWS + offs_w, mask=offs_w < ROWS, other=0)
        real_rows = tl.maximum(tl.sum((row_real != 0).to(tl.float32), axis=0), 1.0)
        per_head = per_head / real_rows  # (BLOCK_G, BLOCK_N)
        head_ok = (tl.arange(0, BLOCK_G) < G)[:, None]
        if GQA_MAX:
            scores = tl.max(tl.where(head_ok, per_head, float("-inf")), axis=0)
        else:
            scores = tl.sum(tl.where(head_ok, per_head, 0.0), axis=0) / G
        tl.store(out_ptr + bh.to(tl.int64) * N + offs_n, scores, mask=offs_n < N)

    @triton.jit
    def _pool_kernel(raw_ptr, real_ptr, vmax_ptr, out_ptr, H, N, KERNEL: tl.constexpr,
                     POOL_MAX: tl.constexpr, VALUE_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
        """Pooling over the real tokens of each window, value weight, −inf at pads."""
        bh = tl.program_id(0)
        b = bh // H
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        total = tl.zeros([BLOCK_N], tl.float32)
        count = tl.zeros([BLOCK_N], tl.float32)
        best = tl.full([BLOCK_N], float("-inf"), tl.float32)
        for o in tl.static_range(KERNEL):
            idx = offs_n + (o - KERNEL // 2)
            inside = (idx >= 0) & (idx < N)
            real = tl.load(real_ptr + b * N + idx, mask=inside, other=0) != 0
            x = tl.load(raw_ptr + bh.to(tl.int64) * N + idx, mask=real, other=0.0)
            total += x
            count += real.to(tl.float32)
            best = tl.maximum(best, tl.where(real, x, float("-inf")))
        if POOL_MAX:
            scores = best
        else:
            scores = total / tl.maximum(count, 1.0)
        if VALUE_WEIGHT:
            scores = scores * tl.load(vmax_ptr + bh)
        ok = offs_n < N
        real = tl.load(real_ptr + b * N + offs_n, mask=ok, other=0) != 0
        tl.store(out_ptr + bh.to(tl.int64) * N + offs_n,
                 tl.where(real, scores, float("-inf")), mask=ok)
