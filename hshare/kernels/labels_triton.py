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
from .dependent_launch import pdl_options, wait_for_previous_kernel

BLOCK_T = 128  # tokens per program


@triton.jit
def _labels_at(labels_ptr, query_ptr, channels_ptr, pid, row, head, slots, s_qb, s_qh, s_chp, s_chh,
               R: tl.constexpr, GROUP: tl.constexpr, PER_ROW_CHANNELS: tl.constexpr, FROM_QUERY: tl.constexpr):
    """Query labels (fp32) of program `pid` at label slots `slots`: read from the ``[B', H', r]``
    labels, or gathered from the query ``[B, Hq, d]`` (the heavy channels of the GROUP query heads
    of selection head `head`, summed) so that no labels tensor is made first."""
    if FROM_QUERY:
        offset = head * s_chh
        if PER_ROW_CHANNELS:
            offset += row * s_chp
        picked = tl.load(channels_ptr + offset + slots).to(tl.int64)
        labels = tl.zeros(slots.shape, tl.float32)
        for g in tl.static_range(GROUP):
            labels += tl.load(query_ptr + row * s_qb + (head * GROUP + g) * s_qh + picked).to(tl.float32)
    else:
        labels = tl.load(labels_ptr + pid * R + slots)
    return labels


@triton.jit
def _label_scores(dot, q_sum, scale_ptr, zero_ptr, row, head, columns, ok, s_sb, s_sh, s_zb, s_zh,
                  BITS: tl.constexpr):
    """Scores ``[N]`` fp32 of label columns `columns` of (row, head) from their codes' dot with the query labels
    and the labels' sum: ``scale * dot + zero * q_sum`` (scale and zero read where `ok`), or for 16-bit labels
    (no scale and zero) the dot."""
    if BITS == 16:
        score = dot
    else:
        scale = tl.load(scale_ptr + row * s_sb + head * s_sh + columns, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + row * s_zb + head * s_zh + columns, mask=ok, other=0.0).to(tl.float32)
        score = scale * dot + zero * q_sum
    return score


@triton.jit
def _score_heads(
    q_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, out_ptr, n,
    s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_hb,
    HEADS: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    GROUP: tl.constexpr, PER_ROW_CHANNELS: tl.constexpr, FROM_QUERY: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
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
        q_even = _labels_at(q_ptr, query_ptr, channels_ptr, pid, row, head, 2 * half, s_qb, s_qh, s_chp, s_chh,
                            R, GROUP, PER_ROW_CHANNELS, FROM_QUERY)
        q_odd = _labels_at(q_ptr, query_ptr, channels_ptr, pid, row, head, 2 * half + 1, s_qb, s_qh, s_chp, s_chh,
                           R, GROUP, PER_ROW_CHANNELS, FROM_QUERY)
        packed = tl.load(base + half[None, :], mask=ok[:, None], other=0).to(tl.int32)
        dot = tl.sum((packed & 15).to(tl.float32) * q_even[None, :] + (packed >> 4).to(tl.float32) * q_odd[None, :], 1)
        q_sum = tl.sum(q_even, 0) + tl.sum(q_odd, 0)
    else:
        channels = tl.arange(0, R)
        q = _labels_at(q_ptr, query_ptr, channels_ptr, pid, row, head, channels, s_qb, s_qh, s_chp, s_chh,
                       R, GROUP, PER_ROW_CHANNELS, FROM_QUERY)
        codes = tl.load(base + channels[None, :], mask=ok[:, None], other=0).to(tl.float32)
        dot = tl.sum(codes * q[None, :], 1)
        q_sum = tl.sum(q, 0)
    score = _label_scores(dot, q_sum, scale_ptr, zero_ptr, row, head, tokens, ok, s_sb, s_sh, s_zb, s_zh, BITS)
    tl.store(out_ptr + pid * n + tokens, score, mask=ok)


def score_heads_triton(query_labels: torch.Tensor | None, codes: torch.Tensor, scale: torch.Tensor | None,
                       zero: torch.Tensor | None, bits: int, rows: torch.Tensor, heads: torch.Tensor, *,
                       query: torch.Tensor | None = None, channels: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `labels.score_heads`; channel count r a power of two (>= 2). Without
    `query_labels`, the labels are gathered in the kernel from the decode `query` ``[B, Hq, d]`` and
    the heavy `channels` ``[P, H_sel, r]`` (`labels.decode_label_scores`)."""
    n = codes.shape[2]
    count, n_heads = rows.shape[0], heads.shape[-1]
    labels, query, channels, channels_count, group, from_query = kernel_label_inputs(query_labels, query, channels)
    if channels_count & (channels_count - 1) or channels_count < 2:
        raise ValueError(f"label_channels {channels_count} is not supported by the Triton kernel; "
                         "accepted: powers of two")
    if codes.stride(-1) != 1:
        raise ValueError("label codes must be contiguous in the channel dimension")
    heads = heads.expand(count, n_heads).to(torch.int32).contiguous()
    rows = rows.to(torch.int32).contiguous()
    out = torch.empty(count, n_heads, n, device=codes.device, dtype=torch.float32)
    scale_t = scale if scale is not None else codes
    zero_t = zero if zero is not None else codes
    _score_heads[(count * n_heads, triton.cdiv(n, BLOCK_T))](
        labels, query, channels, codes, scale_t, zero_t, rows, heads, out, n,
        query.stride(0), query.stride(1), channels.stride(0), channels.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2),
        scale_t.stride(0), scale_t.stride(1), zero_t.stride(0), zero_t.stride(1), heads.stride(0),
        HEADS=n_heads, R=channels_count, BITS=bits, BLOCK=BLOCK_T, GROUP=group,
        PER_ROW_CHANNELS=from_query and channels.shape[0] > 1, FROM_QUERY=from_query, **pdl_options(out.device),
    )
    return out


def kernel_label_inputs(query_labels: torch.Tensor | None, query: torch.Tensor | None, channels: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, bool]:
    """What a label-scoring kernel reads of the query: ``(labels, query, channels, r, group, from_query)``.
    Given `query_labels` ``[A, H', r]`` (fp32, contiguous; `query` and `channels` become placeholders the
    kernel does not read), or the decode `query` ``[B, Hq, d]`` and heavy `channels` ``[P, H_sel, r]``
    whose labels the kernel gathers itself (group = Hq / H_sel query heads summed; `labels` a placeholder)."""
    if query_labels is None:
        query = query if query.stride(-1) == 1 else query.contiguous()
        return query, query, channels.contiguous(), channels.shape[-1], query.shape[1] // channels.shape[1], True
    labels = query_labels.float().contiguous()
    return labels, labels, labels, labels.shape[-1], 1, False


@triton.jit
def _append_labels(
    keys_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, column_ptr, tokens,
    s_kb, s_kh, s_kt, s_chp, s_chh, s_cb, s_ch, s_ct, s_sb, s_sh, s_st, s_zb, s_zh, s_zt,
    SEL_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, PER_ROW_CHANNELS: tl.constexpr, R: tl.constexpr,
    BITS: tl.constexpr, LEVELS: tl.constexpr, STORE: tl.constexpr, HAS_COLUMN: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (row, selection head, tile of BLOCK tokens): the tile's labels, one token per lane row."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = token < tokens
    if HAS_COLUMN:  # static shapes: the token at the column held on the device, read and written there
        token += tl.load(column_ptr)
    row = (pid // SEL_HEADS).to(tl.int64)
    head = pid % SEL_HEADS
    kv_head = (head * KV_HEADS // SEL_HEADS).to(tl.int64)
    chan_base = channels_ptr + head * s_chh
    if PER_ROW_CHANNELS:
        chan_base += row * s_chp
    half = tl.arange(0, R // 2)
    key_base = keys_ptr + row * s_kb + kv_head * s_kh + token[:, None] * s_kt
    even = tl.load(key_base + tl.load(chan_base + 2 * half)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    odd = tl.load(key_base + tl.load(chan_base + 2 * half + 1)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    low = tl.minimum(tl.min(even, 1), tl.min(odd, 1))  # [BLOCK]
    high = tl.maximum(tl.max(even, 1), tl.max(odd, 1))
    scale = (high - low) * (1.0 / LEVELS)  # as the twin
    if STORE == 2:  # quantize with the scale and zero that will be stored (as the twin)
        scale = _round_to_bf16(scale)
        low = _round_to_bf16(low)
    elif STORE == 1:
        scale = scale.to(tl.float16).to(tl.float32)
        low = low.to(tl.float16).to(tl.float32)
    safe = tl.where(scale > 0, scale, 1.0)[:, None]
    # IEEE division as torch's tensor / tensor (Triton's '/' is approximate on the GPU)
    code_even = _round_half_even(tl.math.div_rn(even - low[:, None], safe), LEVELS)
    code_odd = _round_half_even(tl.math.div_rn(odd - low[:, None], safe), LEVELS)
    out_base = codes_ptr + row * s_cb + head * s_ch + token[:, None] * s_ct
    if BITS == 4:
        tl.store(out_base + half[None, :], (code_even | (code_odd << 4)).to(tl.uint8), mask=ok[:, None])
    else:
        tl.store(out_base + 2 * half[None, :], code_even.to(tl.uint8), mask=ok[:, None])
        tl.store(out_base + 2 * half[None, :] + 1, code_odd.to(tl.uint8), mask=ok[:, None])
    tl.store(scale_ptr + row * s_sb + head * s_sh + token * s_st, scale.to(scale_ptr.dtype.element_ty), mask=ok)
    tl.store(zero_ptr + row * s_zb + head * s_zh + token * s_zt, low.to(zero_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> nearest bf16 (ties to even), kept in fp32; by bits, so that Triton's CPU interpreter
    (which truncates on a bf16 cast) and the GPU agree with torch."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_half_even(x, LEVELS: tl.constexpr):
    """torch.round (ties to even), clamped to [0, LEVELS], as int32."""
    rounded = tl.floor(x + 0.5)
    tie = (rounded - x) == 0.5
    odd = (rounded - 2.0 * tl.floor(rounded * 0.5)) == 1.0
    rounded = tl.where(tie & odd, rounded - 1.0, rounded)
    return tl.minimum(tl.maximum(rounded, 0.0), LEVELS).to(tl.int32)


APPEND_TOKENS = 32  # tokens per label-writing program (a prompt's keys; a decode step writes one)


def append_labels_triton(new_keys: torch.Tensor, channels: torch.Tensor, bits: int, codes_out: torch.Tensor,
                         scale_out: torch.Tensor, zero_out: torch.Tensor, column: torch.Tensor | None = None) -> None:
    """Same contract as `labels.append_labels` for 4 and 8 bits; r even; keys fp16/bf16/fp32."""
    batch, kv_heads, tokens, _ = new_keys.shape
    per_row, sel_heads, r = channels.shape
    if r % 2:
        raise ValueError(f"label_channels {r} is odd; accepted by the Triton kernel: even counts")
    if r & (r - 1):
        raise ValueError(f"label_channels {r} is not supported by the Triton kernel; accepted: powers of two")
    if new_keys.stride(-1) != 1:
        new_keys = new_keys.contiguous()
    channels = channels.contiguous()
    if column is not None:
        tokens = 1
    block = min(APPEND_TOKENS, triton.next_power_of_2(max(tokens, 1)))
    _append_labels[(batch * sel_heads, triton.cdiv(tokens, block))](
        new_keys, channels, codes_out, scale_out, zero_out, codes_out if column is None else column, tokens,
        new_keys.stride(0), new_keys.stride(1), new_keys.stride(2), channels.stride(0), channels.stride(1),
        codes_out.stride(0), codes_out.stride(1), codes_out.stride(2), scale_out.stride(0), scale_out.stride(1),
        scale_out.stride(2), zero_out.stride(0), zero_out.stride(1), zero_out.stride(2),
        SEL_HEADS=sel_heads, KV_HEADS=kv_heads, PER_ROW_CHANNELS=per_row > 1, R=r, BITS=bits,
        LEVELS=(1 << bits) - 1, STORE={torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[scale_out.dtype],
        HAS_COLUMN=column is not None, BLOCK=block, **pdl_options(codes_out.device),
    )
