"""Dense decode attention of a GQA model with its keys and values read once.

A decode step has one query per row. Grouped-query attention gives each KV head G = Hq / Hkv query
heads; folding them onto their KV head as G query rows (``[B, Hq, 1, d]`` -> ``[B, Hkv, G, d]``, query
head ``h`` = KV head ``h // G``, as in transformers' ``repeat_kv``) lets SDPA read each key and value
once, with the row's key mask broadcast over the group. transformers (before its ``pack_gqa``, and
whenever it compiles) instead repeats K and V G times when a mask is given, which a padded batch's
and a static-shape step's always is: G-fold copies of the whole KV in every layer of every step.
Exact: the same dot products, softmax and weighted sums per (row, query head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Softmax attention of one decode query per row over every key.

    Args:
        query: ``[B, Hq, 1, d]``; key, value: ``[B, Hkv, n, d]`` with ``Hq % Hkv == 0``.
        mask: None, or ``[B, 1, 1, >= n]`` (bool: True attends; float: added to the logits), shared
            by every head.
        scaling: the logits' scale.

    Returns:
        ``[B, 1, Hq, d]`` (transformers' attention-output layout).
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or q_heads % kv_heads or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1)):
        raise ValueError(f"dense_decode_attention takes one query per row and a mask shared by the heads; got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, mask "
                         f"{None if mask is None else tuple(mask.shape)}")
    if mask is not None:
        mask = mask[..., : key.shape[2]]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, q_heads, value.shape[-1])
