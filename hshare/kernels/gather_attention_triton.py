"""Triton gather-attention: one decode query per head over selected KV rows, split over N_c.

Twin of `gather_attention.gather_attention` (same arguments, same results). Flash-decoding
layout: program (row b, selection head s, split j) reads the N_c indices of split j once, gathers
those K/V rows straight from the cache's buffer (any strides, no copy) and computes the partial
softmax of all the query heads that read head s (GQA folded into the rows of one ``tl.dot``, so
each gathered row is read once per group). A second kernel merges the splits, and the optional
incoming partial states (a shared prefix's splits and levels), exactly by log-sum-exp. No
power-of-two requirement on N_c (tiles are masked), no register cliff at large N_c (the split loop
keeps one tile live). `plan_gather` and `merge_parts` are shared with the shared-prefix decode
kernel, which runs these programs beside the prefix's in one launch.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .online_softmax_triton import finish_softmax, online_softmax_tile, start_softmax
from .dependent_launch import pdl_options, wait_for_previous_kernel

BLOCK_N = 64  # gathered rows per tile


@triton.jit
def gather_split_program(
    q_ptr, k_ptr, v_ptr, idx_ptr, part_out_ptr, part_lse_ptr, pid, split,
    scale_log2, n_keys, budget, tiles_per_split, split_offset, total_splits,
    s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ib, s_ih,
    SEL_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    DIM: tl.constexpr, BLOCK: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """One program: (row b, selection head s) = divmod(pid, SEL_HEADS), split `split` of its N_c
    indices; writes split ``split_offset + split`` of ``total_splits`` in the part buffers."""
    b = (pid // SEL_HEADS).to(tl.int64)  # 64-bit offsets: a cache may hold more than 2**31 elements
    s = pid % SEL_HEADS
    kv = (s * KV_HEADS // SEL_HEADS).to(tl.int64)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM)
    row_ok = rows < GROUP
    q = tl.load(q_ptr + b * s_qb + (s * GROUP + rows)[:, None] * s_qh + dims[None, :], mask=row_ok[:, None],
                other=0.0)
    q, m, l, acc = start_softmax(q, GROUP_PAD, DIM, UPCAST_DOT)
    start = split * tiles_per_split * BLOCK
    for tile in range(0, tiles_per_split):
        offs = start + tile * BLOCK + tl.arange(0, BLOCK)
        in_budget = offs < budget
        cols = tl.load(idx_ptr + b * s_ib + s * s_ih + offs, mask=in_budget, other=-1)
        ok = (cols >= 0) & (cols < n_keys)
        cols = tl.where(ok, cols, 0).to(tl.int64)
        k = tl.load(k_ptr + b * s_kb + kv * s_kh + cols[:, None] * s_kn + dims[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + b * s_vb + kv * s_vh + cols[:, None] * s_vn + dims[None, :], mask=ok[:, None], other=0.0)
        m, l, acc = online_softmax_tile(q, k, v, ok, scale_log2, m, l, acc, UPCAST_DOT)
    out, lse = finish_softmax(m, l, acc)
    head = s * GROUP + rows
    part = (b * SEL_HEADS * GROUP + head) * total_splits + split_offset + split  # [B, Hq, splits]
    tl.store(part_out_ptr + part[:, None] * DIM + dims[None, :], out, mask=row_ok[:, None])
    tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _gather_attention_split(
    q_ptr, k_ptr, v_ptr, idx_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, n_keys, budget, tiles_per_split, num_splits,
    s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ib, s_ih,
    SEL_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    DIM: tl.constexpr, BLOCK: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    gather_split_program(q_ptr, k_ptr, v_ptr, idx_ptr, part_out_ptr, part_lse_ptr, tl.program_id(0), tl.program_id(1),
                         scale_log2, n_keys, budget, tiles_per_split, 0, num_splits,
                         s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ib, s_ih,
                         SEL_HEADS, KV_HEADS, GROUP, GROUP_PAD, DIM, BLOCK, UPCAST_DOT)


@triton.jit
def _load_states(out_ptr, lse_ptr, rows, row_ok, num_splits, SPLITS_PAD: tl.constexpr, DIM: tl.constexpr):
    """States ``(out [R, S, d], lse [R, S])`` fp32 of units ``rows [R]`` from ``[B*Hq, S, d]``
    buffers; padding splits and rows get lse = -inf."""
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM)
    ok = row_ok[:, None] & (splits < num_splits)[None, :]
    part = rows[:, None] * num_splits + splits[None, :]
    lse = tl.load(lse_ptr + part, mask=ok, other=float("-inf")).to(tl.float32)
    out = tl.load(out_ptr + part[:, :, None] * DIM + dims[None, None, :], mask=ok[:, :, None], other=0.0)
    return out.to(tl.float32), lse


@triton.jit
def _merge_splits(
    part_out_ptr, part_lse_ptr, prior_out_ptr, prior_lse_ptr, out_ptr, lse_ptr, units, num_splits, prior_splits,
    HAS_PRIOR: tl.constexpr, SPLITS_PAD: tl.constexpr, PRIOR_PAD: tl.constexpr, DIM: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # units b * Hq + h
    row_ok = rows < units
    outs, lse = _load_states(part_out_ptr, part_lse_ptr, rows, row_ok, num_splits, SPLITS_PAD, DIM)
    top = tl.max(lse, 1)
    if HAS_PRIOR:  # partial states over other keys (a shared prefix's splits, its levels)
        prior_outs, prior_lse = _load_states(prior_out_ptr, prior_lse_ptr, rows, row_ok, prior_splits, PRIOR_PAD,
                                             DIM)
        top = tl.maximum(top, tl.max(prior_lse, 1))
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - top_safe[:, None])  # an empty part (lse = -inf) weighs 0, whatever its out
    total = tl.sum(weights, 1)
    merged = tl.sum(tl.where(weights[:, :, None] > 0, outs * weights[:, :, None], 0.0), 1)
    if HAS_PRIOR:
        prior_weights = tl.exp(prior_lse - top_safe[:, None])
        merged += tl.sum(tl.where(prior_weights[:, :, None] > 0, prior_outs * prior_weights[:, :, None], 0.0), 1)
        total += tl.sum(prior_weights, 1)
    has = total > 0
    merged = merged / tl.where(has, total, 1.0)[:, None]
    dims = tl.arange(0, DIM)
    tl.store(out_ptr + rows[:, None] * DIM + dims[None, :], merged.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(lse_ptr + rows, tl.where(has, top_safe + tl.log(tl.where(has, total, 1.0)), float("-inf")),
             mask=row_ok)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for the CPU interpreter); cached per device."""
    return _num_sms(device.type, device.index if device.index is not None else torch.cuda.current_device()
                    if device.type == "cuda" else 0)


@functools.lru_cache(maxsize=None)
def _num_sms(kind: str, index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if kind == "cuda" else 4


@dataclass
class GatherLaunch:
    """The arguments of one gather-attention launch but its part buffers (`plan_gather`)."""

    programs: int  # B x H_sel
    num_splits: int
    tensors: tuple  # query, keys, values, indices
    scalars: tuple  # scale x log2(e), n_keys, budget, tiles_per_split
    strides: tuple
    constexprs: dict


def upcast_dot(query: torch.Tensor) -> bool:
    """Triton's CPU interpreter computes bf16 ``tl.dot`` wrongly (triton 3.9): upcast there only."""
    return os.environ.get("TRITON_INTERPRET") == "1" and query.dtype == torch.bfloat16


def plan_gather(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, scale: float,
                block_n: int = BLOCK_N, splits: int | None = None) -> GatherLaunch:
    """Check the inputs (contract of `gather_attention`) and choose the split over N_c: about two
    waves of the GPU's SMs."""
    batch, q_heads, dim = query.shape
    kv_heads, n_keys = keys.shape[1], keys.shape[2]
    sel_heads, budget = indices.shape[1], indices.shape[2]
    if sel_heads not in (kv_heads, q_heads) or q_heads % sel_heads:
        raise ValueError(f"indices have {sel_heads} heads; accepted: Hkv = {kv_heads} or Hq = {q_heads}")
    if dim & (dim - 1) or not 16 <= dim <= 256:
        raise ValueError(f"head_dim {dim} is not supported by the Triton kernel; accepted: 16, 32, 64, 128, 256")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys/values must be contiguous in the head dimension")
    query = query.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    group = q_heads // sel_heads
    tiles = max(1, triton.cdiv(budget, block_n))
    wanted_splits = splits or max(1, triton.cdiv(2 * num_sms(query.device), batch * sel_heads))
    tiles_per_split = triton.cdiv(tiles, min(tiles, wanted_splits))
    return GatherLaunch(
        programs=batch * sel_heads, num_splits=triton.cdiv(tiles, tiles_per_split),
        tensors=(query, keys, values, indices), scalars=(scale * math.log2(math.e), n_keys, budget, tiles_per_split),
        strides=(query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
                 values.stride(0), values.stride(1), values.stride(2), indices.stride(0), indices.stride(1)),
        constexprs=dict(SEL_HEADS=sel_heads, KV_HEADS=kv_heads, GROUP=group,
                        GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK=block_n,
                        UPCAST_DOT=upcast_dot(query)),
    )


MERGE_ELEMENTS = 4096  # fp32 states a merge program holds: rows x padded splits x d (benchmarks/tune_kernels.py)


def merge_parts(query: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                partial: tuple[torch.Tensor, torch.Tensor] | None, *, rows: int | None = None,
                num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``part_out [B, Hq, S, d]``, ``part_lse [B, Hq, S]`` (fp32) and the incoming partial
    states by LSE: ``(out [B, Hq, d] in query's dtype, lse [B, Hq] fp32)``. A program merges
    `rows` query rows (default: about `MERGE_ELEMENTS` states' elements)."""
    batch, q_heads, dim = query.shape
    out = torch.empty(batch, q_heads, dim, device=query.device, dtype=query.dtype)
    lse = torch.empty(batch, q_heads, device=query.device, dtype=torch.float32)
    num_splits = part_lse.shape[-1]
    prior_out, prior_lse = (partial[0].contiguous(), partial[1].contiguous()) if partial else (part_out, part_lse)
    prior_splits = prior_lse.shape[-1] if partial else 1
    splits_pad, prior_pad = max(2, triton.next_power_of_2(num_splits)), max(2, triton.next_power_of_2(prior_splits))
    held = (splits_pad + (prior_pad if partial else 0)) * dim
    rows = rows or 1 << max(0, (MERGE_ELEMENTS // held).bit_length() - 1)  # a power of two
    units = batch * q_heads
    _merge_splits[(triton.cdiv(units, rows),)](
        part_out, part_lse, prior_out, prior_lse, out, lse, units, num_splits, prior_splits,
        HAS_PRIOR=partial is not None, SPLITS_PAD=splits_pad, PRIOR_PAD=prior_pad, DIM=dim, ROWS=rows,
        **launch_options(num_warps, None), **pdl_options(out.device),
    )
    return out, lse


def launch_options(num_warps: int | None, num_stages: int | None) -> dict:
    return {key: value for key, value in (("num_warps", num_warps), ("num_stages", num_stages)) if value}


def gather_attention_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                            scale: float, partial: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                            block_n: int = BLOCK_N, splits: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gather_attention` (see there); fp16, bf16 and fp32; head dims 16..256. The
    keyword-only arguments override the launch configuration (benchmark sweeps)."""
    launch = plan_gather(query, keys, values, indices, scale, block_n, splits)
    batch, q_heads, dim = query.shape
    part_out = torch.empty(batch, q_heads, launch.num_splits, dim, device=query.device, dtype=torch.float32)
    part_lse = torch.empty(batch, q_heads, launch.num_splits, device=query.device, dtype=torch.float32)
    _gather_attention_split[(launch.programs, launch.num_splits)](
        *launch.tensors, part_out, part_lse, *launch.scalars, launch.num_splits, *launch.strides,
        **launch.constexprs, **launch_options(num_warps, num_stages), **pdl_options(part_out.device),
    )
    return merge_parts(query, part_out, part_lse, partial)
