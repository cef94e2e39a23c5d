"""Selection and gather of one layer's prefill compression (docs/INTERNALS.md "Kernels").

Selection: which of the M candidate entries (B, H, M) of a layer stay. The order is the
reference's: `ranks` (B, H, M) long from `kvcompile.policies.ranking.rank`, a permutation
of 0 … H·M − 1 per sequence (0 = kept first; ties already broken: key, later position,
lower head), so a top-k is "every candidate whose rank is below the k-th smallest" and no
kernel ever compares scores or breaks a tie itself.
- `keep_best`: the entries already kept (protected), plus the best `budget − |kept|`
  other valid entries of each head (heads: uniform; the per-head floor of pooled) or of
  each sequence over all its heads (heads: pooled, AdaKV Alg. 1 / LAVa Alg. 1 line 9).
- `keep_threshold`: DBudgetKV (Ni et al., 2025, §3.2–3.3, Alg. 1, Eq. 2) per head: evict
  the longest least-important-first prefix of the unprotected entries whose removal keeps
  1 − ‖s_kept‖₂ / ‖s‖₂ ≤ t, in float64 (`AttentionNorm.keep`).
The policy's logic (ranking, protected sets, head budgets) is not here: `kvcompile.selection.select_with`
runs it and calls these two kernels (each heads and threshold part composes its selection from them:
`keep_ranked`).

Gather: `gather_pages` writes the `take` (B, H, E) rows of each head — key, value, score,
position, count — into pages the page store allocated (`kvcompile.store.LayerStore.build`: entry e
of head (b, h) at slot e % S of page block_table[b, h, e // S]), in entry order, from entry `start` (B, H) on.

Implementations (dispatchers take impl = "triton" | "torch" | "compiled" | None = Triton
on CUDA, else torch; `kvcompile.kernels.choice.resolve("select", ...)`):
- Triton, no sort: a k-th-value search by bisection over the integer rank range
  (ceil(log2(H·M + 1)) counting passes over a head or a sequence), and for the threshold
  the same bisection on the cut, with the float64 norm of the entries below it; the
  gather compacts by a cumulative sum of `take` block by block.
- torch lowering (CPU; Inductor compiles the selection): one sort of the candidates' ranks
  per head or sequence, a gather of the k-th; the threshold by a sort and a reverse
  cumulative sum as the reference; the gather by index_put. No Python loop over heads
  or sequences.
Backends (`Plan.selection`): `TritonSelection`, `TorchSelection` (one thread on a CPU), `CompiledSelection`,
one set of methods (`keep_best`, `keep_threshold`, `gather_pages`); `backend(name)` makes one, `backend_for(impl,
like)` the one an `impl=` names on a tensor's device, and the module functions with `impl=` go through it.
Exactness: top-k masks are equal to the reference's by construction (distinct integer
ranks). The threshold's float64 sums may associate differently from the reference's
cumsum (Triton: blocked sums), which can only matter when a norm change equals t to the
last bit (never for scores whose squares add exactly, e.g. small integers).
"""
from __future__ import annotations

import contextlib
import functools
import math
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


def backend_for(impl: str | None, like: Tensor) -> "Selection":
    """The backend of `impl` (resolved by `kvcompile.kernels.choice.resolve` on `like`'s device)."""
    return backend(resolve("select", impl, like.device, like.dtype), cuda=like.is_cuda)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread for the block (see TorchSelection)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Selection(KernelBackend):
    """A selection and gather backend (what `Plan.selection` holds): `keep_best`, `keep_threshold` and
    `gather_pages` with the module functions' arguments (without `impl`)."""

    name: ClassVar[str]

    def serial(self):
        """The context the backend's calls run in (TorchSelection: one thread)."""
        return contextlib.nullcontext()

    def keep_best(self, ranks, kept, valid, budget, *, pooled: bool = False) -> Tensor:
        b, h, m = ranks.shape
        if budget.shape != ((b,) if pooled else (b, h)):
            raise ValueError(f"keep_best: budget {tuple(budget.shape)} for ranks {tuple(ranks.shape)}, pooled={pooled}")
        if b * h * m == 0:
            return kept.clone()
        return self._keep_best(ranks, kept, valid, budget, pooled)

    def keep_threshold(self, ranks, protected, valid, scores, t: float) -> Tensor:
        if ranks.numel() == 0:
            return valid.clone()
        return self._keep_threshold(ranks, protected, valid, scores, t)

    def gather_pages(self, k_pages, v_pages, score_pages, pos_pages, count_pages, block_table, start, keys, values,
                     scores, positions, counts, take) -> None:
        if take.numel() == 0:
            return
        with self.serial():
            self._gather_pages(k_pages, v_pages, score_pages, pos_pages, count_pages, block_table, start, keys,
                               values, scores, positions, counts, take)

    def _keep_best(self, ranks, kept, valid, budget, pooled):
        raise NotImplementedError

    def _keep_threshold(self, ranks, protected, valid, scores, t):
        raise NotImplementedError

    def _gather_pages(self, *args):
        gather_pages_torch(*args)


@dataclass(frozen=True)
class TritonSelection(Selection):
    """Triton's bisection kernels (no sort) and block-compacting gather."""

    name: ClassVar[str] = "triton"

    def _keep_best(self, ranks, kept, valid, budget, pooled):
        return keep_best_triton(ranks, kept, valid, budget, pooled)

    def _keep_threshold(self, ranks, protected, valid, scores, t):
        return keep_threshold_triton(ranks, protected, valid, scores, t)

    def _gather_pages(self, *args):
        gather_pages_triton(*args)


@dataclass(frozen=True)
class TorchSelection(Selection):
    """The torch lowering, eager. On a CPU its calls run on one thread: its ops touch a few thousand
    elements, less work than an OpenMP fork/join on a shared machine (N = 4096, H = 3 under load:
    select + gather 2 ms on one thread, 40 ms on two)."""

    name: ClassVar[str] = "torch"
    one_thread: bool = True  # on a CPU (CUDA tensors ignore torch's CPU threads)

    def serial(self):
        return _one_thread() if self.one_thread else contextlib.nullcontext()

    def _keep_best(self, ranks, kept, valid, budget, pooled):
        return keep_best_torch(ranks, kept, valid, budget, pooled)

    def _keep_threshold(self, ranks, protected, valid, scores, t):
        return keep_threshold_torch(ranks, protected, valid, scores, t)

    def describe(self) -> str:
        return "torch (one thread)" if self.one_thread else "torch"


@dataclass(frozen=True)
class CompiledSelection(Selection):
    """The torch lowering of the selection through Inductor (the gather stays eager: a memory-bound copy)."""

    name: ClassVar[str] = "compiled"

    def _keep_best(self, ranks, kept, valid, budget, pooled):
        return _compiled(keep_best_torch)(ranks, kept, valid, budget, pooled)

    def _keep_threshold(self, ranks, protected, valid, scores, t):
        return _compiled(keep_threshold_torch)(ranks, protected, valid, scores, t)


def backend(name: str, cuda: bool = False) -> Selection:
    """The backend of impl `name` (one `choice.resolve("select", ...)` returned); `cuda`: it runs on CUDA
    tensors (the torch lowering then keeps torch's threads as they are)."""
    if name == "torch":
        return TorchSelection(one_thread=not cuda)
    return {"triton": TritonSelection, "compiled": CompiledSelection}[name]()


# --------------------------------------------------------------------------- top-k

def keep_best(ranks: Tensor, kept: Tensor, valid: Tensor, budget: Tensor, *, pooled: bool = False,
              impl: str | None = None) -> Tensor:
    """kept (B, H, M) bool, plus the lowest-ranked valid entries not yet kept, up to `budget`
    entries in all: per head with budget (B, H), or per sequence over all heads (pooled)
    with budget (B,). ranks (B, H, M) distinct in [0, H·M) per sequence."""
    return backend_for(impl, ranks).keep_best(ranks, kept, valid, budget, pooled=pooled)


def keep_best_torch(ranks: Tensor, kept: Tensor, valid: Tensor, budget: Tensor, pooled: bool = False) -> Tensor:
    """The lowering: in each group (a head, or a sequence when pooled) the candidates' ranks
    sorted once; the candidates ranked at or above the need-th one are added."""
    b, h, m = ranks.shape
    groups, width = (b, h * m) if pooled else (b * h, m)
    rank = ranks.reshape(groups, width)
    held = kept.reshape(groups, width)
    candidate = valid.reshape(groups, width) & ~held
    need = budget.reshape(groups) - held.sum(-1)
    ordered = torch.where(candidate, rank, h * m).sort(dim=-1).values  # h·m = "no candidate"
    kth = ordered.gather(-1, (need - 1).clamp(0, width - 1)[:, None])
    added = candidate & (rank <= kth) & (need > 0)[:, None]
    return (held | added).view(b, h, m)


def keep_best_triton(ranks: Tensor, kept: Tensor, valid: Tensor, budget: Tensor, pooled: bool = False) -> Tensor:
    """One program per group (a head, or a sequence when pooled): bisection on the rank τ."""
    if triton is None:
        raise RuntimeError("keep_best_triton needs triton")
    b, h, m = ranks.shape
    groups, width = (b, h * m) if pooled else (b * h, m)
    out = torch.empty(b, h, m, dtype=torch.int8, device=ranks.device)
    bound = h * m
    _keep_best_kernel[(groups,)](
        ranks.to(torch.int32).contiguous(), kept.to(torch.int8).contiguous(), valid.to(torch.int8).contiguous(),
        budget.reshape(groups).to(torch.int32).contiguous(), out, width, bound,
        STEPS=max(1, math.ceil(math.log2(bound + 1))), BLOCK=min(1024, triton.next_power_of_2(width)))
    return out.bool()


# --------------------------------------------------------------------------- threshold

def keep_threshold(ranks: Tensor, protected: Tensor, valid: Tensor, scores: Tensor, t: float, *,
                   impl: str | None = None) -> Tensor:
    """DBudgetKV Alg. 1 per head: valid entries minus the longest prefix of the unprotected
    ones, taken least important (highest rank) first, whose eviction changes the score norm
    by at most t: 1 − ‖s_kept‖₂ / ‖s‖₂ ≤ t (norms over valid entries, float64; a head whose
    scores are all 0 changes by 0). ranks, protected, valid, scores (B, H, M)."""
    return backend_for(impl, ranks).keep_threshold(ranks, protected, valid, scores, t)


def keep_threshold_torch(ranks: Tensor, protected: Tensor, valid: Tensor, scores: Tensor, t: float) -> Tensor:
    """The lowering: candidates sorted least important first (non-candidates after them, as
    zeros), the reference's reverse cumulative sum of squares, the cut where the change of
    norm after evicting entries 0 … j first exceeds t (it is non-decreasing in j)."""
    candidate = valid & ~protected
    squares = torch.where(valid, scores.double(), 0.0) ** 2
    staying = torch.where(valid & protected, squares, 0.0).sum(-1, keepdim=True)
    order = torch.where(candidate, ranks, -1).argsort(dim=-1, descending=True)
    evictable = torch.where(candidate, squares, 0.0).gather(-1, order)
    suffix = evictable.flip(-1).cumsum(-1).flip(-1)  # Σ of the entries from j on
    full = (staying + suffix[..., :1]).clamp(min=0).sqrt()
    left = (staying + F.pad(suffix[..., 1:], (0, 1))).clamp(min=0).sqrt()  # once 0 … j are evicted
    change = torch.where(full > 0, 1 - left / full, 0.0)
    evict = (change <= t) & candidate.gather(-1, order)
    return valid & ~torch.zeros_like(evict).scatter(-1, order, evict)


def keep_threshold_triton(ranks: Tensor, protected: Tensor, valid: Tensor, scores: Tensor, t: float) -> Tensor:
    """One program per (sequence, KV head): bisection on the rank ρ from which candidates go."""
    if triton is None:
        raise RuntimeError("keep_threshold_triton needs triton")
    b, h, m = ranks.shape
    out = torch.empty(b, h, m, dtype=torch.int8, device=ranks.device)
    bound = h * m
    t64 = torch.tensor([float(t)], dtype=torch.float64, device=ranks.device)  # a float argument would be fp32
    _threshold_kernel[(b * h,)](
        ranks.to(torch.int32).contiguous(), protected.to(torch.int8).contiguous(),
        valid.to(torch.int8).contiguous(), scores.contiguous(), t64, out, m, bound,
        STEPS=max(1, math.ceil(math.log2(bound + 1))), BLOCK=min(1024, triton.next_power_of_2(m)))
    return out.bool()


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


# --------------------------------------------------------------------------- gather

def gather_pages(k_pages: Tensor, v_pages: Tensor, score_pages: Tensor, pos_pages: Tensor, count_pages: Tensor,
                 block_table: Tensor, start: Tensor, keys: Tensor, values: Tensor, scores: Tensor,
                 positions: Tensor, counts: Tensor, take: Tensor, *, impl: str | None = None) -> None:
    """Write the taken rows of each head into its pages, in place.

    Pages: k_pages, v_pages (P, S, d), score_pages, count_pages (P, S) float32, pos_pages
    (P, S) long; block_table (B, H, ·). Rows: keys, values (B, H, E, d), scores, counts
    (B, H, E) float, positions (B, H, E) long, take (B, H, E) bool. The i-th taken row of
    head (b, h) (entry order) becomes its entry start[b, h] + i. "compiled" runs the torch
    lowering (the copy is memory-bound: nothing to fuse)."""
    backend_for(impl, keys).gather_pages(k_pages, v_pages, score_pages, pos_pages, count_pages, block_table, start,
                                      keys, values, scores, positions, counts, take)


def gather_pages_torch(k_pages, v_pages, score_pages, pos_pages, count_pages, block_table, start,
                       keys, values, scores, positions, counts, take) -> None:
    """The lowering: `write_rows` of the five page fields."""
    write_rows((k_pages, v_pages, score_pages, pos_pages, count_pages), (keys, values, scores, positions, counts),
               block_table, start, take)


def write_rows(pages: tuple, rows: tuple, block_table: Tensor, start: Tensor, take: Tensor) -> None:
    """Any per-entry page tensors (P, S, ...) from rows (B, H, E, ...): entry = start + (running count of
    take) − 1 of the row's head, then one index_put per tensor (a quantized store's scales use it too)."""
    if not take.numel():
        return
    s = pages[0].shape[1]
    bi, hi, ei = take.nonzero(as_tuple=True)  # row-major: per head, in entry order
    entry = start[bi, hi] + (take.cumsum(-1) - 1)[bi, hi, ei]
    page, slot = block_table[bi, hi, entry // s].long(), entry % s
    for p, r in zip(pages, rows):
        p[page, slot] = r[bi, hi, ei].to(p.dtype)


def gather_pages_triton(k_pages, v_pages, score_pages, pos_pages, count_pages, block_table, start,
                        keys, values, scores, positions, counts, take) -> None:
    """One program per (sequence, KV head): blocks of rows compacted by a cumulative sum."""
    if triton is None:
        raise RuntimeError("gather_pages_triton needs triton")
    b, h, e, d = keys.shape
    dv = values.shape[-1]
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages), ("score_pages", score_pages),
                        ("pos_pages", pos_pages), ("count_pages", count_pages)):
        if not pages.is_contiguous():
            raise ValueError(f"gather_pages: {name} must be contiguous (written in place)")
    table = block_table.to(torch.int64).contiguous()
    _gather_kernel[(b * h,)](
        k_pages, v_pages, score_pages, pos_pages, count_pages, table, start.to(torch.int64).contiguous(),
        keys.contiguous(), values.contiguous(), scores.contiguous(), positions.to(torch.int64).contiguous(),
        counts.contiguous(), take.to(torch.int8).contiguous(), e, table.shape[-1],
        S=k_pages.shape[1], D=d, DV=dv, BLOCK_E=min(64, triton.next_power_of_2(e)),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv))


# -------------------------------------------------------------------------- triton

if triton is not None:

    @triton.jit
    def _entries(rank_ptr, held_ptr, valid_ptr, base, start, width, BLOCK: tl.constexpr):
        """One block of a group's entries: offsets, in range, rank, held (or protected), valid
        (0 outside the group)."""
        offs = start + tl.arange(0, BLOCK)
        inside = offs < width
        rank = tl.load(rank_ptr + base + offs, mask=inside, other=0)
        held = tl.load(held_ptr + base + offs, mask=inside, other=0) != 0
        valid = tl.load(valid_ptr + base + offs, mask=inside, other=0) != 0
        return offs, inside, rank, held, valid

    @triton.jit
    def _count_below(rank_ptr, held_ptr, valid_ptr, base, width, tau, BLOCK: tl.constexpr):
        """Candidates (valid, not held) of the group whose rank is below tau."""
        count = tl.zeros([], tl.int32)
        for start in range(0, width, BLOCK):
            _, _, rank, held, valid = _entries(rank_ptr, held_ptr, valid_ptr, base, start, width, BLOCK)
            count += tl.sum((valid & ~held & (rank < tau)).to(tl.int32), axis=0)
        return count

    @triton.jit
    def _keep_best_kernel(rank_ptr, held_ptr, valid_ptr, budget_ptr, out_ptr, width, bound,
                          STEPS: tl.constexpr, BLOCK: tl.constexpr):
        """Group g keeps its held entries and every candidate ranked below τ, the smallest
        τ in [0, bound] with budget − |held| candidates below it (bound: all of them)."""
        g = tl.program_id(0)
        base = g.to(tl.int64) * width
        held_count = tl.zeros([], tl.int32)
        for start in range(0, width, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            held = tl.load(held_ptr + base + offs, mask=offs < width, other=0) != 0
            held_count += tl.sum(held.to(tl.int32), axis=0)
        need = tl.load(budget_ptr + g) - held_count
        lo = tl.zeros([], tl.int32)
        hi = lo + bound
        for _ in range(STEPS):  # invariant: the answer lies in [lo, hi]
            mid = (lo + hi) // 2
            enough = _count_below(rank_ptr, held_ptr, valid_ptr, base, width, mid, BLOCK) >= need
            hi = tl.where(enough, mid, hi)
            lo = tl.where(enough, lo, mid + 1)
        for start in range(0, width, BLOCK):
            offs, inside, rank, held, valid = _entries(rank_ptr, held_ptr, valid_ptr, base, start, width, BLOCK)
            keep = held | (valid & (rank < lo))
            tl.store(out_ptr + base + offs, keep.to(tl.int8), mask=inside)

    @triton.jit
    def _norm_below(rank_ptr, prot_ptr, valid_ptr, score_ptr, base, width, rho, BLOCK: tl.constexpr):
        """float64 Σ s² over the valid entries kept when candidates ranked ≥ rho are evicted."""
        total = tl.zeros([], tl.float64)
        for start in range(0, width, BLOCK):
            offs, _, rank, prot, valid = _entries(rank_ptr, prot_ptr, valid_ptr, base, start, width, BLOCK)
            s = tl.load(score_ptr + base + offs, mask=valid, other=0.0).to(tl.float64)
            stays = valid & (prot | (rank < rho))
            total += tl.sum(tl.where(stays, s * s, 0.0), axis=0)
        return total

    @triton.jit
    def _threshold_kernel(rank_ptr, prot_ptr, valid_ptr, score_ptr, t_ptr, out_ptr, width, bound,
                          STEPS: tl.constexpr, BLOCK: tl.constexpr):
        """Head g evicts its candidates ranked ≥ ρ, the smallest ρ in [0, bound] whose
        eviction keeps 1 − ‖s_kept‖/‖s‖ ≤ t (DBudgetKV Alg. 1; the norm grows with ρ)."""
        g = tl.program_id(0)
        base = g.to(tl.int64) * width
        t = tl.load(t_ptr)  # float64 sqrt and division round to nearest (PTX sqrt.rn.f64, div.rn.f64)
        full = tl.sqrt(tl.maximum(_norm_below(rank_ptr, prot_ptr, valid_ptr, score_ptr, base, width,
                                                 bound, BLOCK), 0.0))
        lo = tl.zeros([], tl.int32)
        hi = lo + bound
        for _ in range(STEPS):
            mid = (lo + hi) // 2
            left = tl.sqrt(tl.maximum(_norm_below(rank_ptr, prot_ptr, valid_ptr, score_ptr, base, width,
                                                     mid, BLOCK), 0.0))
            change = tl.where(full > 0, 1.0 - left / tl.where(full > 0, full, 1.0), 0.0)
            small = change <= t
            hi = tl.where(small, mid, hi)
            lo = tl.where(small, lo, mid + 1)
        for start in range(0, width, BLOCK):
            offs, inside, rank, prot, valid = _entries(rank_ptr, prot_ptr, valid_ptr, base, start, width, BLOCK)
            keep = valid & (prot | (rank < lo))
            tl.store(out_ptr + base + offs, keep.to(tl.int8), mask=inside)

    @triton.jit
    def _gather_kernel(kp_ptr, vp_ptr, sp_ptr, pp_ptr, cp_ptr, table_ptr, start_ptr,
                       k_ptr, v_ptr, s_ptr, p_ptr, c_ptr, take_ptr, E, WIDTH,
                       S: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Head bh: its taken rows, block by block, to entries start + running count."""
        bh = tl.program_id(0)
        offs_d = tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_DV)
        next_entry = tl.load(start_ptr + bh)
        for first in range(0, E, BLOCK_E):
            offs = first + tl.arange(0, BLOCK_E)
            row = bh.to(tl.int64) * E + offs
            take = tl.load(take_ptr + row, mask=offs < E, other=0) != 0
            entry = next_entry + tl.cumsum(take.to(tl.int64), axis=0) - 1
            page = tl.load(table_ptr + bh.to(tl.int64) * WIDTH + entry // S, mask=take, other=0)
            dest = page * S + entry % S
            k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :], mask=take[:, None] & (offs_d < D)[None, :])
            tl.store(kp_ptr + dest[:, None] * D + offs_d[None, :], k.to(kp_ptr.dtype.element_ty),
                     mask=take[:, None] & (offs_d < D)[None, :])
            v = tl.load(v_ptr + row[:, None] * DV + offs_v[None, :], mask=take[:, None] & (offs_v < DV)[None, :])
            tl.store(vp_ptr + dest[:, None] * DV + offs_v[None, :], v.to(vp_ptr.dtype.element_ty),
                     mask=take[:, None] & (offs_v < DV)[None, :])
            tl.store(sp_ptr + dest, tl.load(s_ptr + row, mask=take).to(sp_ptr.dtype.element_ty), mask=take)
            tl.store(pp_ptr + dest, tl.load(p_ptr + row, mask=take), mask=take)
            tl.store(cp_ptr + dest, tl.load(c_ptr + row, mask=take).to(cp_ptr.dtype.element_ty), mask=take)
            next_entry += tl.sum(take.to(tl.int64), axis=0)
