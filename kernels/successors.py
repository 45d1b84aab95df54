"""Successors of a selection (`SharingConfig.successors`): the kept columns, then the column after each of
the smallest of them, where it is selectable and not already kept.

`with_successors` dispatches (`dispatch.use_triton`): CUDA tensors go to one Triton launch
(`successors_triton`), everything else to the twin `with_successors_torch` (the CPU path and the test
oracle).
"""

from __future__ import annotations

import torch

from .critical_indices import NO_TOKEN
from .dispatch import use_triton


def with_successors(columns: torch.Tensor, window: torch.Tensor, width: int) -> torch.Tensor:
    """The columns and their successors (contract: `with_successors_torch`); Triton for CUDA tensors."""
    if use_triton(columns):
        from .successors_triton import with_successors_triton

        return with_successors_triton(columns, window, width)
    return with_successors_torch(columns, window, width)


def with_successors_torch(columns: torch.Tensor, window: torch.Tensor, width: int) -> torch.Tensor:
    """The columns and their successors.

    Args:
        columns: ``[B', H, k]`` int64, distinct per (row, head), ``NO_TOKEN`` allowed.
        window: ``[B', n]`` bool, the selectable columns of each row.
        width: k <= width <= 2k.

    Returns:
        ``[B', H, width]`` int64: the columns as given, then the successor (column + 1) of each of the
        `width` - k smallest entries (``NO_TOKEN`` entries first), where it lies in the window and is not
        among the columns; ``NO_TOKEN`` otherwise.
    """
    ordered = columns.sort(-1).values  # NO_TOKEN first; a column's successor is a column iff the next one is it
    successor = ordered + 1
    taken = torch.cat((ordered[..., 1:] == successor[..., :-1], torch.zeros_like(ordered[..., :1], dtype=torch.bool)),
                      -1)
    n = window.shape[-1]
    inside = window[:, None].expand(-1, columns.shape[1], -1).gather(-1, successor.clamp(max=n - 1))
    keep = (ordered >= 0) & (successor < n) & inside & ~taken
    successors = torch.where(keep, successor, torch.full_like(successor, NO_TOKEN))
    return torch.cat((columns, successors[..., :width - columns.shape[-1]]), -1)
