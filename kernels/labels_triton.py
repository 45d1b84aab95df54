"""Triton label scoring: approximate logits of every cached token for the source heads only.

Twin of `labels.score_heads`. Program (row, source head, token tile) reads the tile's quantized
labels straight from the label cache's buffer (4-bit codes unpacked in registers, no dequantized
copy of the cache) and writes ``scale * (codes . q) + zero * sum(q)``. The heads and rows to
score come as index arrays, so copying heads and layers cost nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 128  # tokens per program


@triton.jit
def _score_heads(
    q_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, out_ptr, n,
    s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_hb,
    HEADS: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = tl.program_id(1)
    i = pid // HEADS
    j = pid % HEADS
    row = tl.load(rows_ptr + i).to(tl.int64)
    head = tl.load(heads_ptr + i * s_hb + j).to(tl.int64)
    tokens = tile * BLOCK + tl.arange(0, BLOCK)
    ok = tokens < n
    base = codes_ptr + row * s_cb + head * s_ch + tokens[:, None] * s_cn
    if BITS == 4:
        half = tl.arange(0, R // 2)
        q_even = tl.load(q_ptr + pid * R + 2 * half)
        q_odd = tl.load(q_ptr + pid * R + 2 * half + 1)
        packed = tl.load(base + half[None, :], mask=ok[:, None], other=0).to(tl.int32)
        dot = tl.sum((packed & 15).to(tl.float32) * q_even[None, :] + (packed >> 4).to(tl.float32) * q_odd[None, :], 1)
    else:
        channels = tl.arange(0, R)
        q = tl.load(q_ptr + pid * R + channels)
        codes = tl.load(base + channels[None, :], mask=ok[:, None], other=0).to(tl.float32)
        dot = tl.sum(codes * q[None, :], 1)
    if BITS == 16:
        score = dot
    else:
        channels_all = tl.arange(0, R)
        q_sum = tl.sum(tl.load(q_ptr + pid * R + channels_all), 0)
        scale = tl.load(scale_ptr + row * s_sb + head * s_sh + tokens, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + row * s_zb + head * s_zh + tokens, mask=ok, other=0.0).to(tl.float32)
        score = scale * dot + zero * q_sum
    tl.store(out_ptr + pid * n + tokens, score, mask=ok)


def score_heads_triton(query_labels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                       zero: torch.Tensor | None, bits: int, rows: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Same contract as `labels.score_heads`; channel count r a power of two (>= 2)."""
    count, n_heads, channels = query_labels.shape
    n = codes.shape[2]
    if channels & (channels - 1) or channels < 2:
        raise ValueError(f"label_channels {channels} is not supported by the Triton kernel; accepted: powers of two")
    if codes.stride(-1) != 1:
        raise ValueError("label codes must be contiguous in the channel dimension")
    q = query_labels.float().contiguous()
    heads = heads.expand(count, n_heads).to(torch.int32).contiguous()
    rows = rows.to(torch.int32).contiguous()
    out = torch.empty(count, n_heads, n, device=q.device, dtype=torch.float32)
    scale_t = scale if scale is not None else codes
    zero_t = zero if zero is not None else codes
    _score_heads[(count * n_heads, triton.cdiv(n, BLOCK_T))](
        q, codes, scale_t, zero_t, rows, heads, out, n,
        codes.stride(0), codes.stride(1), codes.stride(2),
        scale_t.stride(0), scale_t.stride(1), zero_t.stride(0), zero_t.stride(1), heads.stride(0),
        HEADS=n_heads, R=channels, BITS=bits, BLOCK=BLOCK_T,
    )
    return out
