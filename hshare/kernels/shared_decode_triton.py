"""Triton shared-prefix decode in one launch: a prefix level's programs and the own part's gather
programs side by side in one grid, then one merge.

Twin of `shared_decode.shared_decode_attention_torch`. The prefix programs
(`prefix_attention_triton.prefix_split_program`: compute-bound, every folded query row of a group
against each prefix tile) come first in the grid; the gather programs
(`gather_attention_triton.gather_split_program`: memory-bound, each row's own KV) fill the SMs beside
them, so the two overlap on the machine instead of running one after the other. Both write their
unmerged split states into one buffer ``[B, Hq, S_prefix + S_own]``; `merge_parts` combines them,
with any further incoming states (other prefix levels), by log-sum-exp.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .gather_attention_triton import BLOCK_N, GatherLaunch, gather_split_program, launch_options, merge_parts, \
    num_sms, plan_gather
from .prefix_attention_triton import PrefixLaunch, new_parts, plan_prefix, prefix_split_program
from .dependent_launch import pdl_options, wait_for_previous_kernel


@triton.jit
def _shared_decode_split(
    pq_ptr, pk_ptr, pv_ptr, members_ptr, valid_ptr, gq_ptr, gk_ptr, gv_ptr, idx_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, width, length, prefix_tiles_per_split,
    own_scale_log2, n_keys, budget, own_tiles_per_split,
    prefix_programs, prefix_splits, own_splits, group_heads,
    ps_qb, ps_qh, ps_kg, ps_kh, ps_kn, ps_vg, ps_vh, ps_vn, ps_mg, ps_valid,
    gs_qb, gs_qh, gs_kb, gs_kh, gs_kn, gs_vb, gs_vh, gs_vn, gs_ib, gs_ih,
    P_Q_HEADS: tl.constexpr, P_KV_HEADS: tl.constexpr, P_PER_KV: tl.constexpr, P_DIM: tl.constexpr,
    P_BLOCK_M: tl.constexpr, P_BLOCK_N: tl.constexpr, P_MEMBERS: tl.constexpr, P_HAS_VALID: tl.constexpr,
    P_UPCAST_DOT: tl.constexpr,
    G_SEL_HEADS: tl.constexpr, G_KV_HEADS: tl.constexpr, G_GROUP: tl.constexpr, G_GROUP_PAD: tl.constexpr,
    G_DIM: tl.constexpr, G_BLOCK: tl.constexpr, G_UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    total_splits = prefix_splits + own_splits
    if pid < prefix_programs:  # (query tile, group x KV head, split), split fastest
        split = pid % prefix_splits
        rest = pid // prefix_splits
        prefix_split_program(pq_ptr, pk_ptr, pv_ptr, members_ptr, valid_ptr, part_out_ptr, part_lse_ptr,
                             rest // group_heads, rest % group_heads, split,
                             scale_log2, width, length, prefix_tiles_per_split, 0, total_splits,
                             ps_qb, ps_qh, ps_kg, ps_kh, ps_kn, ps_vg, ps_vh, ps_vn, ps_mg, ps_valid,
                             P_Q_HEADS, P_KV_HEADS, P_PER_KV, P_DIM, P_BLOCK_M, P_BLOCK_N, P_MEMBERS,
                             P_HAS_VALID, P_UPCAST_DOT)
    else:  # (row x selection head, split) of the own part, written after the prefix's splits
        own = pid - prefix_programs
        gather_split_program(gq_ptr, gk_ptr, gv_ptr, idx_ptr, part_out_ptr, part_lse_ptr,
                             own // own_splits, own % own_splits,
                             own_scale_log2, n_keys, budget, own_tiles_per_split, prefix_splits, total_splits,
                             gs_qb, gs_qh, gs_kb, gs_kh, gs_kn, gs_vb, gs_vh, gs_vn, gs_ib, gs_ih,
                             G_SEL_HEADS, G_KV_HEADS, G_GROUP, G_GROUP_PAD, G_DIM, G_BLOCK, G_UPCAST_DOT)


def shared_decode_attention_triton(query: torch.Tensor, prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
                                   members: torch.Tensor | None, key_valid: torch.Tensor | None,
                                   keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, scale: float,
                                   partial: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                                   prefix_block_m: int | None = None, prefix_block_n: int | None = None,
                                   prefix_splits: int | None = None, own_block_n: int = BLOCK_N,
                                   own_splits: int | None = None, num_warps: int | None = None,
                                   num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `shared_decode_attention` (see there), the prefix level given by its tensors.
    The keyword-only arguments override the launch configuration (benchmark sweeps)."""
    own = plan_gather(query, keys, values, indices, scale, own_block_n, own_splits)
    # the prefix's split: one wave of programs beside an own part that fills the GPU (fewer states to
    # merge), two waves otherwise (run 17: 46.9 against 52.6 us at B64 P2k, 181.5 against 194.1 at B256 P8k)
    waves = 1 if own.programs >= num_sms(query.device) else 2
    prefix = plan_prefix(query, prefix_keys, prefix_values, scale, members, key_valid, prefix_block_m,
                         prefix_block_n, prefix_splits, waves)
    part_out, part_lse = new_parts(query, prefix.num_splits + own.num_splits, prefix.rows_outside)
    launch_shared_decode(prefix, own, part_out, part_lse, num_warps, num_stages)
    return merge_parts(query, part_out, part_lse, partial)


def launch_shared_decode(prefix: PrefixLaunch, own: GatherLaunch, part_out: torch.Tensor, part_lse: torch.Tensor,
                         num_warps: int | None = None, num_stages: int | None = None) -> None:
    """Launch the one grid: the prefix level's programs first, then the own part's; both write their
    split states into ``part_out [B, Hq, S_prefix + S_own, d]`` / ``part_lse`` (unmerged)."""
    prefix_programs = math.prod(prefix.grid)
    _shared_decode_split[(prefix_programs + own.programs * own.num_splits,)](
        *prefix.tensors, *own.tensors, part_out, part_lse, *prefix.scalars, *own.scalars,
        prefix_programs, prefix.num_splits, own.num_splits, prefix.grid[1], *prefix.strides, *own.strides,
        **{f"P_{name}": value for name, value in prefix.constexprs.items()},
        **{f"G_{name}": value for name, value in own.constexprs.items()},
        **launch_options(num_warps, num_stages or (prefix.num_stages if part_out.is_cuda else None)),
        **pdl_options(part_out.device),
    )
