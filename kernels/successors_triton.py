"""Triton successors: one launch per selecting layer instead of three sorts and a few dozen small kernels.

Twin of `successors.with_successors_torch`. Program (row, head) holds its k columns and scores in registers
(`_walk`, also the end of `label_topk_triton`'s fused candidate walk) and sorts three times, each an int64
key packed so that one ascending sort orders it:

1. rank order: (given last, score descending as an order-preserving int32 key, column ascending);
2. column order, carrying each entry's rank: whether a column's neighbours are given and ranked before it
   (read with `tl.gather` from the next and previous sorted entries), so whether the column and its
   successor would add a slot;
3. rank order again, carrying those two flags (an int32 key): a cumulative sum gives each ranked column its
   first slot.

The walk's slots are contiguous from 0: the taken columns are written there, ``NO_TOKEN`` after them; the
ranked columns (1.) are written too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COLUMN_BITS = 24  # columns < 2**24 in the packed sort keys
RANK_BITS = 16  # k < 2**16


@triton.jit
def _walk(out, ranked_out, columns, key, given, window_row, n, K, K_P: tl.constexpr):
    """Write the walk of one (row, head) at ``out[0:K)`` and the given columns in rank order at
    ``ranked_out[0:K)``: columns ``[K_P]`` int64 with their order-preserving int32 score keys, `given` where an
    entry takes part; `window_row` the row's selectable columns (nonzero)."""
    i = tl.arange(0, K_P)
    column_field = tl.where(given, columns, (1 << 24) - 1)
    # 1. rank order: given first, score descending, column ascending
    descending = 0x7FFFFFFF - key.to(tl.int64)  # in [0, 2**32)
    ranked = tl.sort((tl.where(given, 0, 1).to(tl.int64) << 56) | (descending << 24) | column_field)
    ranked_column = ranked & ((1 << 24) - 1)
    tl.store(ranked_out + i, tl.where(ranked < (1 << 56), ranked_column, -1), mask=i < K)
    # 2. column order with ranks (rank = position in 1.): neighbours ranked before
    by_column = tl.sort((ranked_column << 16) | i)
    column = by_column >> 16
    rank = by_column & 0xFFFF
    previous = tl.gather(by_column, tl.maximum(i - 1, 0), 0)
    following = tl.gather(by_column, tl.minimum(i + 1, K_P - 1), 0)
    ok = column < (1 << 24) - 1  # given
    earlier = ok & (i > 0) & ((previous >> 16) == column - 1) & ((previous & 0xFFFF) < rank)
    # taken already where it is the successor, in the window, of the column before it
    earlier = tl.load(window_row + tl.where(earlier, column, 0), mask=earlier, other=0) != 0
    own = ok & ~earlier
    successor = column + 1
    inside = ok & (successor < n)
    inside = tl.load(window_row + tl.where(inside, successor, 0), mask=inside, other=0) != 0
    follows = inside & ~((i + 1 < K_P) & ((following >> 16) == successor) & ((following & 0xFFFF) < rank))
    # 3. rank order with the flags
    flags = tl.sort((rank.to(tl.int32) << 2) | (own.to(tl.int32) << 1) | follows.to(tl.int32))
    own_r = (flags >> 1) & 1
    follows_r = flags & 1
    cost = own_r + follows_r
    start = tl.cumsum(cost, 0) - cost
    total = tl.sum(cost, 0)
    tl.store(out + start, ranked_column, mask=(own_r != 0) & (start < K))
    tl.store(out + start + own_r, ranked_column + 1, mask=(follows_r != 0) & (start + own_r < K))
    tl.store(out + i, tl.full([K_P], -1, tl.int64), mask=(i >= total) & (i < K))


@triton.jit
def _with_successors(
    columns_ptr, scores_ptr, window_ptr, out_ptr, ranked_ptr, n, s_cb, s_ch, s_sb, s_sh, s_wb, s_ob, s_oh,
    HEADS: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // HEADS).to(tl.int64)
    head = pid % HEADS
    i = tl.arange(0, K_P)
    columns = tl.load(columns_ptr + row * s_cb + head * s_ch + i, mask=i < K, other=-1).to(tl.int64)
    score = tl.load(scores_ptr + row * s_sb + head * s_sh + i, mask=i < K, other=0.0).to(tl.float32)
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving int32 of the float
    _walk(out_ptr + row * s_ob + head * s_oh, ranked_ptr + row * s_ob + head * s_oh, columns, key, columns >= 0,
          window_ptr + row * s_wb, n, K, K_P)


def with_successors_triton(columns: torch.Tensor, scores: torch.Tensor, window: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `successors.with_successors_torch`."""
    batch, heads, k = columns.shape
    if window.shape[-1] >= (1 << COLUMN_BITS) - 1 or k >= 1 << RANK_BITS:
        raise ValueError(f"with_successors_triton: {window.shape[-1]} columns and k = {k} are invalid; accepted: "
                         f"fewer than {(1 << COLUMN_BITS) - 1} columns and k < {1 << RANK_BITS}")
    out = torch.empty(batch, heads, k, dtype=columns.dtype, device=columns.device)
    ranked = torch.empty_like(out)
    if batch * heads == 0 or k == 0:
        return out, ranked
    if columns.stride(-1) != 1:
        columns = columns.contiguous()
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if window.stride(-1) != 1:
        window = window.contiguous()
    _with_successors[(batch * heads,)](
        columns, scores, window, out, ranked, window.shape[-1], columns.stride(0), columns.stride(1), scores.stride(0),
        scores.stride(1), window.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, K=k, K_P=triton.next_power_of_2(max(k, 2)),
    )
    return out, ranked
