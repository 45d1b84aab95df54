"""Triton successors: one launch per selecting layer instead of a few sorts and a few dozen small kernels.

Twin of `successors.with_successors_torch`. Program (row, head) holds its k columns and scores in registers
(`_walk`, also the end of `label_topk_triton`'s fused candidate walk) in column order (given so, or sorted
into it first: one sort of (column, score key) packed in int64):

1. rank order: one ascending sort of int64 keys (given last, score descending as an order-preserving int32
   key, position ascending: the smaller column first among ties); the ranked columns are written;
2. each entry's rank, by writing the sort's positions at the entries' slots of the output row (a scratch,
   read back after a barrier); in column order an entry's neighbours are the entries beside it, so
   whether a column was taken as its predecessor's successor and whether its successor is free are
   comparisons with them;
3. those two flags moved to rank order through the same scratch: a cumulative sum gives each ranked
   column its first slot.

The walk's slots are contiguous from 0: the taken columns are written there, ``NO_TOKEN`` after them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COLUMN_BITS = 24  # columns < 2**24 in the packed sort keys
RANK_BITS = 16  # k < 2**16


@triton.jit
def _walk(out, ranked_out, columns, key, given, window_row, n, K, K_P: tl.constexpr, ASCENDING: tl.constexpr):
    """Write the walk of one (row, head) at ``out[0:K)`` and the given columns in rank order at
    ``ranked_out[0:K)``: columns ``[K_P]`` int64 with their order-preserving int32 score keys, `given` where an
    entry takes part; `window_row` the row's selectable columns (nonzero). ASCENDING: the columns are
    ascending and distinct, negative entries (never given) only after them; otherwise any order."""
    i = tl.arange(0, K_P)
    if not ASCENDING:  # column order first, not-given entries last
        packed = tl.sort((tl.where(given, columns, (1 << 24) - 1) << 32) | (key.to(tl.int64) & 0xFFFFFFFF))
        columns = packed >> 32
        key = packed.to(tl.int32)  # the low 32 bits
        given = columns < (1 << 24) - 1
    # 1. rank order: given first, score descending, position (column) ascending; the rest by position, so
    # that entries [0, K) take ranks [0, K)
    descending = tl.where(given, 0x7FFFFFFF - key.to(tl.int64), 0)  # in [0, 2**32)
    ranked = tl.sort((tl.where(given, 0, 1).to(tl.int64) << 56) | (descending << 24) | i)
    position = (ranked & ((1 << 24) - 1)).to(tl.int32)
    ranked_column = tl.gather(columns, position, 0)
    tl.store(ranked_out + i, tl.where(ranked < (1 << 56), ranked_column, -1), mask=i < K)
    # 2. each entry's rank (the inverse permutation, through the output row), then its neighbours' ranks
    tl.store(out + position, i.to(tl.int64), mask=position < K)
    tl.debug_barrier()
    rank = tl.load(out + i, mask=i < K, other=K_P, cache_modifier=".cg").to(tl.int32)
    before = tl.maximum(i - 1, 0)
    after = tl.minimum(i + 1, K_P - 1)
    # taken already where it is the successor, in the window, of the column before it ranked before it
    earlier = given & (i > 0) & (tl.gather(columns, before, 0) == columns - 1) & (tl.gather(rank, before, 0) < rank)
    earlier = tl.load(window_row + tl.where(earlier, columns, 0), mask=earlier, other=0) != 0
    own = given & ~earlier
    successor = columns + 1
    inside = given & (successor < n)
    inside = tl.load(window_row + tl.where(inside, successor, 0), mask=inside, other=0) != 0
    follows = inside & ~((i + 1 < K_P) & (tl.gather(columns, after, 0) == successor)
                         & (tl.gather(rank, after, 0) < rank))
    # 3. the flags in rank order (through the output row again), each ranked column's first slot
    tl.debug_barrier()  # every rank read before the row is written again
    tl.store(out + rank, (own.to(tl.int64) << 1) | follows.to(tl.int64), mask=i < K)
    tl.debug_barrier()
    flags = tl.load(out + i, mask=i < K, other=0, cache_modifier=".cg")
    tl.debug_barrier()  # every flag read before the walk is written
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
          window_ptr + row * s_wb, n, K, K_P, False)


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
