"""Candidate-set refinement (`SharingConfig.candidates`): selections share a candidate set, not their
final columns.

A selecting head scores every column, keeps its top C (> heavy) middle-window columns as candidates
and its top `heavy` of them as its heavy columns. The heads, layers and steps that reuse its selection
(head, layer and query sharing) score only the candidates with their own query
(`SelectionPolicy.candidate_scores`) and keep their own top `heavy` of them: a few C label rows per
head instead of every cached column, and a selection fitted to each reusing query.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hshare.selection import NO_TOKEN, select_heavy

if TYPE_CHECKING:
    from hshare.policy import SelectionPolicy


def select_candidates(scores: torch.Tensor, window: torch.Tensor, count: int, heavy: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A selecting head's heavy columns and candidates from its scores of every column.

    Args:
        scores: ``[B', H', n]`` the policy's scores; window: ``[B', n]`` bool, the selectable columns.
        count: C candidates; heavy: the heavy columns kept, <= C.

    Returns:
        ``(heavy [B', H', heavy], candidates [B', H', C])`` int64 columns (``NO_TOKEN`` where the window holds
        fewer); the heavy columns are the top `heavy` of the candidates by the same scores, i.e. the top
        `heavy` of the window.
    """
    candidates = select_heavy(scores, window[:, None], count)
    return _top_of(scores.gather(-1, candidates.clamp(min=0)), candidates, candidates >= 0, heavy), candidates


def refine_candidates(policy: SelectionPolicy, query: torch.Tensor, candidates: torch.Tensor, window: torch.Tensor,
                      heavy: int, rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """The top `heavy` candidates by this query's own scores, among those in the window.

    Args:
        policy: the layer's selection policy; query: ``[B, Hq, d]`` the decode query of every row.
        candidates: ``[B', H', C]`` candidate columns of rows `rows` (None = all) and selection heads `heads`
            (``[B' or 1, H']``; None = all H_sel); ``NO_TOKEN`` allowed.
        window: ``[B', n]`` bool, the columns the heavy tokens may come from (the middle window, or the
            selectable window at a selection step).

    Returns:
        ``[B', H', heavy]`` int64 columns (``NO_TOKEN`` where fewer candidates are in the window).
    """
    scores = policy.candidate_scores(query, candidates, rows, heads)
    safe = candidates.clamp(min=0)
    inside = (candidates >= 0) & window[:, None].expand(-1, candidates.shape[1], -1).gather(-1, safe)
    return _top_of(scores, candidates, inside, heavy)


def _top_of(scores: torch.Tensor, candidates: torch.Tensor, allowed: torch.Tensor, heavy: int) -> torch.Tensor:
    """The `heavy` best-scored allowed candidates: ``[..., heavy]`` columns (``NO_TOKEN`` where too few)."""
    position = select_heavy(scores, allowed, heavy)
    return torch.where(position >= 0, candidates.gather(-1, position.clamp(min=0)), torch.full_like(position, NO_TOKEN))
