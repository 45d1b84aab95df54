"""Quest's page scores (Tang et al., ICML 2024): an upper bound of ``q . k`` over each page of keys.

For a query q and a page whose keys have channel-wise minimum ``low`` and maximum ``high``, the bound
is ``sum_c max(q_c low_c, q_c high_c) = q+ . high + q- . low`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``);
a selection head sums it over the query heads it stands for (their ``q+`` and ``q-`` summed first).

`page_scores` dispatches (`dispatch.use_triton`): a decode query (one query row) of CUDA tensors to one
Triton launch (`page_scores_triton`: the bounds read once in their dtype, products summed in fp32, only
the ``[B', H', P]`` scores written), everything else (the CPU path, prefill's rows, fp64, the test oracle)
to the twin `page_scores_torch`.
"""

from __future__ import annotations

import torch

from .dispatch import use_triton
from .selection_heads import kv_heads_read, pick_heads


def page_scores(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor, sel_heads: int,
                rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's bound of ``q . k`` per page and selection head.

    Args:
        query: ``[B, Hq, Q, d]`` queries.
        low, high: ``[B, Hkv, P, d]`` the pages' channel-wise key minimum and maximum (any strides with a
            unit stride on d); a page without keys holds ``low = +big, high = -big`` (its bound is
            ``<= 0`` or ``-inf``, never NaN).
        sel_heads: H_sel; selection head s reads KV head ``s * Hkv // H_sel`` and sums the query heads
            ``[s * Hq // H_sel, (s + 1) * Hq // H_sel)``.
        rows: ``[B']`` rows to score (None = all); heads: ``[B' or 1, H']`` selection heads per row
            (None = all H_sel).

    Returns:
        ``[B', H', Q, P]`` fp32 (fp64 for fp64 queries).
    """
    if use_triton(query) and query.shape[2] == 1 and query.dtype != torch.float64:
        from .page_scores_triton import page_scores_triton

        count = query.shape[0] if rows is None else rows.shape[0]
        rows = torch.arange(count, device=query.device) if rows is None else rows
        heads = torch.arange(sel_heads, device=query.device)[None] if heads is None else heads
        return page_scores_triton(query[:, :, 0], low, high, sel_heads, rows, heads)[:, :, None]
    return page_scores_torch(query, low, high, sel_heads, rows, heads)


def page_scores_torch(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor, sel_heads: int,
                      rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `page_scores` (same contract): two batched products in fp32 (fp64 for fp64 queries)."""
    batch, q_heads, steps, dim = query.shape
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    grouped = query.reshape(batch, sel_heads, q_heads // sel_heads, steps, dim).to(acc)
    positive, negative = (pick_heads(part.sum(2), rows, heads) for part in (grouped.clamp(min=0), grouped.clamp(max=0)))
    low, high = (kv_heads_read(bounds, sel_heads, rows, heads) for bounds in (low, high))  # [B', H', P, d]
    return positive @ high.to(acc).transpose(-1, -2) + negative @ low.to(acc).transpose(-1, -2)
