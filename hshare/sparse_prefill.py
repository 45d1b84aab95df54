"""Sparse prefill (HShare paper, Appendix A.1: token-sparse attention in prefill and decode).

Each query row of a sparse layer attends only to its own critical tokens: the sink (first valid
keys), the local window (last valid keys, the row's own token included) and the top-``heavy``
tokens of its causal middle window by the selection policy's prefill scores; a row with no more
valid keys than N_c attends to all of them (exact). Per-KV-head selection masks the g query heads
of a group alike. The mask is built and applied chunk by chunk of query rows (scores
``[B, H_sel, chunk, n]``), so memory stays bounded, and the chunk runs PyTorch's SDPA with a bool
mask (GQA folded into the query rows: no repeated keys).

The paper's main setting, and this package's default, is dense prefill (``sparse_prefill=False``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hshare.planner import keep_mask
from hshare.policy import SelectionPolicy
from hshare.selection import prefill_middle_windows, select_heavy, valid_columns_from_mask, valid_counts

CHUNK_ELEMENTS = 1 << 24  # score elements (B x H_sel x chunk x n) per chunk of query rows


def prefill_critical_mask(scores: torch.Tensor | None, valid: torch.Tensor, sink: int, local: int,
                          heavy: int) -> torch.Tensor:
    """Critical tokens of prefill query rows, as a mask.

    Args:
        scores: ``[B, H, C, n]`` the policy's token scores for C query rows (None when ``heavy`` is 0).
        valid: ``[B, C, n]`` bool, the keys each row may attend (causal, padding, sliding window).
        sink, local, heavy: the budget N_c = sink + local + heavy.

    Returns:
        ``[B, H, C, n]`` bool (H = 1 when `scores` is None): sink, local and heavy columns, or every
        valid column of a row with ``n_valid <= N_c``. Each row has ``min(N_c, n_valid)`` True
        entries per head, all on valid columns.
    """
    rank = valid_counts(valid) - 1
    n_valid = rank[..., -1:] + 1
    windows = valid & ((rank < sink) | (rank >= n_valid - local))  # [B, C, n]
    keep = windows[:, None]
    if heavy > 0 and scores is not None:
        middle = prefill_middle_windows(valid, sink, local)
        chosen = select_heavy(scores, middle[:, None], heavy)  # [B, H, C, heavy]
        keep = keep | keep_mask(chosen, valid.shape[-1])
    short = (n_valid <= sink + local + heavy)[:, None]  # [B, 1, C, 1]
    return torch.where(short, valid[:, None], keep)


def sparse_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float, policy: SelectionPolicy,
                             sink: int, local: int, heavy: int) -> torch.Tensor:
    """Prefill attention of every query row over its own critical tokens.

    Args:
        query: ``[B, Hq, T, d]``; key, value: ``[B, Hkv, n, d]`` (the whole cache after update).
        attention_mask: what transformers hands the attention function (bool / additive
            ``[B, 1, T, n]``, or None = causal).
        policy: the layer's selection policy, already holding the keys' metadata.

    Returns:
        ``[B, T, Hq, d]`` (transformers' layout).
    """
    batch, q_heads, steps, dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    sel_heads = policy.sel_heads
    per_kv = q_heads // kv_heads
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * sel_heads * n))
    outs = []
    for start in range(0, steps, chunk):
        stop = min(steps, start + chunk)
        rows = stop - start
        valid = _row_validity(attention_mask, batch, n, steps, start, stop, query.device)  # [B, C, n]
        scores = policy.prefill_scores(policy.score_query(query[:, :, start:stop])) if heavy > 0 else None
        keep = prefill_critical_mask(scores, valid, sink, local, heavy)  # [B, H_sel or 1, C, n]
        keep = keep | ~valid.any(-1)[:, None, :, None]  # a row with no key (padding): finite, unused output
        # per query head [B, Hq, C, n] -> GQA folded into rows [B, Hkv, g * C, n] (q head = kv * g + j)
        keep = keep[:, :, None].expand(batch, keep.shape[1], q_heads // keep.shape[1], rows, n)
        keep = keep.reshape(batch, kv_heads, per_kv * rows, n)
        q = query[:, :, start:stop].reshape(batch, kv_heads, per_kv * rows, dim)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=keep, scale=scaling)
        outs.append(out.reshape(batch, q_heads, rows, dim))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _row_validity(attention_mask: torch.Tensor | None, batch: int, n: int, steps: int, start: int, stop: int,
                  device: torch.device) -> torch.Tensor:
    """Key validity ``[B, stop - start, n]`` of query rows ``[start, stop)`` of ``steps`` rows."""
    if attention_mask is None:  # causal: query row t sits at column n - steps + t
        rows = torch.arange(n - steps + start, n - steps + stop, device=device)[:, None]
        return (torch.arange(n, device=device)[None, :] <= rows)[None].expand(batch, stop - start, n)
    return valid_columns_from_mask(attention_mask[:, :, start:stop], batch, n, stop - start, device)
