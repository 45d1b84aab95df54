"""Triton successors: one launch per selecting layer, without sorting ranks.

Twin of `successors.with_successors_torch`. Program (row, head) holds its k columns and scores in registers
(`_walk`, also the end of `label_topk_triton`'s fused candidate walk) in column order (given so, or sorted
into it first: one sort of (column, score key) packed in int64). The walk needs no rank order:

1. whether a column was taken as its predecessor's successor, and whether its successor is free, compare it
   with the entries beside it (in column order, column - 1 and column + 1 are there if given): a neighbour is
   ranked before it where its score key is higher, or equal with the smaller column;
2. each column then costs 0, 1 or 2 slots, whatever the walk takes before it. The walk stops at the score
   key t where the columns ranked at or above it first cost k slots: the search of
   `key_search_triton._exact_threshold` with each key weighed by its cost (a few block reductions; the tail
   pivots, since the walk's keys are a selection's top columns; the best `top`'s search in the same loop,
   `key_search_triton._exact_threshold_pair`). Columns above t take their slots, the columns
   at t take what is left in column order (their rank order), the last of them perhaps its own slot only;
3. the slots are a cumulative sum in column order, so the taken columns come out ascending.

The best `top` given columns: the same search counting columns, ties in column order, written ascending.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .key_search_triton import (_exact_threshold, _exact_threshold_pair, _first_value, _key_stats, _score_key,
                                _write_columns)
from .dependent_launch import pdl_options, wait_for_previous_kernel

COLUMN_BITS = 24  # columns < 2**24 in the packed sort key


@triton.jit
def _walk(out, best_out, columns, key, given, window_row, n, K, TOP, K_P: tl.constexpr, ASCENDING: tl.constexpr):
    """Write the walk of one (row, head) at ``out[0:K)`` and its best `TOP` given columns at ``best_out[0:TOP)``,
    each ascending, then NO_TOKEN: columns ``[K_P]`` int64 with their order-preserving int32 score keys, `given`
    where an entry takes part; `window_row` the row's selectable columns (nonzero). ASCENDING: the columns are
    ascending and distinct, negative entries (never given) only after them; otherwise any order."""
    i = tl.arange(0, K_P)
    if not ASCENDING:  # column order first, not-given entries last
        packed = tl.sort((tl.where(given, columns, (1 << 24) - 1) << 32) | (key.to(tl.int64) & 0xFFFFFFFF))
        columns = packed >> 32
        key = packed.to(tl.int32)  # the low 32 bits
        given = columns < (1 << 24) - 1
    key = tl.where(given, key, -2147483648).to(tl.int32)
    flag = given.to(tl.int32)
    before = tl.maximum(i - 1, 0)
    after = tl.minimum(i + 1, K_P - 1)
    # 1. taken already where it is the successor, in the window, of the column before it ranked before it
    earlier = (given & (i > 0) & (tl.gather(flag, before, 0) != 0) & (tl.gather(columns, before, 0) == columns - 1)
               & (tl.gather(key, before, 0) >= key))
    earlier = tl.load(window_row + tl.where(earlier, columns, 0), mask=earlier, other=0) != 0
    own = given & ~earlier
    successor = columns + 1
    inside = given & (successor < n)
    inside = tl.load(window_row + tl.where(inside, successor, 0), mask=inside, other=0) != 0
    follows = inside & ~((i + 1 < K_P) & (tl.gather(flag, after, 0) != 0)
                         & (tl.gather(columns, after, 0) == successor) & (tl.gather(key, after, 0) > key))
    cost = own.to(tl.int32) + follows.to(tl.int32)
    # 2. the key where the walk stops, and what the columns at it take (in column order = rank order)
    # (a search over the register keys weighed by their cost, no buffer read; its first pivot aims at K slots'
    # share of the columns; with a best TOP, that search runs in the same loop: the score moments serve both)
    slots = tl.zeros((), tl.int32) + K
    top = tl.zeros((), tl.int32) + TOP
    given_count, lo, hi, mean, std = _key_stats(key, given)
    hi = hi.to(tl.int64) + 1
    total = tl.sum(cost, 0)
    guess = _first_value(mean, std, tl.maximum(total, 1), slots - 0.5)
    if TOP > 0:
        stop, _, best, ties, _ = _exact_threshold_pair(
            key, cost, slots, total, guess, top, given_count,
            _first_value(mean, std, tl.maximum(given_count, 1), top - 0.5), lo, hi)
    else:
        stop, _, _ = _exact_threshold(key, cost, best_out, 0, slots, lo, total, hi, guess, False, K_P, True)
        best = stop
        ties = tl.zeros((), tl.int32)
    above = given & (key > stop)
    tie = given & (key == stop)
    room = K - tl.sum(tl.where(above, cost, 0), 0)
    tie_cost = tl.where(tie, cost, 0)
    take = tl.where(above, cost, tl.minimum(tl.maximum(room - (tl.cumsum(tie_cost, 0) - tie_cost), 0), tie_cost))
    own_taken = own & (take >= 1)
    follows_taken = follows & (take == cost) & (take >= 1)
    # 3. slots in column order
    count = own_taken.to(tl.int32) + follows_taken.to(tl.int32)
    start = tl.cumsum(count, 0) - count
    tl.store(out + start, columns, mask=own_taken)
    tl.store(out + start + own_taken.to(tl.int32), successor, mask=follows_taken)
    tl.store(out + i, tl.full([K_P], -1, tl.int64), mask=(i >= tl.sum(count, 0)) & (i < K))
    if TOP > 0:  # the best TOP given columns
        taken, _ = _write_columns(best_out, key, columns, best, ties, 0, 0, best_out, False)  # not given: never taken
        tl.store(best_out + i, tl.full([K_P], -1, tl.int64), mask=(i >= taken) & (i < TOP))


@triton.jit
def _with_successors(
    columns_ptr, scores_ptr, window_ptr, out_ptr, best_ptr, n, top, s_cb, s_ch, s_sb, s_sh, s_wb, s_ob, s_oh,
    HEADS: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    row = (pid // HEADS).to(tl.int64)
    head = pid % HEADS
    i = tl.arange(0, K_P)
    columns = tl.load(columns_ptr + row * s_cb + head * s_ch + i, mask=i < K, other=-1).to(tl.int64)
    score = tl.load(scores_ptr + row * s_sb + head * s_sh + i, mask=i < K, other=0.0).to(tl.float32)
    key = _score_key(score)
    _walk(out_ptr + row * s_ob + head * s_oh, best_ptr + pid.to(tl.int64) * top, columns, key, columns >= 0,
          window_ptr + row * s_wb, n, K, top, K_P, False)


def with_successors_triton(columns: torch.Tensor, scores: torch.Tensor, window: torch.Tensor, top: int = 0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `successors.with_successors_torch`."""
    batch, heads, k = columns.shape
    if window.shape[-1] >= (1 << COLUMN_BITS) - 1:
        raise ValueError(f"with_successors_triton: {window.shape[-1]} columns; accepted: fewer than "
                         f"{(1 << COLUMN_BITS) - 1} (the torch twin takes more)")
    out = torch.empty(batch, heads, k, dtype=columns.dtype, device=columns.device)
    best = torch.full((batch, heads, top), -1, dtype=columns.dtype, device=columns.device)
    if batch * heads == 0 or k == 0:
        return out, best
    if columns.stride(-1) != 1:
        columns = columns.contiguous()
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if window.stride(-1) != 1:
        window = window.contiguous()
    _with_successors[(batch * heads,)](
        columns, scores, window, out, best, window.shape[-1], top, columns.stride(0), columns.stride(1),
        scores.stride(0), scores.stride(1), window.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, K=k, K_P=triton.next_power_of_2(max(k, top, 2)), **pdl_options(out.device),
    )
    return out, best
