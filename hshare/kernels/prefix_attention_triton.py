"""Triton shared-prefix decode attention: each prefix tile read once for all rows of a group,
split over the prefix's keys (Hydragen section 3 batching with FlashDecoding's split).

Twin of `prefix_attention.shared_prefix_decode_states` (same arguments, same results up to the
split count). Program (query tile, group x KV head, split) holds ``BLOCK_M`` *folded* query rows:
folded row ``r`` is member ``r // g`` of the group and query head ``kv * g + r % g`` (g = Hq / Hkv),
so GQA and the group's rows are the M dimension of one ``tl.dot`` per key tile and the prefix is
read once per group, not once per row or per query head. The split's softmax is written unmerged,
``(out, lse)`` per (row, query head, split) in fp32: gather-attention's merge kernel combines
them with the row's own part in the same pass (no separate merge launch for the prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gather_attention_triton import launch_options, num_sms, upcast_dot
from .online_softmax_triton import finish_softmax, online_softmax_tile, start_softmax
from .dependent_launch import pdl_options, wait_for_previous_kernel

# which rows a group holds (the programs' MEMBERS): rows 0..width-1 (one group, no table), a members
# table ``[G, width]`` (-1: no row), or row g alone (split decode: a row's own keys are its group's level)
MEMBERS_ALL, MEMBERS_TABLE, MEMBERS_ROW_OF_GROUP = 0, 1, 2


@triton.jit
def prefix_split_program(
    q_ptr, k_ptr, v_ptr, members_ptr, valid_ptr, part_out_ptr, part_lse_ptr, tile_m, group_head, split,
    scale_log2, width, length, tiles_per_split, split_offset, total_splits,
    s_qb, s_qh, s_kg, s_kh, s_kn, s_vg, s_vh, s_vn, s_mg, s_valid,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, PER_KV: tl.constexpr, DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MEMBERS: tl.constexpr, HAS_VALID: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One program: folded query rows ``tile_m * BLOCK_M + [0, BLOCK_M)`` of group x KV head
    `group_head`, key split `split`; writes split ``split_offset + split`` of ``total_splits``."""
    group = (group_head // KV_HEADS).to(tl.int64)  # 64-bit offsets: a level may hold > 2**31 elements
    kv = (group_head % KV_HEADS).to(tl.int64)
    folded = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    member = folded // PER_KV
    head = kv * PER_KV + folded % PER_KV
    row_ok = member < width
    if MEMBERS == 1:  # MEMBERS_TABLE
        row = tl.load(members_ptr + group * s_mg + member, mask=row_ok, other=-1).to(tl.int64)
        row_ok = row_ok & (row >= 0)
        row = tl.where(row_ok, row, 0)
    elif MEMBERS == 2:  # MEMBERS_ROW_OF_GROUP (width 1)
        row = group + member.to(tl.int64)
    else:
        row = member.to(tl.int64)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + row[:, None] * s_qb + head[:, None] * s_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    q, m, l, acc = start_softmax(q, BLOCK_M, DIM, UPCAST_DOT)
    k_base = k_ptr + group * s_kg + kv * s_kh
    v_base = v_ptr + group * s_vg + kv * s_vh
    start = split * tiles_per_split * BLOCK_N
    for tile in range(0, tiles_per_split):
        keys = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < length
        if HAS_VALID:
            key_ok = key_ok & (tl.load(valid_ptr + group * s_valid + keys, mask=key_ok, other=0) != 0)
        k = tl.load(k_base + keys[:, None] * s_kn + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None] * s_vn + dims[None, :], mask=key_ok[:, None], other=0.0)
        m, l, acc = online_softmax_tile(q, k, v, key_ok, scale_log2, m, l, acc, UPCAST_DOT)
    out, lse = finish_softmax(m, l, acc)
    part = (row * Q_HEADS + head) * total_splits + split_offset + split  # [B, Hq, splits]
    tl.store(part_out_ptr + part[:, None] * DIM + dims[None, :], out, mask=row_ok[:, None])
    tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def prefix_attention_split(
    q_ptr, k_ptr, v_ptr, members_ptr, valid_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, width, length, tiles_per_split, num_splits,
    s_qb, s_qh, s_kg, s_kh, s_kn, s_vg, s_vh, s_vn, s_mg, s_valid,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, PER_KV: tl.constexpr, DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MEMBERS: tl.constexpr, HAS_VALID: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    prefix_split_program(q_ptr, k_ptr, v_ptr, members_ptr, valid_ptr, part_out_ptr, part_lse_ptr,
                         tl.program_id(0), tl.program_id(1), tl.program_id(2),
                         scale_log2, width, length, tiles_per_split, 0, num_splits,
                         s_qb, s_qh, s_kg, s_kh, s_kn, s_vg, s_vh, s_vn, s_mg, s_valid,
                         Q_HEADS, KV_HEADS, PER_KV, DIM, BLOCK_M, BLOCK_N, MEMBERS, HAS_VALID, UPCAST_DOT)


@dataclass
class PrefixLaunch:
    """The arguments of one prefix-level launch but its part buffers (`plan_prefix`)."""

    grid: tuple[int, int, int]  # query tiles, groups x Hkv, splits
    tensors: tuple  # query, keys, values, members (or a placeholder), key_valid as uint8 (or a placeholder)
    scalars: tuple  # scale_log2, width, length, tiles_per_split
    strides: tuple
    constexprs: dict
    num_stages: int
    rows_outside: bool  # with members, some rows may be in no group: their states must start empty

    @property
    def num_splits(self) -> int:
        return self.grid[2]


def plan_prefix(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                members: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
                block_m: int | None = None, block_n: int | None = None, splits: int | None = None,
                waves: int = 2, row_groups: bool = False) -> PrefixLaunch:
    """Check the inputs and choose tiles and the key split (defaults from `benchmarks/tune_kernels.py`
    on the H100: 16-row query tiles for <= 16 folded rows (or fp32 with d = 256: larger ones do not
    fit shared memory), else 64-row tiles of 32 keys, or 64 keys for prefixes of 4096 tokens and more
    in 16-bit with d <= 128, 3 stages; the split count fills `waves` waves of the SMs,
    FlashDecoding: two alone, one beside an own part that fills the GPU by itself). With
    `row_groups`, row b alone is group b (keys ``[B, Hkv, N, d]``: split decode over each row's own keys)."""
    batch, q_heads, dim = query.shape
    groups, kv_heads, length = keys.shape[:3]
    if q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} are not a multiple of the prefix's KV heads {kv_heads}")
    if dim & (dim - 1) or not 16 <= dim <= 256:
        raise ValueError(f"head_dim {dim} is not supported by the Triton kernel; accepted: 16, 32, 64, 128, 256")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("prefix keys/values must be contiguous in the head dimension")
    query = query if query.stride(-1) == 1 else query.contiguous()
    per_kv = q_heads // kv_heads
    if row_groups and (members is not None or keys.shape[0] != batch):
        raise ValueError("row_groups: one group a row (keys [B, Hkv, N, d] for a query of B rows) and no members table")
    width = 1 if row_groups else batch if members is None else members.shape[1]
    folded = width * per_kv
    row_bytes = dim * query.element_size()
    block_m = block_m or (16 if folded <= 16 or row_bytes > 512 else 64)  # fp32 x d256: 64-row tiles do not fit
    long_tiles = length >= 4096 and row_bytes <= 256  # 64-key tiles fit 3 stages: 16-bit, d <= 128
    block_n = block_n or (64 if block_m < 64 or long_tiles else 32)
    tiles = max(1, triton.cdiv(length, block_n))
    m_tiles = triton.cdiv(folded, block_m)
    wanted = splits or max(1, waves * num_sms(query.device) // (m_tiles * groups * kv_heads))
    tiles_per_split = triton.cdiv(tiles, min(tiles, wanted))
    return PrefixLaunch(
        grid=(m_tiles, groups * kv_heads, triton.cdiv(tiles, tiles_per_split)),
        tensors=(query, keys, values, members if members is not None else query,
                 key_valid.view(torch.uint8) if key_valid is not None else query),
        scalars=(scale * math.log2(math.e), width, length, tiles_per_split),
        strides=(query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
                 values.stride(0), values.stride(1), values.stride(2),
                 members.stride(0) if members is not None else 0, key_valid.stride(0) if key_valid is not None else 0),
        constexprs=dict(Q_HEADS=q_heads, KV_HEADS=kv_heads, PER_KV=per_kv, DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n,
                        MEMBERS=(MEMBERS_TABLE if members is not None else
                                 MEMBERS_ROW_OF_GROUP if row_groups else MEMBERS_ALL),
                        HAS_VALID=key_valid is not None,
                        UPCAST_DOT=upcast_dot(query)),
        num_stages=3 if block_m >= 64 else 2,
        rows_outside=members is not None,
    )


def new_parts(query: torch.Tensor, num_splits: int, empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Part buffers ``(out [B, Hq, S, d], lse [B, Hq, S])`` fp32; ``empty``: lse starts at -inf (a
    row in no group of a level keeps it: a no-op in the merge)."""
    batch, q_heads, dim = query.shape
    part_out = torch.empty(batch, q_heads, num_splits, dim, device=query.device, dtype=torch.float32)
    shape = (batch, q_heads, num_splits)
    part_lse = (torch.full(shape, float("-inf"), device=query.device, dtype=torch.float32) if empty else
                torch.empty(shape, device=query.device, dtype=torch.float32))
    return part_out, part_lse


def shared_prefix_decode_states_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                                       members: torch.Tensor | None = None,
                                       key_valid: torch.Tensor | None = None, *, block_m: int | None = None,
                                       block_n: int | None = None, splits: int | None = None,
                                       num_warps: int | None = None, num_stages: int | None = None
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `shared_prefix_decode_states` (see there); the keyword-only arguments
    override the launch configuration (benchmark sweeps)."""
    launch = plan_prefix(query, keys, values, scale, members, key_valid, block_m, block_n, splits)
    part_out, part_lse = new_parts(query, launch.num_splits, launch.rows_outside)
    prefix_attention_split[launch.grid](
        *launch.tensors, part_out, part_lse, *launch.scalars, launch.num_splits, *launch.strides,
        **launch.constexprs, **launch_options(num_warps, num_stages or (launch.num_stages if query.is_cuda else None)),
        **pdl_options(part_out.device),
    )
    return part_out, part_lse
