"""Heavy-token top-k of a selection step (HShare section 4.2; DoubleSparse): the `heavy` best-scored
columns of each score row's selectable window.

`select_heavy` dispatches (`dispatch.use_triton`): CUDA score rows of a decode step (``[A, H, n]``,
one selectable window per ``A`` row, ``n`` up to `heavy_topk_triton.MAX_COLUMNS`) go to one Triton
launch (`heavy_topk_triton`), everything else (the CPU path, the test oracle, prefill's 4-D evidence
and longer rows) to the twin `select_heavy_torch`, ``torch.topk``.

The chosen *set* is the contract, ties at the k-th score going to the earliest columns (both the kernel and
the twin), so that a step's choice does not depend on how many columns it scores (a static-shape step scores
its reserved columns too); the order of the columns is not: the twin returns them by score, the kernel
ascending.
"""

from __future__ import annotations

import torch

from .critical_indices import NO_TOKEN
from .dispatch import use_triton


def select_heavy(scores: torch.Tensor, selectable: torch.Tensor, heavy: int) -> torch.Tensor:
    """Top-`heavy` columns of the selectable window by approximate score.

    Args:
        scores: ``[B, H, ..., n]`` approximate logits.
        selectable: bool, broadcastable to `scores` (``[B, 1, ..., n]``): the columns a selection
            may pick (the middle window).
        heavy: tokens to keep.

    Returns:
        ``[B, H, ..., heavy]`` int64 columns, ``NO_TOKEN`` where the window holds fewer tokens
        (a column with a non-finite score is never chosen: the others fill its place); among equal scores at
        the heavy-th, the earliest columns.
    """
    if use_triton(scores):
        from .heavy_topk_triton import MAX_COLUMNS, select_heavy_triton

        if (scores.dim() == 3 and selectable.dim() == 3 and selectable.shape[1] == 1 and heavy > 0
                and scores.shape[-1] <= MAX_COLUMNS and scores.dtype == torch.float32):
            return select_heavy_triton(scores, selectable[:, 0].expand(scores.shape[0], -1), heavy)
    return select_heavy_torch(scores, selectable, heavy)


def select_heavy_torch(scores: torch.Tensor, selectable: torch.Tensor, heavy: int) -> torch.Tensor:
    """The twin of `select_heavy` (same contract), by a stable sort (``torch.topk`` breaks ties either way)."""
    n = scores.shape[-1]
    masked = scores.masked_fill(~(selectable & torch.isfinite(scores)), float("-inf"))
    take = min(heavy, n)
    columns = masked.sort(dim=-1, descending=True, stable=True).indices[..., :take]  # equal scores: column order
    values = masked.gather(-1, columns)
    columns = torch.where(torch.isfinite(values), columns, torch.full_like(columns, NO_TOKEN))
    if take < heavy:
        pad = torch.full((*columns.shape[:-1], heavy - take), NO_TOKEN, dtype=columns.dtype, device=columns.device)
        columns = torch.cat((columns, pad), dim=-1)
    return columns
