"""Attention over a prefix stored once for a group of rows, as one batched product per KV head
(Hydragen, section 3: "inter-sequence batching"), with its natural-log LSE for the exact merge.

A prefix level holds ``G`` groups; the rows of a group (any rows of the batch, in any order) share
the group's keys. For each group and KV head, the queries of all its rows and of the g query heads
reading that KV head become the rows of one matrix product against the group's keys (GQA folded:
the prefix is read once per group, not once per row or per query head).

`attention_with_lse` is the dense attention both the prefix levels and a row's own part use at
prefill: on CUDA it calls PyTorch's fused kernels that return the LSE (flash attention without a
mask, memory-efficient attention with one); elsewhere the plain-PyTorch twin
`attention_with_lse_torch` (the CPU path and the test oracle). At decode,
`shared_prefix_decode_states` returns the level's attention unmerged, split over its keys (the
Triton kernel on CUDA), for gather-attention to merge with the row's own part in one pass.
"""

from __future__ import annotations

import torch

from .dispatch import use_fused, use_triton

_TWIN_CHUNK_ELEMENTS = 1 << 26  # logits materialised at once by the twin (fp32: 256 MiB)


def attention_with_lse(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention with LSE (contract: `attention_with_lse_torch`); fused kernels on CUDA."""
    if use_fused(query) and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        return _attention_with_lse_cuda(query, keys, values, scale, mask)
    return attention_with_lse_torch(query, keys, values, scale, mask)


def attention_with_lse_torch(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of R query rows over L keys, per (batch, head), with its LSE.

    Args:
        query: ``[N, H, R, d]``.
        keys, values: ``[N, H, L, d]``.
        scale: softmax scale.
        mask: bool, broadcastable to ``[N, H, R, L]`` (True = attend), or None (all keys).

    Returns:
        ``(out [N, H, R, d] in query's dtype, lse [N, H, R] fp32, fp64 for fp64 inputs)``. A row
        with no key gets ``out = 0`` and ``lse = -inf`` (never NaN).
    """
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    n, heads, rows, _ = query.shape
    keys_t = keys.to(acc).transpose(-1, -2)
    values_acc = values.to(acc)
    chunk = max(1, _TWIN_CHUNK_ELEMENTS // max(1, n * heads * keys.shape[2]))
    outs, lses = [], []
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        logits = (query[:, :, start:stop].to(acc) @ keys_t) * scale  # [N, H, r, L]
        if mask is not None:
            logits = logits.masked_fill(~mask[..., start:stop, :] if mask.shape[-2] > 1 else ~mask, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        outs.append(torch.exp(logits - safe[..., None]) @ values_acc)
        lses.append(lse)
    return torch.cat(outs, dim=2).to(query.dtype), torch.cat(lses, dim=2)


def _attention_with_lse_cuda(query, keys, values, scale, mask):
    rows = query.shape[2]
    if mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, keys, values, 0.0, False, False,
                                                                  scale=scale)[:2]
    # memory-efficient attention takes an additive bias; its last dim must be 16-aligned in memory
    n, heads, _, length = query.shape[0], query.shape[1], rows, keys.shape[2]
    padded = -(-length // 16) * 16
    full = mask.expand(n, -1, rows, length)
    bias = torch.full((n, full.shape[1], rows, padded), float("-inf"), dtype=query.dtype, device=query.device)
    bias[..., :length].masked_fill_(full, 0.0)
    bias = bias[..., :length].expand(n, heads, rows, length)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(query, keys, values, bias, True, 0.0, False,
                                                                      scale=scale)[:2]
    lse = lse[..., :rows]
    any_key = full.any(-1).expand(n, heads, rows)
    out = torch.where(any_key[..., None], out, torch.zeros_like(out))
    lse = torch.where(any_key, lse, torch.full_like(lse, float("-inf")))
    return out, lse


def shared_prefix_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                            members: torch.Tensor | None = None, row_slot: torch.Tensor | None = None,
                            key_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every row over its group's prefix keys, one batched product per group and KV head.

    Args:
        query: ``[B, Hq, T, d]`` (T = 1 at decode).
        keys, values: ``[G, Hkv, L, d]`` the level's prefix, stored once per group.
        scale: softmax scale.
        members: ``[G, M]`` the rows of each group (``-1`` pads groups with fewer than M rows);
            None = one group holding every row in order (no gather of the queries).
        row_slot: ``[B]`` position ``g * M + m`` of each row in `members`, ``-1`` for a row in no
            group of this level (it gets ``out = 0``, ``lse = -inf``: a no-op in the merge);
            None with ``members=None``.
        key_valid: ``[G, L]`` bool, for groups shorter than the level's width; None = all valid.

    Returns:
        ``(out [B, Hq, T, d], lse [B, Hq, T])`` natural-log LSE, fp32 (fp64 for fp64 inputs).
    """
    batch, q_heads, steps, dim = query.shape
    groups, kv_heads = keys.shape[:2]
    per_kv = q_heads // kv_heads
    if members is None:
        width, folded = batch, query
    else:
        width = members.shape[1]
        folded = query.index_select(0, members.flatten().clamp(min=0))  # [G*M, Hq, T, d]
    folded = folded.view(groups, width, kv_heads, per_kv, steps, dim).permute(0, 2, 1, 3, 4, 5)
    folded = folded.reshape(groups, kv_heads, width * per_kv * steps, dim)  # GEMM rows: (row, head, step)
    mask = None if key_valid is None else key_valid[:, None, None, :]
    out, lse = attention_with_lse(folded, keys, values, scale, mask)
    out = out.reshape(groups, kv_heads, width, per_kv, steps, dim).permute(0, 2, 1, 3, 4, 5)
    out = out.reshape(groups * width, q_heads, steps, dim)
    lse = lse.reshape(groups, kv_heads, width, per_kv, steps).permute(0, 2, 1, 3, 4).reshape(groups * width, q_heads,
                                                                                             steps)
    if members is None:
        return out, lse
    in_level = (row_slot >= 0)[:, None, None]
    slot = row_slot.clamp(min=0)
    out = torch.where(in_level[..., None], out.index_select(0, slot), torch.zeros((), dtype=out.dtype,
                                                                                   device=out.device))
    lse = torch.where(in_level, lse.index_select(0, slot), torch.full((), float("-inf"), dtype=lse.dtype,
                                                                       device=lse.device))
    return out, lse


def shared_prefix_decode_states(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                                members: torch.Tensor | None = None, row_slot: torch.Tensor | None = None,
                                key_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of every row over its group's prefix, left unmerged over S key splits.

    The CUDA path is the Triton kernel (`shared_prefix_decode_states_triton`: each prefix tile read
    once for all rows of a group, S splits filling the GPU); the twin is `shared_prefix_attention`
    (S = 1). Either result goes to `gather_attention(..., partial=...)`, which merges it with the
    row's own part exactly.

    Args:
        query: ``[B, Hq, d]`` one decode query per row and head.
        keys, values, members, row_slot, key_valid: as in `shared_prefix_attention`.

    Returns:
        ``(out [B, Hq, S, d], lse [B, Hq, S])`` fp32 (fp64 for fp64 inputs): the softmax over
        each split's keys and its natural-log LSE; a row in no group, or a split with no valid
        key, has ``lse = -inf``.
    """
    if use_triton(query):
        from .prefix_attention_triton import shared_prefix_decode_states_triton

        return shared_prefix_decode_states_triton(query, keys, values, scale, members, key_valid)
    out, lse = shared_prefix_attention(query[:, :, None], keys, values, scale, members, row_slot, key_valid)
    return out.to(lse.dtype), lse
