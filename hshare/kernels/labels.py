"""Label cache arithmetic: quantized heavy channels of keys and approximate scores on them.

A *label* (DoubleSparse / HShare section 4.2) is the vector of a key's r heavy channels. Labels
are quantized per (row, head, token) vector, asymmetric min/max:

* 16 bits: stored as is (bf16 keys stay bf16, other dtypes become float16); no scale/zero;
* 8 bits: uint8 codes ``[..., r]`` with a per-token ``scale`` and ``zero``;
* 4 bits: two codes per byte, ``[..., r / 2]`` uint8 (low nibble = even channel), scale and zero.

Dequantized label = code * scale + zero. The query side is not quantized: a single query vector
per step costs nothing to keep exact, and quantizing it only adds error.

These are the plain-PyTorch twins: the CPU path and the test oracle of the Triton kernels.
"""

from __future__ import annotations

import torch

from .dispatch import use_triton
from .selection_heads import kv_heads_read


def label_storage_dtype(key_dtype: torch.dtype) -> torch.dtype:
    """dtype of 16-bit labels and of the scale/zero of 4/8-bit labels for keys of `key_dtype`."""
    if key_dtype == torch.bfloat16:
        return torch.bfloat16
    if key_dtype in (torch.float32, torch.float64):
        return key_dtype  # CPU/reference runs keep full precision of scale and zero
    return torch.float16


def quantize_labels(labels: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantize label vectors.

    Args:
        labels: ``[..., r]`` floating labels (the heavy channels of keys).
        bits: 4, 8 or 16.

    Returns:
        ``(codes, scale, zero)``: codes ``[..., r]`` (16/8 bits) or ``[..., r/2]`` uint8 (4 bits);
        scale and zero ``[...]`` in `label_storage_dtype` (None for 16 bits).
    """
    store = label_storage_dtype(labels.dtype)
    if bits == 16:
        if store in (torch.float32, torch.float64):
            store = torch.float16
        return labels.to(store), None, None
    levels = (1 << bits) - 1
    x = labels.float() if labels.dtype != torch.float64 else labels
    low = x.amin(dim=-1)
    high = x.amax(dim=-1)
    scale = (high - low) * (1.0 / levels)  # one definition on every device (CUDA divides by scalars so)
    scale = scale.to(store).to(x.dtype)  # quantize with the scale that will be stored
    low = low.to(store).to(x.dtype)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - low[..., None]) / safe[..., None]).clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale.to(store), low.to(store)


def append_labels(new_keys: torch.Tensor, channels: torch.Tensor, bits: int, codes_out: torch.Tensor,
                  scale_out: torch.Tensor | None, zero_out: torch.Tensor | None,
                  column: torch.Tensor | None = None) -> None:
    """Quantize the labels of new keys into the label cache's storage (in place).

    Args:
        new_keys: ``[B, Hkv, t, d]``.
        channels: ``[P, H_sel, r]`` heavy channels per selection head (P = 1 or B); selection
            head s reads KV head ``s * Hkv // H_sel``.
        bits: 4, 8 or 16.
        codes_out: ``[B, H_sel, t, r or r/2]``; scale_out, zero_out: ``[B, H_sel, t]`` (None for
            16 bits): views of the cache's buffers.
        column: static shapes: a ``[1]`` int64 device tensor. `new_keys` and the outputs are then
            whole buffers ``[B, ., n, .]``; only the key at that column is quantized, and its
            label written at the same column (no host read of the column, no copies).

    CUDA tensors (4/8 bits) use the Triton kernel (``HSHARE_KERNELS`` as for the other kernels);
    this body is the twin.
    """
    if use_triton(new_keys) and bits in (4, 8) and new_keys.dtype != torch.float64:
        from .labels_triton import append_labels_triton

        append_labels_triton(new_keys, channels, bits, codes_out, scale_out, zero_out, column)
        return
    if column is not None:
        new_keys = new_keys.index_select(2, column)
    batch, _, tokens, _ = new_keys.shape
    keys = kv_heads_read(new_keys, channels.shape[1])  # [B, H_sel, t, d]
    picked = keys.gather(-1, channels[:, :, None, :].expand(batch, -1, tokens, -1))
    for stored, out in zip(quantize_labels(picked, bits), (codes_out, scale_out, zero_out)):
        if stored is None:
            continue
        if column is None:
            out.copy_(stored)
        else:
            out.index_copy_(2, column, stored)


def dequantize_labels(codes: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_labels`: ``[..., r]`` labels in `dtype`."""
    if bits == 16:
        return codes.to(dtype)
    if bits == 4:
        low = codes & 0x0F
        high = codes >> 4
        codes = torch.stack((low, high), dim=-1).flatten(-2)
    return codes.to(dtype) * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]


def label_scores(query_labels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                 zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Approximate attention logits q_lab . k_lab of every cached token (unscaled).

    Args:
        query_labels: ``[B, H, Q, r]`` the heavy channels of Q queries per head (fp32/fp64).
        codes, scale, zero: the label cache of those heads, codes ``[B, H, n, r or r/2]``,
            scale/zero ``[B, H, n]``.
        bits: label bits.

    Returns:
        ``[B, H, Q, n]`` scores in the query labels' dtype (at least fp32).
    """
    dtype = torch.float64 if query_labels.dtype == torch.float64 else torch.float32
    keys = dequantize_labels(codes, scale, zero, bits, dtype)
    return query_labels.to(dtype) @ keys.transpose(-1, -2)


def score_heads(query_labels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                zero: torch.Tensor | None, bits: int, rows: torch.Tensor | None = None,
                heads: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-step label scores of chosen rows and selection heads, read in place from the cache.

    Args:
        query_labels: ``[B', H', r]`` one query's heavy channels per (row, source head).
        codes, scale, zero: the whole label cache ``[B, H_sel, n, ...]`` / ``[B, H_sel, n]``.
        rows: ``[B']`` batch rows (None = all); heads: ``[B' or 1, H']`` selection heads to score
            (None = all): the twin then reads the cache without copying it.

    Returns:
        ``[B', H', n]`` fp32 scores (fp64 for fp64 query labels). CUDA tensors use the Triton kernel
        (``HSHARE_KERNELS`` as for gather-attention); this body is the twin.
    """
    if use_triton(query_labels) and query_labels.dtype != torch.float64:
        from .labels_triton import score_heads_triton

        device = query_labels.device
        rows = torch.arange(query_labels.shape[0], device=device) if rows is None else rows
        heads = torch.arange(query_labels.shape[1], device=device)[None] if heads is None else heads
        return score_heads_triton(query_labels, codes, scale, zero, bits, rows, heads)
    return score_heads_torch(query_labels, codes, scale, zero, bits, rows, heads)


def score_heads_torch(query_labels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                      zero: torch.Tensor | None, bits: int, rows: torch.Tensor | None = None,
                      heads: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `score_heads` (same contract)."""
    tensors = [codes, scale, zero]
    if rows is not None:
        tensors = [None if t is None else t.index_select(0, rows) for t in tensors]
    if heads is not None:
        picks = (torch.arange(tensors[0].shape[0], device=heads.device)[:, None], heads.expand(tensors[0].shape[0], -1))
        tensors = [None if t is None else t[picks] for t in tensors]
    return label_scores(query_labels[:, :, None], tensors[0], tensors[1], tensors[2], bits)[:, :, 0]


def query_labels(query: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Heavy channels of queries per selection head.

    Args:
        query: ``[B, Hq, Q, d]``.
        channels: ``[P, H_sel, r]`` heavy channels per selection head (P = 1 or B).

    Returns:
        ``[B, H_sel, Q, r]`` (fp32, fp64 for fp64 queries); per-KV-head selection (H_sel < Hq) sums the
        query labels of the g query heads of a group (their mean approximate logit, up to 1/g).
    """
    batch, q_heads, rows, dim = query.shape
    sel_heads = channels.shape[1]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    grouped = query.reshape(batch, sel_heads, q_heads // sel_heads, rows, dim).to(acc)
    picks = channels[:, :, None, None, :].expand(batch, -1, grouped.shape[2], rows, -1)
    return grouped.gather(-1, picks).sum(2)


def decode_label_scores(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                        zero: torch.Tensor | None, bits: int, rows: torch.Tensor | None = None,
                        heads: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-step label scores of the decode query for chosen rows and selection heads.

    Args:
        query: ``[B, Hq, d]`` the decode query of every row.
        channels: ``[P, H_sel, r]`` heavy channels.
        codes, scale, zero, bits: the whole label cache (`score_heads`).
        rows: ``[B']`` batch rows (None = all); heads: ``[B' or 1, H']`` selection heads (None = all).

    Returns:
        ``[B', H', n]`` fp32 scores (fp64 for fp64 queries). CUDA tensors: one Triton launch that
        gathers the query labels itself; the twin makes `query_labels` and calls `score_heads`.
    """
    if use_triton(query) and query.dtype != torch.float64:
        from .labels_triton import score_heads_triton

        device = query.device
        rows = torch.arange(query.shape[0], device=device) if rows is None else rows
        heads = torch.arange(channels.shape[1], device=device)[None] if heads is None else heads
        return score_heads_triton(None, codes, scale, zero, bits, rows, heads, query=query, channels=channels)
    return score_heads(decode_query_labels(query, channels, rows, heads), codes, scale, zero, bits, rows, heads)


def decode_query_labels(query: torch.Tensor, channels: torch.Tensor, rows: torch.Tensor | None = None,
                        heads: torch.Tensor | None = None) -> torch.Tensor:
    """The decode query's labels (`query_labels` of ``[B, Hq, d]``) at rows ``[B']`` (None = all) and
    selection heads ``[B' or 1, H']`` (None = all): ``[B', H', r]``."""
    labels = query_labels(query[:, :, None], channels)[:, :, 0]  # [B, H_sel, r]
    if rows is not None:
        labels = labels.index_select(0, rows)
    if heads is not None:
        picks = heads.expand(labels.shape[0], -1)[..., None].expand(-1, -1, labels.shape[-1])
        labels = labels.gather(1, picks)
    return labels


def candidate_label_scores(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                           scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int, columns: torch.Tensor,
                           rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-step label scores of candidate columns only (candidate-set refinement): the label rows of
    `columns` are read, nothing else of the cache.

    Args:
        query: ``[B, Hq, d]`` the decode query of every row.
        channels: ``[P, H_sel, r]`` heavy channels.
        codes, scale, zero, bits: the whole label cache (`score_heads`).
        columns: ``[B', H', C]`` candidate columns per (row, head); ``NO_TOKEN`` (any negative) entries
            are scored as column 0 (the caller masks them).
        rows: ``[B']`` batch rows (None = all); heads: ``[B' or 1, H']`` selection heads (None = all).

    Returns:
        ``[B', H', C]`` fp32 scores (fp64 for fp64 queries). One gather of the candidates' label rows: the
        scores of `label_topk.candidate_label_topk_torch`, the twin of the fused candidate top-k.
    """
    labels = decode_query_labels(query, channels, rows, heads)  # [B', H', r]
    count, width = columns.shape[0], columns.shape[1]
    device = columns.device
    row_index = (torch.arange(count, device=device) if rows is None else rows)[:, None, None]
    head_index = (torch.arange(width, device=device)[None] if heads is None else heads.expand(count, -1))[..., None]
    picks = (row_index, head_index, columns.clamp(min=0))  # [B', H', C] each (broadcast)
    keys = dequantize_labels(codes[picks], None if scale is None else scale[picks],
                             None if zero is None else zero[picks], bits, labels.dtype)  # [B', H', C, r]
    return (keys @ labels[..., None])[..., 0]
