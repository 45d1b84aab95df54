"""Dense decode attention split over the keys (flash-decoding), with its natural-log LSE.

A decode step has one query per row; at long context (tens of thousands of keys) and few rows,
one program per (row, KV head) leaves most of the GPU idle. The Triton kernel
(`split_decode_triton.split_decode_attention_triton`) splits each row's keys over many programs,
each reading its keys once for all G = Hq / Hkv query heads of its KV head (GQA folded: query head
``h`` reads KV head ``h // G``), and merges the splits exactly by log-sum-exp.

`split_decode_attention` dispatches (`dispatch.use_triton`): CUDA tensors go to the Triton kernel,
everything else to the plain-PyTorch twin `split_decode_attention_torch` (the CPU path and the test
oracle, unsplit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton
from .prefix_attention import attention_with_lse_torch


def split_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None,
                           scale: float, *, return_lse: bool = False):
    """Dense decode attention (contract: `split_decode_attention_torch`); Triton for CUDA tensors."""
    if use_triton(query):
        from .split_decode_triton import split_decode_attention_triton

        return split_decode_attention_triton(query, key, value, valid, scale, return_lse=return_lse)
    return split_decode_attention_torch(query, key, value, valid, scale, return_lse=return_lse)


def split_decode_attention_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 valid: torch.Tensor | None, scale: float, *, return_lse: bool = False):
    """Softmax attention of one decode query per row and query head over the row's valid keys.

    Args:
        query: ``[B, Hq, d]``.
        key, value: ``[B, Hkv, N, d]`` with ``Hq % Hkv == 0``, of query's dtype; any strides (views
            of a larger cache buffer, e.g. ``storage[:, :, :N]``; the Triton path needs a unit
            stride on d).
        valid: ``[B, N]`` bool, True where the row attends to the column (False: padding, columns
            not yet written, keys outside a sliding window), or None (every column).
        scale: the logits' scale.
        return_lse: also return the natural-log LSE of each (row, query head).

    Returns:
        ``out [B, Hq, d]`` in query's dtype, and with `return_lse` ``(out, lse [B, Hq] fp32)``. A row
        with no valid key gets ``out = 0`` and ``lse = -inf`` (never NaN).
    """
    batch, q_heads, kv_heads, dim = check_split_decode(query, key, value, valid)
    folded = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)  # query head h -> KV head h // G
    mask = None if valid is None else valid[:, None, None, :]
    if return_lse:
        out, lse = attention_with_lse_torch(folded, key, value, scale, mask)
        return out.reshape(batch, q_heads, dim), lse.reshape(batch, q_heads)
    # without the LSE: SDPA's own arithmetic, so that a dense step equals transformers' (which folds GQA alike)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale)
    if valid is not None:
        out = out.masked_fill(~valid.any(-1)[:, None, None, None], 0.0)  # SDPA gives NaN for a row with no key
    return out.reshape(batch, q_heads, dim)


def check_split_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       valid: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Check the contract of `split_decode_attention_torch`; ``(B, Hq, Hkv, d)`` or ValueError."""
    if query.dim() != 3:
        raise ValueError(f"query has shape {tuple(query.shape)}; accepted: [B, Hq, d], one decode query per row")
    batch, q_heads, dim = query.shape
    if key.dim() != 4 or value.shape != key.shape or key.shape[0] != batch or key.shape[3] != dim:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not fit query "
                         f"{tuple(query.shape)}; accepted: both [B, Hkv, N, d] = [{batch}, Hkv, N, {dim}]")
    kv_heads, n_keys = key.shape[1], key.shape[2]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"query has Hq = {q_heads} heads and key Hkv = {kv_heads}; accepted: Hq a multiple of Hkv")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key and value are {query.dtype}, {key.dtype}, {value.dtype}; accepted: one dtype")
    if valid is not None and (valid.shape != (batch, n_keys) or valid.dtype != torch.bool):
        raise ValueError(f"valid is {valid.dtype} of shape {tuple(valid.shape)}; accepted: None or bool "
                         f"[B, N] = [{batch}, {n_keys}]")
    return batch, q_heads, kv_heads, dim
