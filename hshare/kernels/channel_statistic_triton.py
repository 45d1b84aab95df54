"""Triton heavy-channel statistic: the prompt's queries and keys read once, in their own dtype.

Twin of `channel_statistic.channel_statistic_torch` (same arguments, same result up to the order of
the float32 sums). Program (row b, query head h, token split j) streams the valid tokens of its
split in tiles, accumulating ``|q| * |k|`` per channel in float32 registers (the key of head h's KV
head; padding tokens are not read), and writes its partial sum; the splits are summed in a fixed
order afterwards (deterministic: no atomics). Splits fill about two waves of the GPU's SMs when
rows x heads alone do not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gather_attention_triton import num_sms
from .dependent_launch import pdl_options, wait_for_previous_kernel

BLOCK_T = 32  # tokens per tile
MIN_SPLIT_TOKENS = 512  # a split streams at least this many tokens


@triton.jit
def _channel_statistic(
    q_ptr, k_ptr, valid_ptr, part_ptr, tokens, tokens_per_split,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_ps,
    Q_HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // Q_HEADS).to(tl.int64)
    h = pid % Q_HEADS
    kv = h // GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < DIM
    acc = tl.zeros([BLOCK, DIM_PAD], dtype=tl.float32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, tokens)
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        ok = (t < end) & (tl.load(valid_ptr + b * s_vb + t, mask=t < end, other=0) != 0)
        both = ok[:, None] & dim_ok[None, :]
        q = tl.load(q_ptr + b * s_qb + h * s_qh + t[:, None].to(tl.int64) * s_qt + dims[None, :], mask=both,
                    other=0.0)
        k = tl.load(k_ptr + b * s_kb + kv * s_kh + t[:, None].to(tl.int64) * s_kt + dims[None, :], mask=both,
                    other=0.0)
        acc += tl.abs(q.to(tl.float32)) * tl.abs(k.to(tl.float32))
    tl.store(part_ptr + split * s_ps + pid * DIM + dims, tl.sum(acc, 0), mask=dim_ok)


def channel_statistic_triton(query: torch.Tensor, keys: torch.Tensor, token_valid: torch.Tensor,
                             splits: int | None = None) -> torch.Tensor:
    """Same contract as `channel_statistic_torch`; any float dtype and head dim, keys and queries
    contiguous in the head dimension (copied otherwise). `splits` overrides the token split."""
    batch, q_heads, tokens, dim = query.shape
    kv_heads = keys.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads do not group onto {kv_heads} KV heads")
    query = query if query.stride(-1) == 1 else query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    valid = token_valid.to(torch.uint8).contiguous()
    programs = batch * q_heads
    if splits is None:
        splits = max(1, min(triton.cdiv(2 * num_sms(query.device), programs), triton.cdiv(tokens, MIN_SPLIT_TOKENS)))
    tokens_per_split = triton.cdiv(max(tokens, 1), splits)
    splits = triton.cdiv(max(tokens, 1), tokens_per_split)
    part = torch.empty(splits, programs, dim, device=query.device, dtype=torch.float32)
    _channel_statistic[(programs, splits)](
        query, keys, valid, part, tokens, tokens_per_split,
        query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        valid.stride(0), part.stride(0),
        Q_HEADS=q_heads, GROUP=q_heads // kv_heads, DIM=dim, DIM_PAD=triton.next_power_of_2(dim), BLOCK=BLOCK_T,
        **pdl_options(keys.device),
    )
    return part.sum(0).reshape(batch, q_heads, dim)
