"""Triton Quest heavy columns from page scores: the twin of `page_topk.page_heavy_torch`, one launch.

Program (row, head), every page in registers (P_PAD of them):

1. counts each page's selectable columns (the row's window read by page, about ``BLOCK_COLUMNS`` columns at
   a time) into its scratch row;
2. finds the page score where the budget ends: the exact search of `key_search_triton._exact_threshold`
   over the pages' order-preserving score keys, each page weighed by its selectable columns (pages holding
   none weigh nothing and are never taken): the pages above it weigh less than the budget, those at or
   above it at least as much;
3. takes every selectable column of the pages above that score, and of the pages at it (ties) in page
   order until the budget is spent (the last one cut after its first columns): a running count over the
   pages gives each page's first slot, and the taken pages are listed in page order;
4. writes the taken pages' columns, ``BLOCK_TAKEN`` pages at a time, in column order.

No sort: a few block reductions over P pages whatever the budget. No device value is read on the host:
the launch is CUDA-graph capturable. Scratch: ``[B' * H', 3, P_PAD]`` int32, made per call (inside a CUDA
graph, in the graph's pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .critical_indices import NO_TOKEN
from .key_search_triton import _exact_threshold, _fill_empty, _first_value, _key_stats, _score_key
from .dependent_launch import pdl_options, wait_for_previous_kernel
from .selection_heads import column_buffer

BLOCK_COLUMNS = 16384  # window columns counted at once
BLOCK_TAKEN = 64  # taken pages written at once


@triton.jit
def _page_columns(sel_row, page, offsets, shift, pages, n, SIZE: tl.constexpr):
    """``[BLOCK, SIZE_PAD]`` flags of the selectable columns of the pages `page`, and their columns."""
    column = page[:, None] * SIZE + offsets[None, :] - shift
    ok = (page < pages)[:, None] & (offsets < SIZE)[None, :] & (column >= 0) & (column < n)
    return tl.load(sel_row + column, mask=ok, other=0).to(tl.int32), column


@triton.jit
def _page_heavy(
    scores_ptr, sel_ptr, shift_ptr, out_ptr, work_ptr, pages, n, heavy, s_sel,
    HEADS: tl.constexpr, SIZE: tl.constexpr, SIZE_PAD: tl.constexpr, P_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, TILE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // HEADS
    shift = tl.load(shift_ptr + row)
    sel_row = sel_ptr + row * s_sel
    counts = work_ptr + pid * (3 * P_PAD)
    chosen = counts  # reused once the counts are in registers
    takes = counts + P_PAD
    firsts = counts + 2 * P_PAD
    out_row = out_ptr + pid * heavy
    offsets = tl.arange(0, SIZE_PAD)
    # 1. selectable columns per page
    for p0 in range(0, P_PAD, BLOCK_P):
        block = p0 + tl.arange(0, BLOCK_P)
        flags, _ = _page_columns(sel_row, block, offsets, shift, pages, n, SIZE)
        tl.store(counts + block, tl.sum(flags, 1))
    tl.debug_barrier()  # the counts are written
    # 2. the score key where the budget ends (weighed by the pages' selectable columns)
    page = tl.arange(0, P_PAD)
    count = tl.load(counts + page)
    score = tl.load(scores_ptr + pid * pages + page, mask=page < pages, other=0.0)
    ok = (page < pages) & (count > 0)
    key = tl.where(ok, _score_key(score), -2147483647 - 1)
    weight = tl.where(ok, count, 0)
    taken_pages, smallest, largest, mean, std = _key_stats(key, ok)
    total = tl.sum(weight, 0)
    r = tl.minimum(total, heavy)
    threshold = tl.zeros((), tl.int32) + 2147483647  # nothing above: no page taken
    ties = tl.zeros((), tl.int32)
    if r > 0:
        aim = (r.to(tl.float32) - 0.5) * taken_pages.to(tl.float32) / total.to(tl.float32)  # in pages
        first = _first_value(mean, std, taken_pages, aim)
        threshold, ties, _ = _exact_threshold(key, weight, out_row, 0, r, smallest, total, largest.to(tl.int64) + 1,
                                              first, False, TILE)
    # 3. what each page takes (the tied pages in page order, the last one cut), and its first slot
    tie = key == threshold
    tie_weight = tl.where(tie, weight, 0)
    tie_before = tl.cumsum(tie_weight, 0) - tie_weight
    take = tl.where(key > threshold, weight, tl.minimum(tl.maximum(ties - tie_before, 0), tie_weight))
    taken = take > 0
    tl.debug_barrier()  # every count is read: the scratch rows are free
    tl.store(chosen + tl.cumsum(taken.to(tl.int32), 0) - 1, page, mask=taken)  # the taken pages, in page order
    tl.store(takes + page, take)
    tl.store(firsts + page, tl.cumsum(take, 0) - take)
    tl.debug_barrier()  # the taken pages, their takes and first slots are written
    # 4. the taken pages' columns
    taken_count = tl.sum(taken.to(tl.int32), 0)
    for c0 in range(0, taken_count, BLOCK_T):
        index = c0 + tl.arange(0, BLOCK_T)
        at = tl.load(chosen + index, mask=index < taken_count, other=P_PAD)
        in_page, column = _page_columns(sel_row, at, offsets, shift, pages, n, SIZE)
        before = tl.cumsum(in_page, 1) - in_page  # selectable columns before each in its page
        keep = (in_page != 0) & (before < tl.load(takes + at, mask=at < P_PAD, other=0)[:, None])
        slot = tl.load(firsts + at, mask=at < P_PAD, other=0)[:, None] + before
        tl.store(out_row + slot, column.to(tl.int64), mask=keep)
    _fill_empty(out_row, r, heavy, TILE, out_row, False)


def page_heavy_triton(scores: torch.Tensor, selectable: torch.Tensor, shift: torch.Tensor, page_size: int,
                      heavy: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`page_heavy` of fp32 page scores ``[B', H', P]``, the window ``[B', n]`` and shifts ``[B']``:
    ``[B', H', heavy]`` int64, into `out` where it fits (`selection_heads.column_buffer`)."""
    count, width, pages = scores.shape
    n = selectable.shape[-1]
    out = column_buffer(out, (count, width, heavy), scores.device)
    if count * width * heavy == 0:
        return out
    if pages == 0:
        return out.fill_(NO_TOKEN)
    scores = scores if scores.is_contiguous() else scores.contiguous()
    selectable = selectable if selectable.stride(-1) == 1 else selectable.contiguous()
    flags = selectable.view(torch.uint8)
    shift = shift.to(torch.int64).contiguous()
    p_pad = max(16, triton.next_power_of_2(pages))
    size_pad = max(2, triton.next_power_of_2(page_size))
    work = torch.empty(count * width, 3, p_pad, dtype=torch.int32, device=scores.device)
    _page_heavy[(count * width,)](
        scores, flags, shift, out, work, pages, n, heavy, flags.stride(0),
        HEADS=width, SIZE=page_size, SIZE_PAD=size_pad, P_PAD=p_pad,
        BLOCK_P=min(max(16, BLOCK_COLUMNS // size_pad), p_pad), BLOCK_T=BLOCK_TAKEN, TILE=min(1024, p_pad),
        num_warps=4 if p_pad <= 1024 else 8 if p_pad <= 4096 else 16, **pdl_options(out.device),
    )
    return out
