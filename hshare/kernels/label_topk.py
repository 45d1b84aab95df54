"""Fused label scoring and heavy top-k of a selection step (HShare section 4.2; DoubleSparse).

A selection step scores every cached token of a (row, source head) on its label (``q_lab . k_lab``,
`labels.score_heads`) and keeps the `heavy` best-scored columns of the row's selectable window
(`heavy_topk.select_heavy`). Here both are one operation, so that at long context the
``[A, H', n]`` fp32 scores need not be written and read back: a selection costs the bytes of the
labels it scores.

Contract (`label_topk`, `decode_label_topk` and their twins):

* inputs: the query labels ``[A, H', r]`` (`label_topk`), or the decode query ``[B, Hq, d]`` and the
  heavy channels ``[P, H_sel, r]`` whose labels are gathered as `labels.query_labels` does
  (`decode_label_topk`); the whole label cache ``codes [B, H_sel, n, r * bits / 8 (or r)]`` (contiguous per
  column; 16-bit codes may instead be channel-major, ``stride(-2) == 1``, which the kernels read coalesced),
  ``scale / zero [B, H_sel, n]`` (None at 16 bits) and `bits`; `rows` ``[A]`` batch rows (None = all,
  A = B) and `heads` ``[A or 1, H']`` selection heads per row (None = all, H' = H_sel);
* the selectable window of output row a: the columns ``window[a, 0] <= column < window[a, 1]``
  (``[A, 2]`` integer bounds; None = all n columns) that `selectable` ``[A, n]`` (bool; None = all)
  marks; rows with a short window hold fewer tokens;
* the result: ``[A, H', heavy]`` int64, the columns of the ``min(heavy, |window|)`` best scores in
  ascending order, then ``NO_TOKEN``. A column whose score is not finite is never chosen (the others
  fill its place). Among equal scores at the heavy-th the smaller columns are chosen (-0.0 equals
  +0.0), so the set is a function of the scores; implementations agree up to the rounding of the
  scores themselves.

`label_topk` / `decode_label_topk` dispatch (`dispatch.use_triton`): CUDA tensors to the Triton
kernels (`label_topk_triton`: one launch when a row fits one chunk, else two, no ``[A, H', n]``
tensor), everything else (the CPU path, the test oracle, fp64) to the twins `label_topk_torch` /
`decode_label_topk_torch`, which score every column (`labels.score_heads_torch`) and select with
`select_heavy_columns_torch`.

`candidate_label_topk` (candidate-set refinement) is the same selection over a given list of candidate
columns per (row, head) instead of every column: its "window" is the candidates inside their row's column bounds
(`critical_indices.in_window`: candidates are valid columns, which lie in a window where they lie in its bounds),
its columns come in candidate order (ascending when the candidates are), ties go to the earlier candidate.
CUDA: `label_topk_triton.candidate_label_topk_triton`, a program per (row, head) holding its candidates' keys
(one launch; at few row-heads two, the scoring spread over the SMs first); the twin `candidate_label_topk_torch`
scores the candidates (`labels.candidate_label_scores`).

`candidate_label_walk` (`SharingConfig.successors`) scores a selection's top columns the same way and walks
them in rank order with their successors (`successors.with_successors`). CUDA:
`label_topk_triton.candidate_label_walk_triton` (launched as the top-k); the twin `candidate_label_walk_torch`.
`decode_label_topk_walk` is a selecting head's whole selection with successors: `decode_label_topk` of C columns,
then their walk, the columns scored once (CUDA: the label top-k writes its columns' keys, which the walk reads
instead of scoring them again; the twin `decode_label_topk_walk_torch`).
"""

from __future__ import annotations

import warnings

import torch

from .critical_indices import NO_TOKEN, CriticalWindows, check_critical_refinement, check_window, in_window, with_critical
from .dispatch import use_triton
from .labels import candidate_label_scores, decode_query_labels, score_heads_torch
from .selection_heads import columns_into, refine_into, walk_into
from .successors import with_successors_torch


def label_topk(query_labels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
               bits: int, heavy: int, window: torch.Tensor | None = None, selectable: torch.Tensor | None = None,
               rows: torch.Tensor | None = None, heads: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Top-`heavy` columns of each (row, head) by label score (module contract).

    Args:
        query_labels: ``[A, H', r]`` one query's heavy channels per (row, source head).
        codes, scale, zero, bits: the whole label cache (`labels.score_heads`).
        heavy: tokens to keep.
        window: ``[A, 2]`` per-row column bounds ``[start, end)``; selectable: ``[A, n]`` bool.
        rows: ``[A]`` batch rows (None = all); heads: ``[A or 1, H']`` selection heads (None = all).
        out: where the columns are written when it fits them (`selection_heads.column_buffer`: a layer's kept
            buffer), else a new tensor.

    Returns:
        ``[A, H', heavy]`` int64 columns, ascending, then ``NO_TOKEN``.
    """
    if _runs_triton(query_labels, codes, bits, heavy, query_labels.shape[-1]):
        from .label_topk_triton import label_topk_triton

        return label_topk_triton(query_labels, codes, scale, zero, bits, heavy, rows, heads, window, selectable,
                                 out=out)
    return columns_into(label_topk_torch(query_labels, codes, scale, zero, bits, heavy, window, selectable, rows,
                                         heads), out)


def decode_label_topk(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                      zero: torch.Tensor | None, bits: int, heavy: int, window: torch.Tensor | None = None,
                      selectable: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                      heads: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`label_topk` of the decode query: the labels are the query's heavy channels (module contract).

    Args:
        query: ``[B, Hq, d]`` the decode query of every row.
        channels: ``[P, H_sel, r]`` heavy channels per selection head (P = 1 or B).
        codes, scale, zero, bits, heavy, window, selectable, rows, heads, out: as `label_topk`; without
            `rows`, A = B.

    Returns:
        ``[A, H', heavy]`` int64 columns, ascending, then ``NO_TOKEN``. CUDA tensors: the kernels gather
        the query labels themselves.
    """
    if _runs_triton(query, codes, bits, heavy, channels.shape[-1]):
        from .label_topk_triton import label_topk_triton

        return label_topk_triton(None, codes, scale, zero, bits, heavy, rows, heads, window, selectable,
                                 query=query, channels=channels, out=out)
    return columns_into(decode_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, window, selectable,
                                                rows, heads), out)


def candidate_label_topk(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                         zero: torch.Tensor | None, bits: int, heavy: int, candidates: torch.Tensor,
                         window: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                         heads: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                         critical: CriticalWindows | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Top-`heavy` of candidate columns by the decode query's label scores (candidate-set refinement).

    Args:
        query, channels, codes, scale, zero, bits, heavy, rows, heads: as `decode_label_topk`.
        candidates: ``[A, H', C]`` candidate columns per (row, head), valid columns (a selection's); a negative entry
            is no candidate.
        window: ``[A, 2]`` integer, the column bounds ``[start, end)`` of the row's window a candidate must lie in
            (`RowWindows.middle_bounds`; None = all).
        out: ``[A, H_sel, heavy]`` int64: then `candidates` are every selection head's ``[A, H_sel, C]``, and
            each of the heads `heads` (required) refines its own and writes its entries of `out` in place.
        critical: the step's windows (`CriticalWindows`) where the refinement covers every row and selection head:
            then the columns' critical indices are returned too, written by the refinement's own launch on CUDA.

    Returns:
        ``[A, H', heavy]`` int64 (or `out`): the columns of the ``min(heavy, allowed)`` best-scored allowed
        candidates (in the window, finite score) in candidate order, then ``NO_TOKEN``; among equal
        scores at the heavy-th the earlier candidates are chosen. Only the candidates' label rows are read (CUDA:
        `label_topk_triton.candidate_label_topk_triton`, up to its ``MAX_CANDIDATES``; wider: the twin, with a
        RuntimeWarning). With `critical`: ``(columns, critical.indices(columns))``.
    """
    if out is not None and heads is None:
        raise ValueError("candidate_label_topk: out= refines some heads in place; accepted: heads [A or 1, H'] given")
    if critical is not None:
        check_critical_refinement(rows, candidates.shape[1] if heads is None else heads.shape[-1], candidates.shape[1])
    if _runs_triton(query, codes, bits, heavy, channels.shape[-1]) and _candidates_fit(candidates.shape[-1], False):
        from .label_topk_triton import candidate_label_topk_triton

        return candidate_label_topk_triton(query, channels, codes, scale, zero, bits, heavy, candidates, rows, heads,
                                           window, out=out, critical=critical)
    if out is not None:
        columns = refine_into(out, candidates, heads, lambda own: candidate_label_topk_torch(
            query, channels, codes, scale, zero, bits, heavy, own, window, rows, heads))
    else:
        columns = candidate_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, candidates, window,
                                             rows, heads)
    return with_critical(columns, critical)


def candidate_label_topk_torch(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                               scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int, heavy: int,
                               candidates: torch.Tensor, window: torch.Tensor | None = None,
                               rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `candidate_label_topk` (same contract): the candidates' scores (`labels.candidate_label_scores`),
    then `select_heavy_columns_torch` over candidate positions."""
    check_window(window, candidates.shape[0])
    scores = candidate_label_scores(query, channels, codes, scale, zero, bits, candidates, rows, heads)
    allowed = in_window(candidates, window)
    position = select_heavy_columns_torch(scores, allowed, heavy)  # ascending positions, then NO_TOKEN
    return torch.where(position >= 0, candidates.gather(-1, position.clamp(min=0)), torch.full_like(position, NO_TOKEN))


def candidate_label_walk(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                         zero: torch.Tensor | None, bits: int, candidates: torch.Tensor, selectable: torch.Tensor,
                         rows: torch.Tensor | None = None, heads: torch.Tensor | None = None, *, top: int = 0,
                         ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection's top columns walked with their successors, and the best `top` of them, by the decode query's
    label scores (`SharingConfig.successors`).

    Args:
        query, channels, codes, scale, zero, bits, rows, heads: as `decode_label_topk`.
        candidates: ``[A, H', C]`` the columns a selection ranks highest per (row, head), in any order; a
            negative entry is none.
        selectable: ``[A, n]`` bool, the window: a candidate outside it (or scored non-finite) takes no part,
            and a successor must lie in it.
        top: how many of the best candidates to return as well (a selecting head's own heavy columns).
        ascending: the caller's promise that each (row, head)'s candidates are ascending, negative entries
            after them (`decode_label_topk`'s output): the kernel then skips sorting them into column order.

    Returns:
        ``(taken, best)``, ``[A, H', C]`` and ``[A, H', top]`` int64, ascending: `successors.with_successors` of
        the allowed candidates and their label scores. Only the candidates' label rows are read (CUDA:
        `label_topk_triton.candidate_label_walk_triton`, up to its ``MAX_WALK_CANDIDATES``; wider: the twin, with a
        RuntimeWarning).
    """
    width = candidates.shape[-1]
    if _runs_triton(query, codes, bits, width, channels.shape[-1]) and _candidates_fit(width, True):
        from .label_topk_triton import candidate_label_walk_triton

        return candidate_label_walk_triton(query, channels, codes, scale, zero, bits, candidates, rows, heads,
                                           selectable, top, ascending=ascending)
    return candidate_label_walk_torch(query, channels, codes, scale, zero, bits, candidates, selectable, rows, heads,
                                      top)


def decode_label_topk_walk(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                           scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int, count: int,
                           selectable: torch.Tensor, rows: torch.Tensor | None = None,
                           heads: torch.Tensor | None = None, *, top: int = 0, head_slot: torch.Tensor | None = None,
                           out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_label_topk` of `count` columns, walked with their successors (`candidate_label_walk`, ascending), by
    label scores computed once: a selecting head's candidates and its best `top` (`SharingConfig.successors`).

    Args:
        query, channels, codes, scale, zero, bits, rows, heads: as `decode_label_topk`.
        count: C, the top columns walked; selectable: ``[A, n]`` bool, the window (the top-k's and the walk's).
        head_slot: ``[P, H_sel]``, with source heads `heads`: each selection head's slot among them (its source's
            position; a source head is its own); then every selection head's results, each its source's
            (`selection_heads.per_head`).
        out: ``(taken, best)`` buffers the results are written into where they have the results' shapes (contiguous
            int64; `selection_heads.walk_into`), else new tensors are returned.

    Returns:
        ``(taken, best)``, ``[A, H', C]`` and ``[A, H', top]`` int64 (H_sel with `head_slot`), as
        `candidate_label_walk` of the top C. CUDA: `label_topk_triton.selection_walk_triton` (the top-k writes its
        columns' keys, the walk reads them: no label row read twice; the walk's programs write every head's entries)
        up to ``MAX_WALK_CANDIDATES``; wider, the twin (with a RuntimeWarning).
    """
    if _runs_triton(query, codes, bits, count, channels.shape[-1]) and _candidates_fit(count, True):
        from .label_topk_triton import selection_walk_triton

        return selection_walk_triton(query, channels, codes, scale, zero, bits, count, rows, heads, selectable, top,
                                     head_slot, out)
    taken, best = decode_label_topk_walk_torch(query, channels, codes, scale, zero, bits, count, selectable, rows,
                                               heads, top)
    return walk_into(taken, best, head_slot, out)


def decode_label_topk_walk_torch(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                                 scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int, count: int,
                                 selectable: torch.Tensor, rows: torch.Tensor | None = None,
                                 heads: torch.Tensor | None = None, top: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `decode_label_topk_walk` (same contract): every column scored (`labels.score_heads_torch`), the
    top C selected (`select_heavy_columns_torch`), their scores walked (`successors.with_successors_torch`)."""
    labels = decode_query_labels(query, channels, rows, heads)  # [A, H', r]
    scores = score_heads_torch(labels, codes, scale, zero, bits, rows, heads)  # [A, H', n]
    columns = select_heavy_columns_torch(scores, window_columns(None, selectable, scores.shape[0], scores.shape[-1],
                                                                scores.device), count)
    return with_successors_torch(columns, scores.gather(-1, columns.clamp(min=0)), selectable, top)


def candidate_label_walk_torch(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                               scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int,
                               candidates: torch.Tensor, selectable: torch.Tensor, rows: torch.Tensor | None = None,
                               heads: torch.Tensor | None = None, top: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `candidate_label_walk` (same contract): the candidates' scores (`labels.candidate_label_scores`),
    then `successors.with_successors_torch` of the allowed ones."""
    scores = candidate_label_scores(query, channels, codes, scale, zero, bits, candidates, rows, heads)
    allowed = _in_mask(candidates, selectable) & torch.isfinite(scores)
    return with_successors_torch(torch.where(allowed, candidates, torch.full_like(candidates, NO_TOKEN)), scores,
                                 selectable, top)


def label_topk_torch(query_labels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                     zero: torch.Tensor | None, bits: int, heavy: int, window: torch.Tensor | None = None,
                     selectable: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `label_topk` (same contract): every column scored (`labels.score_heads_torch`), then
    `select_heavy_columns_torch`."""
    scores = score_heads_torch(query_labels, codes, scale, zero, bits, rows, heads)  # [A, H', n]
    return select_heavy_columns_torch(scores, window_columns(window, selectable, scores.shape[0], scores.shape[-1],
                                                             scores.device), heavy)


def decode_label_topk_torch(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                            scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int, heavy: int,
                            window: torch.Tensor | None = None, selectable: torch.Tensor | None = None,
                            rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `decode_label_topk` (same contract): `labels.decode_query_labels`, then `label_topk_torch`."""
    labels = decode_query_labels(query, channels, rows, heads)  # [A, H', r]
    return label_topk_torch(labels, codes, scale, zero, bits, heavy, window, selectable, rows, heads)


def window_columns(window: torch.Tensor | None, selectable: torch.Tensor | None, rows: int, n: int,
                   device: torch.device) -> torch.Tensor:
    """The selectable columns ``[A, n]`` bool of per-row bounds ``[A, 2]`` and a mask ``[A, n]`` (None = all)."""
    ok = torch.ones(rows, n, dtype=torch.bool, device=device)
    if window is not None:
        columns = torch.arange(n, device=device)
        ok &= (columns >= window[:, :1]) & (columns < window[:, 1:])
    if selectable is not None:
        ok &= selectable.bool()
    return ok


def score_keys_torch(scores: torch.Tensor) -> torch.Tensor:
    """Order-preserving int32 keys of fp32 scores (any shape), -0.0 as +0.0: the twin of
    `key_search_triton._score_key`."""
    bits = scores.float().view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return torch.where(bits == -(1 << 31), torch.zeros_like(key), key)


def select_heavy_columns_torch(scores: torch.Tensor, selectable: torch.Tensor, heavy: int) -> torch.Tensor:
    """The selection rule of the module contract on computed scores.

    Args:
        scores: ``[A, H', n]`` approximate logits (fp32 or fp64).
        selectable: ``[A, n]`` bool, the selectable window of each row (or ``[A, H', n]``: of each row and head).
        heavy: tokens to keep.

    Returns:
        ``[A, H', heavy]`` int64 columns, ascending, then ``NO_TOKEN``: the best finite scores, ties
        at the heavy-th broken toward smaller columns.
    """
    n = scores.shape[-1]
    take = min(heavy, n)
    ok = (selectable[:, None] if selectable.dim() == 2 else selectable) & torch.isfinite(scores)
    if take == 0:
        chosen = torch.zeros(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
        found = torch.zeros_like(chosen, dtype=torch.bool)
    elif scores.dtype == torch.float64:  # no int64 key of an fp64 score leaves room for the column: a stable sort
        masked = scores.masked_fill(~ok, float("-inf")) + 0.0  # + 0.0: -0.0 as +0.0
        chosen = masked.sort(dim=-1, descending=True, stable=True).indices[..., :take]
        found = ok.gather(-1, chosen)
    else:  # one int64 per column: its score's order-preserving key, then the column (smaller first)
        key = score_keys_torch(scores)
        columns = torch.arange(n, device=scores.device)
        packed = (key.long() << 32) | (0xFFFFFFFF - columns)
        packed = packed.masked_fill(~ok, torch.iinfo(torch.int64).min)
        best = packed.topk(take, dim=-1, sorted=False).values
        chosen = 0xFFFFFFFF - (best & 0xFFFFFFFF)
        found = best != torch.iinfo(torch.int64).min
    chosen = torch.where(found, chosen, torch.full_like(chosen, n)).sort(dim=-1).values  # ascending, misses last
    chosen = torch.where(chosen < n, chosen, torch.full_like(chosen, NO_TOKEN))
    if take < heavy:
        pad = torch.full((*chosen.shape[:-1], heavy - take), NO_TOKEN, dtype=torch.long, device=chosen.device)
        chosen = torch.cat((chosen, pad), dim=-1)
    return chosen


def _runs_triton(tensor: torch.Tensor, codes: torch.Tensor, bits: int, heavy: int, channels: int) -> bool:
    """Whether the Triton kernels take this call: their dtypes (no fp64), 4/8/16-bit labels with an even
    channel count at 4 bits, codes contiguous per token (16-bit: or per channel), a nonempty cache and heavy
    budget."""
    laid_out = codes.stride(-1) == 1 or (bits == 16 and codes.stride(-2) == 1)
    return (use_triton(tensor) and tensor.dtype != torch.float64 and bits in (4, 8, 16) and heavy > 0
            and codes.shape[2] > 0 and laid_out and (bits != 4 or channels % 2 == 0))


def _in_mask(candidates: torch.Tensor, selectable: torch.Tensor) -> torch.Tensor:
    """``[A, H', C]`` bool: the candidates that are columns (not negative) of the mask ``[A, n]`` (a walk's window:
    its successors are tested on it too)."""
    inside = selectable[:, None].expand(-1, candidates.shape[1], -1).gather(-1, candidates.clamp(min=0))
    return (candidates >= 0) & inside.bool()


def _candidates_fit(width: int, walk: bool) -> bool:
    """Whether `width` candidates per (row, head) fit the Triton candidate kernels' register tile
    (``MAX_CANDIDATES``; the walk's, ``MAX_WALK_CANDIDATES``); a wider set goes to the torch twin, slower, and
    says so (a RuntimeWarning)."""
    from . import label_topk_triton

    limit = label_topk_triton.MAX_WALK_CANDIDATES if walk else label_topk_triton.MAX_CANDIDATES
    if width <= limit:
        return True
    what = "walk" if walk else "top-k"
    warnings.warn(f"{width} candidates per (row, head) exceed the {limit} the Triton candidate {what} holds: the "
                  f"torch twin scores them, slower (accepted on the kernels: sharing.candidates x heavy <= {limit})",
                  RuntimeWarning, stacklevel=3)
    return False
