"""Candidate-set refinement (`SharingConfig.candidates`): selections share a candidate set, not their
final columns.

A selecting head scores every column, keeps its top C (> heavy) middle-window columns as candidates
and its top `heavy` of them as its heavy columns. The heads, layers and steps that reuse its selection
(head, layer and query sharing) score only the candidates with their own query
(`SelectionPolicy.candidate_heavy`, from `SelectionPolicy.candidate_scores`) and keep their own top
`heavy` of them: a few C label rows per head instead of every cached column, and a selection fitted to
each reusing query.
"""

from __future__ import annotations

import torch

from hshare.policy import SelectionPolicy, top_candidates
from hshare.selection import select_heavy


def select_candidates(policy: SelectionPolicy, query: torch.Tensor, window: torch.Tensor, count: int, heavy: int,
                      rows: torch.Tensor | None = None, heads: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A selecting head's heavy columns and candidates: the top C of its scores of every column in the window,
    and the top `heavy` of those (= the top `heavy` of the window).

    Args:
        policy: the layer's selection policy; query: ``[B, Hq, d]`` the decode query of every row.
        window: ``[B', n]`` bool, the selectable columns of rows `rows` (None = all).
        count: C candidates; heavy: the heavy columns kept, <= C.
        heads: ``[B' or 1, H']`` selection heads (None = all H_sel).

    Returns:
        ``(heavy [B', H', heavy], candidates [B', H', C])`` int64 columns (``NO_TOKEN`` where the window holds
        fewer). A policy that scores candidates alone (`SelectionPolicy.scores_candidates`) selects the C
        (`SelectionPolicy.decode_heavy`) and then its heavy among them (`SelectionPolicy.candidate_heavy`:
        C rows scored again), so no ``[B', H', n]`` score tensor is needed; another selects both from one
        score tensor.
    """
    if policy.scores_candidates:
        candidates = policy.decode_heavy(query, window, count, rows, heads)
        return policy.candidate_heavy(query, candidates, window, heavy, rows, heads), candidates
    scores = policy.decode_scores(query, rows, heads)
    candidates = select_heavy(scores, window[:, None], count)
    return top_candidates(scores.gather(-1, candidates.clamp(min=0)), candidates, candidates >= 0, heavy), candidates
