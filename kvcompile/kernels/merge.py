"""Residual merge update (ZSMerge, Liu et al., 2025, §3.4–3.5, Eq. 6–7, Alg. 1 lines 11–15).

Each (sequence, KV head) holds `num_slots` residual slots (key, value, count w; w = 0
is an empty slot). Evicted tokens (k, v) merge one at a time, in ascending score order
(ties: earlier position first):
    r = the first empty slot if there is one, else argmax_r k_r·k (ties: lowest r);
    k_r ← (w·k_r + k) / (w + 1),  v_r ← (w·v_r + v) / (w + 1),  w ← w + 1,
computed in float32 and stored back in the slots' dtype after every step. A head with
no slot drops its evicted tokens. The ground truth is `kvcompile.reference.merge_evicted`
(with `kvcompile.policies.merge.Residual.merge`); the update is inherently sequential,
so each kernel walks the tokens of a head in order, all heads in parallel.

- `merge_order`: the evicted entries of each head gathered in merge order (one sort).
- `residual_merge`: dispatcher; `residual_merge_triton`: one program per head keeps its
  slots in registers for the whole walk (one read and one write of the slots, one read
  of each evicted token); `residual_merge_torch`: one vectorized step over every head per
  token, blocks of steps compiled by Inductor into one C++ function for impl="compiled";
  `residual_merge_cpp`: the walk in C++ (residual_merge.cpp beside this module, package
  data, built once by Inductor's C++ toolchain), heads on OpenMP threads, fp32 on the CPU.

Backends (`Plan.prompt_merge`): `TritonResidualMerge`, `CppResidualMerge`, `TorchResidualMerge`,
`CompiledResidualMerge`, one call signature; `backend(name)` makes one. The thresholds that decide
threads and compilation are their fields (`parallel_work`, `compile_above`), shown by `describe()`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.kernels.backend import KernelBackend
from kvcompile.kernels.choice import resolve

try:  # Triton is optional: the torch lowering covers machines without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


def merge_order(keys: Tensor, values: Tensor, scores: Tensor, evicted: Tensor,
                positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The evicted entries of each head, in merge order, at the front.

    keys, values (B, H, M, d), scores (B, H, M), evicted (B, H, M) bool, positions
    (B, H, M) (None = entry order). Returns keys, values (B, H, M, d) reordered so that
    entries 0 … num−1 of a head are its evicted ones by ascending score, then position;
    and num (B, H) long.
    """
    b, h, m = scores.shape
    order = torch.arange(m, device=scores.device).expand(b, h, m)
    if positions is not None:
        order = positions.argsort(dim=-1, stable=True)
    by_score = scores.gather(-1, order).argsort(dim=-1, stable=True)
    order = order.gather(-1, by_score)
    evicted_first = (~evicted.gather(-1, order)).to(torch.int8).argsort(dim=-1, stable=True)
    order = order.gather(-1, evicted_first)

    def take(x: Tensor) -> Tensor:
        return x.gather(2, order[..., None].expand(-1, -1, -1, x.shape[-1]))

    return take(keys), take(values), evicted.sum(-1)


def residual_merge(slot_keys: Tensor, slot_values: Tensor, counts: Tensor, keys: Tensor,
                   values: Tensor, num: Tensor | None = None, num_slots: Tensor | None = None,
                   *, impl: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Merge the first num[b, h] tokens keys, values (B, H, E, d) into the slots.

    slot_keys, slot_values (B, H, S, d), counts (B, H, S) long; num (B, H) (None = E);
    num_slots (B, H): slots usable per head (None = S; slots ≥ num_slots are left as
    they are). Returns new (slot_keys, slot_values, counts).
    impl: "triton" | "cpp" | "torch" | "compiled" | None (Triton on CUDA, cpp for fp32 on the
    CPU with a C++ compiler, else torch), resolved by `kvcompile.kernels.choice.resolve("merge", ...)`.
    """
    _check(slot_keys, slot_values, counts, keys, values)
    name = resolve("merge", impl, slot_keys.device, slot_keys.dtype)
    return backend(name)(slot_keys, slot_values, counts, keys, values, num, num_slots)


def _check(slot_keys, slot_values, counts, keys, values) -> None:
    b, h, s, d = slot_keys.shape
    if (slot_values.shape[:3] != (b, h, s) or counts.shape != (b, h, s)
            or keys.shape[:2] != (b, h) or keys.shape[3] != d or values.shape[:3] != keys.shape[:3]
            or values.shape[3] != slot_values.shape[3]):
        raise ValueError(f"residual_merge: slots {tuple(slot_keys.shape)}, {tuple(slot_values.shape)}, "
                         f"counts {tuple(counts.shape)} and tokens {tuple(keys.shape)}, "
                         f"{tuple(values.shape)} do not match")


@dataclass(frozen=True)
class ResidualMerge(KernelBackend):
    """A residual-merge backend (what `Plan.prompt_merge` holds): `backend(slot_keys, slot_values, counts,
    keys, values, num=None, num_slots=None)` -> (slot_keys, slot_values, counts), `residual_merge`'s contract."""

    name: ClassVar[str]

    def __call__(self, slot_keys: Tensor, slot_values: Tensor, counts: Tensor, keys: Tensor, values: Tensor,
                 num: Tensor | None = None, num_slots: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        _check(slot_keys, slot_values, counts, keys, values)
        b, h, s, _ = slot_keys.shape
        num = torch.full((b, h), keys.shape[2], device=keys.device) if num is None else num
        num_slots = torch.full((b, h), s, device=keys.device) if num_slots is None else num_slots
        return self.run(slot_keys, slot_values, counts, keys, values, num, num_slots)

    def run(self, slot_keys, slot_values, counts, keys, values, num, num_slots):
        raise NotImplementedError




@dataclass(frozen=True)
class TritonResidualMerge(ResidualMerge):
    """One Triton program per head (`residual_merge_triton`)."""

    name: ClassVar[str] = "triton"

    def run(self, *args):
        return residual_merge_triton(*args)


@dataclass(frozen=True)
class CppResidualMerge(ResidualMerge):
    """The walk in C++ (`residual_merge_cpp`, fp32 CPU): heads on torch's threads when there are several and
    a walk has at least `parallel_work` multiply-adds (tokens · slots · d), else one thread."""

    name: ClassVar[str] = "cpp"
    parallel_work: int = 1 << 16  # CPP_PARALLEL_WORK below

    def run(self, *args):
        return residual_merge_cpp(*args, parallel_work=self.parallel_work)

    def build(self, group: int, head_dim: int) -> None:
        _cpp_kernel()

    def describe(self) -> str:
        return f"cpp (heads on torch's threads from {self.parallel_work} multiply-adds a walk, else one thread)"


@dataclass(frozen=True)
class TorchResidualMerge(ResidualMerge):
    """The torch lowering, one vectorized step per token; a walk of more than `compile_above` tokens goes
    through Inductor's compiled blocks instead (None: never)."""

    name: ClassVar[str] = "torch"
    compile_above: int | None = None

    def run(self, *args):
        num = args[5]
        compiled = self.compile_above is not None and int(num.max()) > self.compile_above
        return residual_merge_torch(*args, compiled_step=compiled)

    def describe(self) -> str:
        if self.compile_above is None:
            return "torch"
        return f"torch (compiled blocks for walks of more than {self.compile_above} tokens)"


@dataclass(frozen=True)
class CompiledResidualMerge(ResidualMerge):
    """The torch lowering with UNROLL steps per Inductor-compiled block, one thread."""

    name: ClassVar[str] = "compiled"

    def run(self, *args):
        return residual_merge_torch(*args, compiled_step=True)


def backend(name: str, compile_above: int | None = None) -> ResidualMerge:
    """The backend of impl `name` (one `choice.resolve("merge", ...)` returned); `compile_above`: the
    torch lowering's bound for compiled blocks."""
    if name == "cpp":
        return CppResidualMerge(CPP_PARALLEL_WORK)
    if name == "torch":
        return TorchResidualMerge(compile_above)
    return {"triton": TritonResidualMerge, "compiled": CompiledResidualMerge}[name]()


# ----------------------------------------------------------------------------- C++

_CPP_ARGTYPES = ("float*", "float*", "int64_t*", "const float*", "const float*", "const int64_t*", "const int64_t*",
                 "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t")


def _cpp_kernel():
    from kvcompile.kernels.paged_attention_cpp import load_cpp

    return load_cpp(_CPP_ARGTYPES, "residual_merge.cpp")


CPP_PARALLEL_WORK = 1 << 16  # multiply-adds (tokens · slots · d) a walk needs for its heads to go on threads


def residual_merge_cpp(slot_keys: Tensor, slot_values: Tensor, counts: Tensor, keys: Tensor, values: Tensor,
                       num: Tensor, num_slots: Tensor, *, parallel_work: int | None = None
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """The walk in C++ on fresh copies of the slots (fp32 CPU tensors): the same fp32 operations
    as the torch lowering, each rounded, so the same slots bit for bit (a dot product may sum
    in another order: a tie within one rounding could pick another slot)."""
    b, h, s, d = slot_keys.shape
    dv, e = slot_values.shape[3], keys.shape[2]
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (slot_keys, slot_values, keys, values)):
        raise ValueError("residual_merge_cpp: fp32 CPU tensors")
    out_k, out_v = slot_keys.contiguous().clone(), slot_values.contiguous().clone()
    out_c = counts.to(torch.long).contiguous().clone()
    if s and e and b * h:
        work = CPP_PARALLEL_WORK if parallel_work is None else parallel_work
        threads = torch.get_num_threads() if b * h > 1 and e * s * d >= work else 1
        _cpp_kernel()(
            out_k, out_v, out_c, keys.contiguous(), values.contiguous(), num.to(torch.long).contiguous(),
            num_slots.to(torch.long).contiguous(), b * h, s, d, dv, e, threads)
    return out_k, out_v, out_c


# --------------------------------------------------------------------------- torch

def residual_merge_torch(slot_keys: Tensor, slot_values: Tensor, counts: Tensor, keys: Tensor,
                         values: Tensor, num: Tensor, num_slots: Tensor,
                         compiled_step: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Token by token, every head at once: one `_merge_step` per evicted position.

    Eagerly each step is ~30 small ops (~90 µs a token on this CPU). With
    `compiled_step`, UNROLL consecutive steps are traced as one graph that Inductor
    compiles into a single C++ function (the steps stay sequential inside it), about
    10x faster; the token blocks are padded with inactive steps. It runs on one thread:
    a step touches S·d elements, too few to pay for an OpenMP barrier. The compiled graph
    is static and guards on its inputs' strides and dispatch keys, so every block it gets
    is a fresh contiguous tensor made in inference mode: one graph per (B, H, S, d),
    whatever the prompt length or the way the op is called (the first run of an
    AOTAutograd graph calls custom ops below ADInplaceOrView)."""
    if not compiled_step:
        return _merge_blocks(slot_keys, slot_values, counts, keys, values, num, num_slots, 1, _merge_block)
    with torch.inference_mode():
        out = _merge_blocks(slot_keys.clone(), slot_values.clone(), counts.clone(), keys, values, num, num_slots,
                            UNROLL, _compiled_block())
    return tuple(t.clone() for t in out)  # ordinary tensors again, for in-place updates later


def _merge_blocks(slot_keys, slot_values, counts, keys, values, num, num_slots, block, run):
    usable = torch.arange(slot_keys.shape[2], device=counts.device) < num_slots[..., None]
    steps = int(num.max()) if num.numel() and slot_keys.shape[2] else 0  # no slot: drop all
    for start in range(0, steps, block):
        e = torch.arange(start, start + block, device=num.device)
        active = (e < num[..., None]) & (num_slots > 0)[..., None]  # (B, H, block)
        k, v = keys[:, :, start:start + block], values[:, :, start:start + block]
        if k.shape[2] < block:  # the last block: pad with inactive steps
            k = torch.nn.functional.pad(k, (0, 0, 0, block - k.shape[2]))
            v = torch.nn.functional.pad(v, (0, 0, 0, block - v.shape[2]))
        k, v = (t.clone(memory_format=torch.contiguous_format) for t in (k, v))  # see residual_merge_torch
        slot_keys, slot_values, counts = run(slot_keys, slot_values, counts, k, v, usable, active)
    return slot_keys, slot_values, counts


UNROLL = 16  # steps per compiled block: 16 gets most of the gain, compiles in ~15 s


def _merge_block(slot_keys, slot_values, counts, keys, values, usable, active):
    """Consecutive steps for tokens keys, values (B, H, U, d); active (B, H, U)."""
    for u in range(keys.shape[2]):
        slot_keys, slot_values, counts = _merge_step(slot_keys, slot_values, counts, keys[:, :, u],
                                                     values[:, :, u], usable, active[:, :, u])
    return slot_keys, slot_values, counts


def _merge_step(slot_keys: Tensor, slot_values: Tensor, counts: Tensor, key: Tensor,
                value: Tensor, usable: Tensor, active: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One token (B, H, d) per head into its slots (B, H, S, d); heads not `active` unchanged."""
    s = counts.shape[-1]
    idx = torch.arange(s, device=counts.device)
    dots = (slot_keys.float() * key.float()[:, :, None]).sum(-1).masked_fill(~usable, float("-inf"))
    first_empty = torch.where((counts == 0) & usable, idx, s).amin(-1)  # s = none empty
    closest = torch.where(dots == dots.amax(-1, keepdim=True), idx, s).amin(-1)
    target = torch.where(first_empty < s, first_empty, closest)
    hit = (idx == target[..., None]) & active[..., None]  # (B, H, S)
    w = counts.float()[..., None]

    def fold(slots: Tensor, new: Tensor) -> Tensor:  # ZSMerge Eq. 6–7
        mean = ((w * slots.float() + new.float()[:, :, None]) / (w + 1)).to(slots.dtype)
        return torch.where(hit[..., None], mean, slots)

    return fold(slot_keys, key), fold(slot_values, value), counts + hit


@functools.cache
def _compiled_block():
    return torch.compile(_merge_block, dynamic=False, options={"cpp.threads": 1})


# -------------------------------------------------------------------------- triton

def residual_merge_triton(slot_keys: Tensor, slot_values: Tensor, counts: Tensor, keys: Tensor,
                          values: Tensor, num: Tensor, num_slots: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """One program per (sequence, KV head): the sequential walk with slots in registers."""
    if triton is None:
        raise RuntimeError("residual_merge_triton needs triton")
    b, h, s, d = slot_keys.shape
    dv, e = slot_values.shape[3], keys.shape[2]
    if s == 0 or e == 0 or b * h == 0:  # nothing to merge into, or nothing to merge
        return slot_keys.clone(), slot_values.clone(), counts.clone()
    out_keys, out_values = torch.empty_like(slot_keys), torch.empty_like(slot_values)
    out_counts = torch.empty_like(counts)
    _merge_kernel[(b * h,)](
        slot_keys.contiguous(), slot_values.contiguous(), counts.contiguous(),
        keys.contiguous(), values.contiguous(), num.to(torch.int32).contiguous(),
        num_slots.to(torch.int32).contiguous(), out_keys, out_values, out_counts, e,
        S=s, D=d, DV=dv, BLOCK_S=triton.next_power_of_2(s),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv),
        enable_fp_fusion=False)  # a multiply-add rounds twice, as in the torch lowering (kernel comment)
    return out_keys, out_values, out_counts


if triton is not None:

    @triton.jit
    def _merge_kernel(sk_ptr, sv_ptr, cnt_ptr, k_ptr, v_ptr, num_ptr, nslots_ptr,
                      ok_ptr, ov_ptr, oc_ptr, E,
                      S: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """ZSMerge Alg. 1 lines 11–15 for one head: fill the first empty slot, else fold
        into the slot of largest k_r·k (lowest index on ties), count-weighted."""
        bh = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_DV)
        in_s = offs_s < S
        mask_k = in_s[:, None] & (offs_d < D)[None, :]
        mask_v = in_s[:, None] & (offs_v < DV)[None, :]
        key_rows = (bh * S + offs_s)[:, None]
        slot_k = tl.load(sk_ptr + key_rows * D + offs_d[None, :], mask=mask_k, other=0.0).to(tl.float32)
        slot_v = tl.load(sv_ptr + key_rows * DV + offs_v[None, :], mask=mask_v, other=0.0).to(tl.float32)
        counts = tl.load(cnt_ptr + bh * S + offs_s, mask=in_s, other=0)
        usable = offs_s < tl.load(nslots_ptr + bh)
        n = tl.where(tl.load(nslots_ptr + bh) > 0, tl.load(num_ptr + bh), 0)
        for e in range(0, n):
            token = bh.to(tl.int64) * E + e
            k = tl.load(k_ptr + token * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + token * DV + offs_v, mask=offs_v < DV, other=0.0).to(tl.float32)
            dots = tl.where(usable, tl.sum(slot_k * k[None, :], axis=1), float("-inf"))
            first_empty = tl.min(tl.where((counts == 0) & usable, offs_s, BLOCK_S), axis=0)
            closest = tl.min(tl.where(dots == tl.max(dots, axis=0), offs_s, BLOCK_S), axis=0)
            target = tl.where(first_empty < BLOCK_S, first_empty, closest)
            hit = (offs_s == target)[:, None]
            w = counts.to(tl.float32)[:, None]
            # Eq. 6–7 in fp32, rounded to the slots' dtype after every step (as stored); each operation rounded
            # as torch rounds it: no FMA contraction (the launch's enable_fp_fusion=False) and a correctly
            # rounded division (`/` on a GPU is an approximate one)
            new_k = tl.math.div_rn(w * slot_k + k[None, :], w + 1.0).to(ok_ptr.dtype.element_ty)
            new_v = tl.math.div_rn(w * slot_v + v[None, :], w + 1.0).to(ov_ptr.dtype.element_ty)
            slot_k = tl.where(hit, new_k.to(tl.float32), slot_k)
            slot_v = tl.where(hit, new_v.to(tl.float32), slot_v)
            counts = tl.where(offs_s == target, counts + 1, counts)
        tl.store(ok_ptr + key_rows * D + offs_d[None, :], slot_k.to(ok_ptr.dtype.element_ty), mask=mask_k)
        tl.store(ov_ptr + key_rows * DV + offs_v[None, :], slot_v.to(ov_ptr.dtype.element_ty), mask=mask_v)
        tl.store(oc_ptr + bh * S + offs_s, counts, mask=in_s)
