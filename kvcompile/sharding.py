"""Tensor parallelism: which KV heads this process holds, and the collectives that give every
rank the view of all heads that a selection reads (docs/INTERNALS.md "Tensor parallelism").

Under transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")` or
`distributed_config=DistributedConfig(tp_plan="auto")`, launched by torchrun) the q/k/v
projections are split by output columns ("colwise"): rank r of a tensor-parallel group of
size P computes query heads [r·Hq/P, (r+1)·Hq/P) and KV heads [r·H/P, (r+1)·H/P), so its
attention function sees (B, H/P, T, d) keys and the GQA groups of its query heads are its own
KV heads. Each rank stores only those KV heads' pages.

Where the policy pools across heads (AdaKV / LAVa pooled head budgets, LAVa's entropy layer
budgets and cascade totals, the water-filling of head budgets), every rank gathers what it
needs and runs the one-process selection on the view of all heads, then keeps its own heads'
part: the kept entries are exactly the one-process run's. What travels (the `HeadShard`
methods below say it for each collective) is scores, positions and counts, never keys or
values: O(H·N) floats per layer at most, against O(H·N·d) for the cache itself.

Every collective is called by every rank of the group in the same order: the runtime's
control flow between collectives depends only on replicated inputs (the prompt, its mask)
and on results of earlier collectives, never on a rank's own heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class ShardingError(ValueError):
    """The model's tensor parallelism cannot run this way (said before anything runs)."""


@dataclass(frozen=True)
class HeadShard:
    """This process's share of a model's KV heads under tensor parallelism."""

    group: object  # the torch.distributed ProcessGroup of the model's tensor-parallel mesh
    rank: int  # this process's rank in `group`
    size: int  # ranks in `group`
    num_heads: int  # KV heads of the whole model

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ShardingError(f"kvcompile: tensor-parallel rank {self.rank} of a group of {self.size}")
        if self.num_heads % self.size:
            raise ShardingError(f"kvcompile: {self.num_heads} KV heads do not divide over {self.size} "
                                "tensor-parallel ranks; use a number of ranks that divides the KV heads")

    @property
    def per_rank(self) -> int:
        return self.num_heads // self.size

    @property
    def heads(self) -> tuple[int, ...]:
        """The KV heads this rank holds: a contiguous block, as colwise sharding splits k_proj."""
        return tuple(range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank))

    def local(self, x: Tensor) -> Tensor:
        """This rank's heads of a (B, H, …) tensor over all heads."""
        return x[:, self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

    # --- collectives ------------------------------------------------------------------------

    def gather_heads(self, x: Tensor) -> Tensor:
        """(B, H/P, …) on every rank → (B, H, …), heads in rank order. Sends this rank's block
        (the same shape on every rank) to every other rank: all_gather, bit-exact."""
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=1)

    def gather_entries(self, scores: Tensor, positions: Tensor, valid: Tensor, used: Tensor):
        """The candidate entries of every head, for a selection over all heads: scores (B, H/P, M)
        float, positions (B, H/P, M) long, valid (B, H/P, M) bool and used slots (B, H/P) long,
        where M may differ between ranks (a compressed layer holds different counts per head).
        Sends one int (this rank's M: all_reduce max), then this rank's entries padded to the
        largest M as one float64 tensor (B, H/P, M + 1, 3) of (score, position, valid), the
        extra row holding the used slots (all_gather): float32 scores and positions below 2^53
        are exact in float64. Returns the four over all heads, padding invalid."""
        import torch.distributed as dist

        b, h, m = scores.shape
        width = torch.tensor([m], dtype=torch.long, device=scores.device)  # NCCL sends CUDA tensors only
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=self.group)
        width = int(width)
        packed = torch.zeros(b, h, width + 1, 3, dtype=torch.float64, device=scores.device)
        packed[:, :, :, 0] = float("-inf")
        packed[:, :, :m, 0] = scores.double()
        packed[:, :, :m, 1] = positions.double()
        packed[:, :, :m, 2] = valid.double()
        packed[:, :, width, 0] = used.double()
        full = self.gather_heads(packed)
        return (full[:, :, :width, 0].to(scores.dtype), full[:, :, :width, 1].long(), full[:, :, :width, 2] > 0,
                full[:, :, width, 0].long())

    def total(self, x: Tensor) -> Tensor:
        """The sum over all ranks of an integer tensor of the same shape on every rank (a count
        over this rank's heads → the count over all heads). Sends x: all_reduce sum, exact."""
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out


def model_shard(model) -> HeadShard | None:
    """The HeadShard of a transformers model loaded with tensor parallelism (None when it is not).
    Raises ShardingError where its sharding cannot run: KV heads that do not divide over the
    ranks, a tensor-parallel plan that does not split attention by heads, a process group whose
    size is not the model's tensor-parallel size."""
    size = getattr(model, "_tp_size", None) or 1
    if size <= 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ShardingError("kvcompile: the model is sharded for tensor parallelism but torch.distributed is not "
                            "initialized in this process")
    config = model.config
    num_heads, num_q = config.num_key_value_heads, config.num_attention_heads
    if num_heads % size or num_q % size:
        raise ShardingError(f"kvcompile: {num_heads} KV heads ({num_q} query heads) do not divide over {size} "
                            "tensor-parallel ranks; launch a number of ranks that divides both")
    plan = dict(getattr(model, "tp_plan", None) or {})
    styles = {key.rsplit(".", 1)[-1]: style for key, style in plan.items()}
    if not all(styles.get(name) == "colwise" for name in ("q_proj", "k_proj", "v_proj")):
        raise ShardingError("kvcompile: tensor parallelism needs q_proj, k_proj and v_proj split 'colwise' (by "
                            f"heads, transformers' tp_plan='auto'); this model's plan has "
                            f"{ {n: styles.get(n) for n in ('q_proj', 'k_proj', 'v_proj')} }")
    mesh = getattr(model, "_device_mesh", None)
    try:
        mesh = model._mesh_manager.get_mesh("tp")
    except AttributeError:
        if mesh is not None and getattr(mesh, "mesh_dim_names", None) and "tp" in mesh.mesh_dim_names:
            mesh = mesh["tp"]
    if mesh is None:
        raise ShardingError("kvcompile: the model is sharded for tensor parallelism but has no device mesh")
    group = mesh.get_group()
    if dist.get_world_size(group) != size:
        raise ShardingError(f"kvcompile: the model's tensor-parallel size is {size} but its process group has "
                            f"{dist.get_world_size(group)} ranks")
    return HeadShard(group, dist.get_rank(group), size, num_heads)
