"""Triton heavy-token top-k: one program per (row, head) score row, the whole row in registers.

Twin of `heavy_topk.select_heavy_torch`. ``torch.topk`` on a decode step's ``[B * H, n]`` scores is
a multi-block radix select of five kernels; here
one program finds its row's k-th largest score by a 32-step bisection of the scores' order-preserving
integer keys (each step one comparison and one block sum over the row held in registers), then
writes the columns above it, and the first columns equal to it (-0.0 equals +0.0), in ascending column
order (a block prefix sum gives each its slot). Unselectable or non-finite columns never count; slots
past the window's size are ``-1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .key_search_triton import _score_key
from .dependent_launch import pdl_options, wait_for_previous_kernel

MAX_COLUMNS = 32768  # a row in registers: 64 columns per thread at 16 warps; longer rows use the twin


@triton.jit
def _threshold_by_bisection(key, k):
    """The k-th largest key (unsigned key space, int64): 32 steps, each a comparison and a block sum."""
    threshold = tl.full((), 0, tl.int64)  # the largest t with #(key >= t) >= k
    for step in tl.static_range(32):
        candidate = threshold + (1 << (31 - step))
        count = tl.sum((key >= (candidate - 2147483648).to(tl.int32)).to(tl.int32), 0)
        threshold = tl.where(count >= k, candidate, threshold)
    return threshold


@triton.jit
def _heavy_topk(
    scores_ptr, selectable_ptr, out_ptr, n, heavy,
    s_sa, s_sh, s_ma, s_oa, s_oh,
    HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    a = (pid // HEADS).to(tl.int64)
    h = (pid % HEADS).to(tl.int64)
    columns = tl.arange(0, BLOCK_N)
    in_row = columns < n
    score = tl.load(scores_ptr + a * s_sa + h * s_sh + columns, mask=in_row, other=0.0)
    ok = in_row & (tl.load(selectable_ptr + a * s_ma + columns, mask=in_row, other=0) != 0)
    ok = ok & (tl.abs(score) < float("inf"))  # NaN fails the comparison too
    # order-preserving int32 key of an fp32 score (-0.0 as +0.0); columns that may not be chosen get
    # INT32_MIN, which no bisection candidate reaches (candidates are >= 1)
    key = tl.where(ok, _score_key(score), -2147483648)
    k = tl.minimum(tl.sum(ok.to(tl.int32), 0), heavy)
    threshold = _threshold_by_bisection(key, k)
    signed = tl.where(k > 0, (threshold - 2147483648).to(tl.int32), 2147483647)  # k = 0: above nothing
    above = ok & (key > signed)
    tie = ok & (key == signed)
    ties_needed = k - tl.sum(above.to(tl.int32), 0)
    take = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= ties_needed))
    slot = tl.cumsum(take.to(tl.int32), 0) - 1
    out = out_ptr + a * s_oa + h * s_oh
    tl.store(out + slot, columns.to(tl.int64), mask=take)
    rest = tl.arange(0, BLOCK_K)
    tl.store(out + rest, tl.full((BLOCK_K,), -1, tl.int64), mask=(rest >= k) & (rest < heavy))


def select_heavy_triton(scores: torch.Tensor, selectable: torch.Tensor, heavy: int, *,
                        num_warps: int | None = None) -> torch.Tensor:
    """`heavy_topk.select_heavy` for fp32 scores ``[A, H, n]`` (n <= `MAX_COLUMNS`) and one
    selectable window ``[A, n]`` per A row: ``[A, H, heavy]`` int64 columns, ascending. `num_warps`
    overrides the launch (benchmark sweeps)."""
    rows, heads, n = scores.shape
    if n > MAX_COLUMNS:
        raise ValueError(f"{n} columns exceed the Triton top-k's {MAX_COLUMNS}; use select_heavy (the twin)")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if selectable.stride(-1) != 1:
        selectable = selectable.contiguous()
    if selectable.dtype == torch.bool:
        selectable = selectable.view(torch.uint8)
    out = torch.empty(rows, heads, heavy, dtype=torch.int64, device=scores.device)
    block = max(16, triton.next_power_of_2(n))
    _heavy_topk[(rows * heads,)](
        scores, selectable, out, n, heavy,
        scores.stride(0), scores.stride(1), selectable.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, BLOCK_N=block, BLOCK_K=max(16, triton.next_power_of_2(heavy)), 
        num_warps=num_warps or default_warps(block), **pdl_options(out.device),
    )
    return out


def default_warps(block: int) -> int:
    """Warps of a program holding `block` columns (`benchmarks/tune_kernels.py topk`)."""
    return max(4, min(16, block // 1024))
