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
import os

import torch
import triton
import triton.language as tl

from .gather_attention_triton import num_sms


@triton.jit
def _prefix_attention_split(
    q_ptr, k_ptr, v_ptr, members_ptr, valid_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, width, length, tiles_per_split, num_splits,
    s_qb, s_qh, s_kg, s_kh, s_kn, s_vg, s_vh, s_vn, s_mg, s_valid,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, PER_KV: tl.constexpr, DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MEMBERS: tl.constexpr, HAS_VALID: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    tile_m = tl.program_id(0)
    group_head = tl.program_id(1)
    split = tl.program_id(2)
    group = (group_head // KV_HEADS).to(tl.int64)  # 64-bit offsets: a level may hold > 2**31 elements
    kv = (group_head % KV_HEADS).to(tl.int64)
    folded = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    member = folded // PER_KV
    head = kv * PER_KV + folded % PER_KV
    row_ok = member < width
    if HAS_MEMBERS:
        row = tl.load(members_ptr + group * s_mg + member, mask=row_ok, other=-1).to(tl.int64)
        row_ok = row_ok & (row >= 0)
        row = tl.where(row_ok, row, 0)
    else:
        row = member.to(tl.int64)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + row[:, None] * s_qb + head[:, None] * s_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_base = k_ptr + group * s_kg + kv * s_kh
    v_base = v_ptr + group * s_vg + kv * s_vh
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max of the logits, base-2 units
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DIM), tl.float32)
    start = split * tiles_per_split * BLOCK_N
    for tile in range(0, tiles_per_split):
        keys = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < length
        if HAS_VALID:
            key_ok = key_ok & (tl.load(valid_ptr + group * s_valid + keys, mask=key_ok, other=0) != 0)
        k = tl.load(k_base + keys[:, None] * s_kn + dims[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale_log2
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        v = tl.load(v_base + keys[:, None] * s_vn + dims[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))  # natural log
    part = (row * Q_HEADS + head) * num_splits + split  # [B, Hq, splits]
    tl.store(part_out_ptr + part[:, None] * DIM + dims[None, :], out, mask=row_ok[:, None])
    tl.store(part_lse_ptr + part, lse, mask=row_ok)


def prefix_launch_config(folded_rows: int, work_items: int, length: int, device: torch.device,
                         block_m: int | None = None, block_n: int | None = None,
                         splits: int | None = None) -> tuple[int, int, int, int]:
    """Tile sizes and key split of one level: ``(block_m, block_n, tiles_per_split, num_splits)``.

    ``folded_rows`` = rows of a group x (Hq / Hkv); ``work_items`` = groups x Hkv. The split count
    fills about two waves of the GPU's SMs (FlashDecoding) without splits of less than one tile.
    """
    if block_m is None:
        block_m = 16 if folded_rows <= 16 else 64 if folded_rows <= 256 else 128
    block_n = block_n or 64
    tiles = max(1, triton.cdiv(length, block_n))
    programs = triton.cdiv(folded_rows, block_m) * work_items
    wanted = splits or max(1, triton.cdiv(2 * num_sms(device), programs))
    tiles_per_split = triton.cdiv(tiles, min(tiles, wanted))
    return block_m, block_n, tiles_per_split, triton.cdiv(tiles, tiles_per_split)


def shared_prefix_decode_states_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                                       members: torch.Tensor | None = None,
                                       key_valid: torch.Tensor | None = None, *, block_m: int | None = None,
                                       block_n: int | None = None, splits: int | None = None,
                                       num_warps: int | None = None, num_stages: int | None = None
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `shared_prefix_decode_states` (see there); the keyword-only arguments
    override the launch configuration (benchmark sweeps)."""
    batch, q_heads, dim = query.shape
    groups, kv_heads, length = keys.shape[:3]
    if q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} are not a multiple of the prefix's KV heads {kv_heads}")
    if dim & (dim - 1) or not 16 <= dim <= 256:
        raise ValueError(f"head_dim {dim} is not supported by the Triton kernel; accepted: 16, 32, 64, 128, 256")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("prefix keys/values must be contiguous in the head dimension")
    per_kv = q_heads // kv_heads
    width = batch if members is None else members.shape[1]
    block_m, block_n, tiles_per_split, num_splits = prefix_launch_config(
        width * per_kv, groups * kv_heads, length, query.device, block_m, block_n, splits)
    query = query if query.stride(-1) == 1 else query.contiguous()
    part_out = torch.empty(batch, q_heads, num_splits, dim, device=query.device, dtype=torch.float32)
    if members is None:  # every row, in order: every (row, head, split) is written
        part_lse = torch.empty(batch, q_heads, num_splits, device=query.device, dtype=torch.float32)
    else:  # a row in no group of this level keeps lse = -inf: a no-op in the merge
        part_lse = torch.full((batch, q_heads, num_splits), float("-inf"), device=query.device, dtype=torch.float32)
    members_arg = members if members is not None else part_lse
    valid_arg = key_valid.view(torch.uint8) if key_valid is not None else part_lse
    extra = {} if num_warps is None else {"num_warps": num_warps}
    if num_stages is not None:
        extra["num_stages"] = num_stages
    elif query.is_cuda:
        extra["num_stages"] = 3 if block_m >= 64 else 2
    _prefix_attention_split[(triton.cdiv(width * per_kv, block_m), groups * kv_heads, num_splits)](
        query, keys, values, members_arg, valid_arg, part_out, part_lse,
        scale * math.log2(math.e), width, length, tiles_per_split, num_splits,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        members.stride(0) if members is not None else 0, key_valid.stride(0) if key_valid is not None else 0,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, PER_KV=per_kv, DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MEMBERS=members is not None, HAS_VALID=key_valid is not None,
        # Triton's CPU interpreter computes bf16 tl.dot wrongly (triton 3.9): upcast there only
        UPCAST_DOT=os.environ.get("TRITON_INTERPRET") == "1" and query.dtype == torch.bfloat16,
        **extra,
    )
    return part_out, part_lse
