"""Critical-token indices of one sparse decode step (HShare section 4.2): sink + heavy + local.

Per row and selection head: the row's sink columns, the heavy columns chosen at the last selection
step that are still in the row's middle window (a sliding window or the local window may have moved
past them within a query group: never attend outside the valid keys, never twice), and the row's
local columns; a row with no more valid tokens than N_c gets all its valid columns. ``-1`` marks
"no token".

A window is given by its column bounds ``[B, 2]`` (``[start, end)``: its first column and the column after its
last), not a ``[B, n]`` mask: heavy columns and candidates are valid columns (a selection picked them from the
row's window), and a valid column's rank grows with its column, so it lies in the window exactly where it lies in
the bounds (`in_window`); a test of two scalars a row instead of a gather a column.

`critical_indices` dispatches (`dispatch.use_triton`): CUDA tensors go to one Triton launch
(`critical_indices_triton`), everything else to the twin `critical_indices_torch` (the CPU path
and the test oracle).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import use_triton

NO_TOKEN = -1


def in_window(columns: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
    """``[A, H, k]`` bool: which `columns` ``[A, H, k]`` (negative: none) lie in their row's window ``[A, 2]``
    (column bounds ``[start, end)``; None = every column). For valid columns (a selection's) it is whether they
    lie in the window's mask."""
    inside = columns >= 0
    if window is None:
        return inside
    return inside & (columns >= window[:, None, :1]) & (columns < window[:, None, 1:])


def check_window(window: torch.Tensor | None, rows: int) -> None:
    """Check a window's bounds: ``[rows, 2]`` integer (None: every column)."""
    if window is not None and (window.shape != (rows, 2) or window.dtype.is_floating_point
                               or window.dtype == torch.bool):
        raise ValueError(f"window {tuple(window.shape)} {window.dtype}; accepted: integer column bounds "
                         f"[{rows}, 2] ([start, end) a row, `RowWindows.middle_bounds`), not a mask")


class CriticalWindows(NamedTuple):
    """What a step's critical indices are made of besides a layer's heavy columns (`critical_indices`' arguments):
    sink ``[B, sink]``, local ``[B, local]``, dense ``[B, N_c]`` columns, the middle windows' bounds ``[B, 2]``
    (int64 ``[start, end)``) and short rows ``[B]`` (bool), and an optional ``[1]`` int64 work counter. A refinement
    given them writes the critical indices of its heavy columns in its own launch (`label_topk.candidate_label_topk`'s
    `critical`)."""

    sink: torch.Tensor
    local: torch.Tensor
    dense: torch.Tensor
    middle: torch.Tensor
    short: torch.Tensor
    count: torch.Tensor | None = None

    def indices(self, heavy: torch.Tensor) -> torch.Tensor:
        """The critical indices ``[B, H, N_c]`` of heavy columns ``[B, H, heavy]`` (`critical_indices`)."""
        return critical_indices(heavy, *self)


def check_critical_refinement(rows: torch.Tensor | None, heads: int, every_head: int) -> None:
    """Check that a refinement asked for its critical indices (`critical`) refines every row and every selection
    head (`heads` of `every_head`): a critical row is of a batch row, whole."""
    if rows is not None or heads != every_head:
        raise ValueError(f"critical indices from a refinement of {'some' if rows is not None else 'all'} rows and "
                         f"{heads} of {every_head} selection heads; accepted: every row and every selection head "
                         "(rows=None; heads=None or all of them)")


def with_critical(columns: torch.Tensor, critical: CriticalWindows | None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A refinement's result where its critical indices are made apart (the twins, a policy's default): the
    columns, or ``(columns, critical.indices(columns))``."""
    return columns if critical is None else (columns, critical.indices(columns))


def critical_indices(heavy: torch.Tensor, sink: torch.Tensor, local: torch.Tensor, dense: torch.Tensor,
                     middle: torch.Tensor, short: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """Critical indices (contract: `critical_indices_torch`); Triton for CUDA tensors."""
    check_window(middle, heavy.shape[0])
    if use_triton(heavy):
        from .critical_indices_triton import critical_indices_triton

        return critical_indices_triton(heavy, sink, local, dense, middle, short, count)
    return critical_indices_torch(heavy, sink, local, dense, middle, short, count)


def critical_indices_torch(heavy: torch.Tensor, sink: torch.Tensor, local: torch.Tensor, dense: torch.Tensor,
                           middle: torch.Tensor, short: torch.Tensor, count: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """Union of sink, still-middle heavy and local columns per selection head.

    Args:
        heavy: ``[B, H, heavy]`` columns chosen at the last selection step (``-1`` allowed).
        sink, local: ``[B, sink]``, ``[B, local]`` the rows' sink and local columns this step.
        dense: ``[B, N_c]`` the first N_c valid columns (all of a short row's tokens).
        middle: ``[B, 2]`` int64, the bounds ``[start, end)`` of the rows' middle windows this step (`in_window`).
        short: ``[B]`` bool, rows with no more valid tokens than N_c.
        count: optional ``[1]`` int64 device tensor: the valid (not ``-1``) indices are added to it
            (the work counters' K/V rows read, without a reduction kernel of their own).

    Returns:
        ``[B, H, N_c]`` int64 columns.
    """
    batch, heads, _ = heavy.shape
    heavy = torch.where(in_window(heavy, middle), heavy, torch.full_like(heavy, NO_TOKEN))
    sparse = torch.cat((sink[:, None].expand(batch, heads, -1), heavy, local[:, None].expand(batch, heads, -1)),
                       dim=-1)
    out = torch.where(short[:, None, None], dense[:, None].expand(batch, heads, -1), sparse)
    if count is not None:
        count.add_((out >= 0).sum())
    return out
