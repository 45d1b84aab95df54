"""The attention heads one process holds: all of the model's, or its tensor-parallel rank's slice.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under torchrun)
the q / k / v projections are split by output features (``ColwiseParallel``, ``Shard(0)`` on the
``tp`` mesh dimension): rank r of t holds query heads ``[r Hq / t, (r + 1) Hq / t)`` and the KV
heads of those query groups, and the attention function receives only those heads. All per-head
state (KV, labels, selections, the head-sharing plan, counters) is therefore sized from the
tensors the attention function receives (`HeadShard`), never from the model config.

What spans the ranks (hshare's choice, `hshare.planner`): head sharing plans over the rank's own
heads (a head copies a head of its rank: no collective in a decode step); layer similarity is
averaged over every rank's heads at prefill (`HeadShard.mean_over_ranks`, one small all-reduce per
sparse layer), so layer sharing, like the query-group schedule (step counters only), is the same
on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HeadShard:
    """The heads this process attends with.

    Attributes:
        q_heads: Hq of this process (the query tensor's head dimension).
        kv_heads: Hkv of this process (the key tensor's head dimension).
        ranks: t, the processes the model's heads are split over (1: not split).
        rank: this process's index among them (None: split by something other than transformers'
            tensor parallelism, so the position of the heads is unknown).
        group: the tensor-parallel process group (None when not split, or unknown).
    """

    q_heads: int
    kv_heads: int
    ranks: int = 1
    rank: int | None = 0
    group: dist.ProcessGroup | None = None

    @property
    def sharded(self) -> bool:
        return self.ranks > 1

    @property
    def q_offset(self) -> int:
        """The model's index of this process's first query head."""
        if self.rank is None:
            raise ValueError(f"the attention receives {self.q_heads} of {self.q_heads * self.ranks} query heads, "
                             "split by something other than transformers' tensor parallelism (no DTensor weights), "
                             "so hshare does not know which heads these are; accepted: tp_plan='auto' or unsplit heads")
        return self.rank * self.q_heads

    def mean_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of `x` over the ranks (identical on every rank; `x` itself when not split).
        Every rank holds as many heads, so the mean of per-rank head means is the mean over all heads."""
        if self.group is None or x.numel() == 0:
            return x
        total = x.clone(memory_format=torch.contiguous_format)  # collectives take contiguous tensors only (evidence may be a transposed view)
        dist.all_reduce(total, group=self.group)
        return total / self.ranks

    def describe(self) -> str:
        split = "" if not self.sharded else f" (rank {self.rank} of {self.ranks} tensor-parallel ranks)"
        return f"{self.q_heads} query / {self.kv_heads} KV heads{split}"


def head_shard(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor) -> HeadShard:
    """The heads of `module`'s attention in this process, from the tensors it receives.

    Args:
        module: the attention module (its ``config`` holds the model's head counts).
        query: ``[B, Hq_rank, T, d]``; key: ``[B, Hkv_rank, n, d]``.
    """
    q_heads, kv_heads = query.shape[1], key.shape[1]
    config = getattr(module, "config", None)
    model_q = getattr(config, "num_attention_heads", None) or q_heads
    model_kv = getattr(config, "num_key_value_heads", None) or model_q
    if (q_heads, kv_heads) == (model_q, model_kv):
        return HeadShard(q_heads, kv_heads)
    ranks = model_q // q_heads
    if model_q % q_heads or model_kv != kv_heads * ranks or q_heads % kv_heads:
        raise ValueError(f"layer {module.layer_idx} attends with {q_heads} query / {kv_heads} KV heads, the model has "
                         f"{model_q} / {model_kv}: not an even split by head; accepted: a tensor-parallel size that "
                         f"divides the KV heads ({model_kv})")
    rank, group = _tensor_parallel_rank(module)
    return HeadShard(q_heads, kv_heads, ranks, rank, group)


def _tensor_parallel_rank(module: torch.nn.Module) -> tuple[int | None, dist.ProcessGroup | None]:
    """``(rank, group)`` along the mesh dimension that shards the module's first DTensor weight
    (transformers' ``ColwiseParallel``), or ``(None, None)`` when its weights are not DTensors."""
    from torch.distributed.tensor import DTensor, Shard

    for parameter in module.parameters():
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            for dim, placement in enumerate(parameter.placements):
                if isinstance(placement, Shard):
                    return mesh.get_local_rank(dim), mesh.get_group(dim)
    return None, None
