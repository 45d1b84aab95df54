"""Successors of a selection (`SharingConfig.successors`): a selection's top columns walked in rank order, each
taken with the column after it, until the selection's width is taken.

`with_successors` dispatches (`dispatch.use_triton`): CUDA tensors go to one Triton launch
(`successors_triton`), everything else to the twin `with_successors_torch` (the CPU path and the test
oracle).
"""

from __future__ import annotations

import torch

from .critical_indices import NO_TOKEN
from .dispatch import use_triton


def with_successors(columns: torch.Tensor, scores: torch.Tensor, window: torch.Tensor, top: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns walked with their successors, and the best `top` of them (contract: `with_successors_torch`);
    Triton for CUDA tensors."""
    if use_triton(columns):
        from .successors_triton import with_successors_triton

        return with_successors_triton(columns, scores, window, top)
    return with_successors_torch(columns, scores, window, top)


def with_successors_torch(columns: torch.Tensor, scores: torch.Tensor, window: torch.Tensor, top: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection's top columns walked in rank order, each taken with its successor, until k are taken.

    The walk: in rank order (score descending, then the smaller column first; ``NO_TOKEN`` entries never
    taken), take the column unless it is taken (the successor, in the window, of a column ranked before it),
    then its successor (column + 1) where it lies in the window and is not taken (a column ranked before it);
    stop when k slots are taken. The k columns given always fill the k slots (each adds itself or was taken as
    a successor), so the walk never looks past them; without adjacent columns it takes the top ceil(k / 2)
    and their successors.

    Args:
        columns: ``[B', H, k]`` int64, distinct per (row, head), ``NO_TOKEN`` allowed; the columns in the
            window a selection ranks highest, in any order.
        scores: ``[B', H, k]`` their scores (any float dtype; compared as float32, -0.0 as +0.0).
        window: ``[B', n]`` bool, the selectable columns of each row.
        top: how many of the given columns to return by rank (a selection's own top columns, as many as it
            wants, without ranking them again).

    Returns:
        ``(taken, best)``: ``[B', H, k]`` int64, the columns taken, ascending (``NO_TOKEN`` in the slots left
        when fewer than k columns were given), and ``[B', H, top]`` int64, the first `top` given columns in
        rank order, ascending (``NO_TOKEN`` after them). Sets, in column order: no consumer needs the walk's
        order, and the kernel then needs no sort of ranks.
    """
    rows, heads, k = columns.shape
    n = window.shape[-1]
    valid = columns >= 0
    score = torch.where(valid, scores.float() + 0.0, torch.zeros((), device=columns.device))
    # rank order by three stable sorts: column ascending, then score descending, then valid first
    order = columns.argsort(dim=-1, stable=True)
    order = order.gather(-1, score.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
    order = order.gather(-1, (~valid).gather(-1, order).to(torch.uint8).argsort(dim=-1, stable=True))
    ranked = columns.gather(-1, order)  # [B', H, k] rank order
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(k, device=columns.device).expand_as(order))
    # neighbours in column order: whether column - 1 and column + 1 are given and ranked before
    by_column = columns.argsort(-1)
    ordered, ordered_rank = columns.gather(-1, by_column), rank.gather(-1, by_column)
    pad = torch.full_like(ordered[..., :1], NO_TOKEN - 1)
    before = torch.cat((pad, ordered[..., :-1]), -1)
    after = torch.cat((ordered[..., 1:], pad), -1)
    rank_pad = torch.full_like(pad, k)
    before_rank = torch.cat((rank_pad, ordered_rank[..., :-1]), -1)
    after_rank = torch.cat((ordered_rank[..., 1:], rank_pad), -1)
    ok = ordered >= 0
    rows_window = window[:, None].expand(-1, heads, -1)
    # taken already: the successor of the column before it, ranked before it, where it lies in the window
    in_window = rows_window.gather(-1, ordered.clamp(min=0))
    own = ok & ~((before == ordered - 1) & (before_rank < ordered_rank) & in_window)
    successor = ordered + 1
    inside = rows_window.gather(-1, successor.clamp(max=n - 1))
    follows = ok & (successor < n) & inside & ~((after == successor) & (after_rank < ordered_rank))
    # back to rank order: slots taken before each ranked column, then its own slot and its successor's
    inverse = by_column.argsort(-1).gather(-1, order)
    own, follows = own.gather(-1, inverse), follows.gather(-1, inverse)
    cost = own.long() + follows.long()
    start = cost.cumsum(-1) - cost
    out = torch.full((rows, heads, k + 1), NO_TOKEN, dtype=columns.dtype, device=columns.device)
    own_slot = torch.where(own & (start < k), start, k)
    out.scatter_(-1, own_slot, ranked)
    follow_slot = start + own.long()
    out.scatter_(-1, torch.where(follows & (follow_slot < k), follow_slot, k), ranked + 1)
    best = torch.full((rows, heads, top), NO_TOKEN, dtype=columns.dtype, device=columns.device)
    best[..., : min(top, k)] = ranked[..., :top]
    return _ascending(out[..., :k]), _ascending(best)


def _ascending(columns: torch.Tensor) -> torch.Tensor:
    """Each row of columns ascending, ``NO_TOKEN`` entries after them."""
    last = torch.iinfo(columns.dtype).max
    ordered = torch.where(columns >= 0, columns, last).sort(-1).values
    return torch.where(ordered == last, NO_TOKEN, ordered)
