"""Candidate-set refinement (`SharingConfig.candidates`): selections share a candidate set, not their
final columns.

A selecting head scores every column, keeps its top C (> heavy) middle-window columns as candidates
and its top `heavy` of them as its heavy columns. The heads, layers and steps that reuse its selection
(head, layer and query sharing) score only the candidates with their own query
(`SelectionPolicy.candidate_heavy`, from `SelectionPolicy.candidate_scores`) and keep their own top
`heavy` of them: a few C label rows per head instead of every cached column, and a selection fitted to
each reusing query.

With `SharingConfig.successors` the C candidates are the top C columns walked in rank order, each kept
with its successor, until C are kept (`hshare.selection.with_successors`), and a selecting head's heavy
columns are its top `heavy` (the first of that rank order).

With ``SharingConfig.refine_by = "keys"`` a refinement ranks the candidates by their exact logits
(`refine_by_keys`): the labels only choose the C candidates, and every head, the selecting ones included,
keeps its top `heavy` of them by q . k.
"""

from __future__ import annotations

from typing import Callable

import torch

from hshare.kernels import CriticalWindows, candidate_key_topk
from hshare.policy import SelectionPolicy, top_candidates
from hshare.selection import per_head, select_heavy

# (query [B, Hq, d], candidates [B', H', C], window [B', 2] (column bounds), heavy, rows=None, heads=None, out=None,
# critical=None) -> [B', H', heavy] int64 columns, or with `critical` (columns, their critical indices
# [B, H_sel, N_c]): `SelectionPolicy.candidate_heavy`'s contract
Refine = Callable[..., "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def refine_by_keys(keys: torch.Tensor) -> Refine:
    """A refinement by exact logits over one layer's keys ``[B, Hkv, n, d]`` (selection head s = KV head s):
    `SelectionPolicy.candidate_heavy`'s contract, each candidate scored by ``sum_g q_g . k`` over the KV head's
    query group (`kernels.candidate_key_topk`: C key rows read a (row, head))."""

    def refine(query: torch.Tensor, candidates: torch.Tensor, window: torch.Tensor, heavy: int,
               rows: torch.Tensor | None = None, heads: torch.Tensor | None = None, out: torch.Tensor | None = None,
               critical: CriticalWindows | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return candidate_key_topk(query, keys, heavy, candidates, window, rows, heads, out=out, critical=critical)
    return refine


def select_candidates(policy: SelectionPolicy, query: torch.Tensor, selectable: torch.Tensor, window: torch.Tensor,
                      count: int, heavy: int, rows: torch.Tensor | None = None, heads: torch.Tensor | None = None,
                      head_slot: torch.Tensor | None = None, copy_heads: torch.Tensor | None = None,
                      successors: bool = False, out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                      refine: Refine | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A selecting layer's heavy columns and candidates: each source head's top C of its scores of every
    column in the window, and the top `heavy` of those (= the top `heavy` of the window); with head sharing,
    each copying head's own top `heavy` among its source head's candidates.

    Args:
        policy: the layer's selection policy; query: ``[B, Hq, d]`` the decode query of every row.
        selectable: ``[B', n]`` bool, the selectable columns of rows `rows` (None = all); window: ``[B', 2]`` their
            column bounds (`RowWindows.selectable_bounds`), which the refinements take.
        count: C candidates; heavy: the heavy columns kept, <= C.
        heads: ``[P, n_src]`` the source heads (None = every selection head selects, and the rest is None);
        head_slot: ``[P, H_sel]`` each head's slot among them; copy_heads: ``[P, H_sel - n_src]`` the heads
            that copy (P = 1 for a batch plan, else B').
        successors: the C candidates are the top C walked with their successors, and a source head's heavy
            columns its top `heavy` (`with_successors`: the best of the top C, without scoring them again).
        out: buffers ``([B', H_sel, heavy], [B', H_sel, C])`` (a layer's kept ones) that the per-head results of
            head sharing are written into when their shapes match (else new tensors are returned).
        refine: how the heads refine candidates (None: the policy's `SelectionPolicy.candidate_heavy`); given
            (`refine_by_keys`), the source heads' heavy columns are their top `heavy` candidates by it too.

    Returns:
        ``(heavy, candidates)``: ``[B', H, heavy]`` and ``[B', H, C]`` int64 columns (H = n_src without
        `head_slot`, else H_sel; ``NO_TOKEN`` where the window holds fewer). A policy that scores candidates
        alone (`SelectionPolicy.scores_candidates`) selects the C (`SelectionPolicy.decode_heavy`) and every
        head its heavy among its source's C (`SelectionPolicy.candidate_heavy`, one pass over every head: a
        source head's C rows scored again), so no ``[B', H', n]`` score tensor is needed; another selects a
        source head's C and heavy from one score tensor, and its copying heads refine. With successors a source
        head's C are scored once more, to rank and walk them, and its copying heads refine.
    """
    refine_sources = refine is not None
    refine = refine or policy.candidate_heavy
    # with successors and the labels' ranking, the walk writes every head's candidates and heavy columns (each its
    # source's; a copying head's heavy refined below)
    spread = successors and not refine_sources and head_slot is not None
    if successors:  # a source head's heavy columns are its top `heavy`, from the walk's scores
        candidates, chosen = policy.decode_heavy_successors(query, selectable, count, rows, heads, top=heavy,
                                                            head_slot=head_slot if spread else None,
                                                            out=(out[1], out[0]))
    elif policy.scores_candidates:
        candidates = policy.decode_heavy(query, selectable, count, rows, heads)
        if head_slot is not None:
            candidates, heads = per_head(candidates, head_slot), None
        return refine(query, candidates, window, heavy, rows, heads), candidates
    else:
        scores = policy.decode_scores(query, rows, heads)
        candidates = select_heavy(scores, selectable[:, None], count)
        chosen = top_candidates(scores.gather(-1, candidates.clamp(min=0)), candidates, candidates >= 0, heavy)
    if refine_sources:
        chosen = refine(query, candidates, window, heavy, rows, heads)
    if head_slot is None:
        return chosen, candidates
    if not spread:
        candidates, chosen = per_head(candidates, head_slot, out[1]), per_head(chosen, head_slot, out[0])
    # each copying head refines its source head's candidates (now its own entry) into its entry of `chosen`
    return refine(query, candidates, window, heavy, rows=rows, heads=copy_heads, out=chosen), candidates
