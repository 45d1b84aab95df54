"""Triton Quest heavy columns from page scores: the twin of `page_topk.page_heavy_torch`, one launch.

Program (row, head, share of the heavy slots):

1. counts each page's selectable columns (the row's window read by page, ``BLOCK_PAGES`` pages at a time)
   into its scratch row;
2. sorts its P page scores in registers, each packed with its page into one int64 key (the score's bits
   made order-preserving in the high half, ``P_PAD - 1 - page`` in the low half: a descending sort puts
   the earlier page first among equal scores, as the twin's stable sort does; ``-0.0`` is read as ``+0.0``);
   the ranked pages and the running count of selectable columns over them go to its scratch rows;
3. for each block of its share of the heavy slots: the slot's ranked page by a binary search over the
   running count, its offset inside the page, and its column by a count over the page's selectable flags.

At few rows the (row, head) pairs leave most of the device idle: the slots are then shared out over up to
`MAX_SLOT_PROGRAMS` programs per pair (each counting and ranking the pages again), so that about one wave
runs (`slot_programs`). Scratch: ``[B' * H' * S, 3, P_PAD]`` int32 (S programs a pair), made per call
(inside a CUDA graph, in the graph's pool). No device value is read on the host: the launch is CUDA-graph
capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .critical_indices import NO_TOKEN
from .gather_attention_triton import num_sms

_NO_TOKEN = tl.constexpr(NO_TOKEN)
BLOCK_PAGES = 64  # pages counted at once
BLOCK_SLOTS = 128  # heavy slots resolved at once
MAX_SLOT_PROGRAMS = 4  # programs sharing one (row, head)'s slots (each ranks the pages again: more cost more)


@triton.jit
def _page_heavy(
    scores_ptr, sel_ptr, shift_ptr, out_ptr, work_ptr, pages, n, heavy, slots_per_program, s_sel,
    HEADS: tl.constexpr, SIZE: tl.constexpr, SIZE_PAD: tl.constexpr, P_PAD: tl.constexpr, LOG_P: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // HEADS
    shift = tl.load(shift_ptr + row)
    sel_row = sel_ptr + row * s_sel
    counts = work_ptr + (pid * tl.num_programs(1) + tl.program_id(1)) * (3 * P_PAD)
    ranked_pages = counts + P_PAD
    reach = counts + 2 * P_PAD
    offsets = tl.arange(0, SIZE_PAD)
    # 1. selectable columns per page
    for p0 in range(0, P_PAD, BLOCK_P):
        page = p0 + tl.arange(0, BLOCK_P)
        column = page[:, None] * SIZE + offsets[None, :] - shift
        ok = (page < pages)[:, None] & (offsets < SIZE)[None, :] & (column >= 0) & (column < n)
        flags = tl.load(sel_row + column, mask=ok, other=0).to(tl.int32)
        tl.store(counts + page, tl.sum(flags, 1))
    # 2. pages ranked by score, the running count over them
    page = tl.arange(0, P_PAD)
    score = tl.load(scores_ptr + pid * pages + page, mask=page < pages, other=0.0) + 0.0  # -0.0 -> +0.0
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order = float order
    ordered = tl.where(page < pages, ordered, -2147483647 - 1)  # padding pages last
    key = (ordered.to(tl.int64) << 32) | (P_PAD - 1 - page).to(tl.int64)
    key = tl.sort(key, 0, descending=True)
    best = (P_PAD - 1 - (key - ((key >> 32) << 32))).to(tl.int32)
    tl.debug_barrier()  # the counts of step 1 are written
    in_order = tl.load(counts + best, mask=best < pages, other=0)
    total = tl.sum(in_order, 0)
    tl.store(ranked_pages + page, best)
    tl.store(reach + page, tl.cumsum(in_order, 0))
    tl.debug_barrier()  # the ranked pages and their running count are written
    # 3. each slot's page and column
    first = tl.program_id(1) * slots_per_program
    for s0 in range(first, tl.minimum(first + slots_per_program, heavy), BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        lo = tl.zeros((BLOCK_S,), tl.int32)
        hi = tl.full((BLOCK_S,), P_PAD, tl.int32)
        for _ in tl.static_range(LOG_P + 1):  # the first ranked page whose running count exceeds the slot
            mid = (lo + hi) // 2
            open_ = lo < hi
            right = tl.load(reach + tl.minimum(mid, P_PAD - 1)) <= slot
            lo = tl.where(open_ & right, mid + 1, lo)
            hi = tl.where(open_ & ~right, mid, hi)
        rank = tl.minimum(lo, P_PAD - 1)
        chosen = tl.load(ranked_pages + rank)
        offset = slot - (tl.load(reach + rank) - tl.load(counts + chosen, mask=chosen < pages, other=0))
        column = chosen[:, None] * SIZE + offsets[None, :] - shift
        ok = (offsets < SIZE)[None, :] & (column >= 0) & (column < n) & (chosen < pages)[:, None]
        flags = tl.load(sel_row + column, mask=ok, other=0).to(tl.int32)
        inside = tl.sum((tl.cumsum(flags, 1) <= offset[:, None]).to(tl.int32), 1)  # flags before the wanted one
        found = chosen.to(tl.int64) * SIZE + inside - shift
        result = tl.where(slot < total, found, _NO_TOKEN)
        tl.store(out_ptr + pid * heavy + slot, result, mask=slot < heavy)


def slot_programs(pairs: int, heavy: int, device: torch.device) -> int:
    """Programs sharing each (row, head)'s heavy slots: about one wave of `pairs` pairs on the device's
    multiprocessors (1 off CUDA), at most one per block of slots and `MAX_SLOT_PROGRAMS`."""
    sms = num_sms(device) if device.type == "cuda" else 1
    return max(1, min(MAX_SLOT_PROGRAMS, triton.cdiv(heavy, BLOCK_SLOTS), sms // max(pairs, 1)))


def page_heavy_triton(scores: torch.Tensor, selectable: torch.Tensor, shift: torch.Tensor, page_size: int,
                      heavy: int, programs: int | None = None) -> torch.Tensor:
    """`page_heavy` of fp32 page scores ``[B', H', P]``, the window ``[B', n]`` and shifts ``[B']``:
    ``[B', H', heavy]`` int64. `programs`: per (row, head), default `slot_programs`."""
    count, width, pages = scores.shape
    n = selectable.shape[-1]
    out = torch.empty(count, width, heavy, dtype=torch.int64, device=scores.device)
    if count * width * heavy == 0:
        return out
    if pages == 0:
        return out.fill_(NO_TOKEN)
    scores = scores if scores.is_contiguous() else scores.contiguous()
    selectable = selectable if selectable.stride(-1) == 1 else selectable.contiguous()
    flags = selectable.view(torch.uint8)
    shift = shift.to(torch.int64).contiguous()
    p_pad = max(16, triton.next_power_of_2(pages))
    programs = programs or slot_programs(count * width, heavy, scores.device)
    share = triton.cdiv(triton.cdiv(heavy, BLOCK_SLOTS), programs) * BLOCK_SLOTS  # whole blocks a program
    programs = triton.cdiv(heavy, share)
    work = torch.empty(count * width * programs, 3, p_pad, dtype=torch.int32, device=scores.device)
    _page_heavy[(count * width, programs)](
        scores, flags, shift, out, work, pages, n, heavy, share, flags.stride(0),
        HEADS=width, SIZE=page_size, SIZE_PAD=max(2, triton.next_power_of_2(page_size)), P_PAD=p_pad,
        LOG_P=p_pad.bit_length() - 1, BLOCK_P=min(BLOCK_PAGES, p_pad), BLOCK_S=BLOCK_SLOTS,
        num_warps=4 if p_pad <= 1024 else 8,
    )
    return out
