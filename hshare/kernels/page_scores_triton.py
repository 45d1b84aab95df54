"""Triton Quest page scores of a decode query: the twin of `page_scores.page_scores_torch` at one query row.

Program (row-head, block of pages): the selection head's summed ``q+`` and ``q-`` (fp32, from the
decode query's heads of its group), then each page's ``q+ . high + q- . low`` from the bounds read once
in their dtype, products accumulated in fp32 channel-wise; only the ``[B', H', P]`` fp32 scores are
written. No device value is read on the host: the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .dependent_launch import pdl_options, wait_for_previous_kernel

BLOCK_PAGES = 64  # pages per program


@triton.jit
def _page_scores(
    query_ptr, low_ptr, high_ptr, rows_ptr, heads_ptr, out_ptr, pages,
    s_qb, s_qh, s_lb, s_lh, s_lp, s_hb, s_hh, s_hp, s_sb,
    HEADS: tl.constexpr, SEL_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (row-head pid, page block): the scores of BLOCK pages."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    i = (pid // HEADS).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    sel = tl.load(heads_ptr + i * s_sb + pid % HEADS).to(tl.int64)
    kv = sel * KV_HEADS // SEL_HEADS
    dims = tl.arange(0, DIM_PAD)
    in_dim = dims < DIM
    positive = tl.zeros((DIM_PAD,), tl.float32)
    negative = tl.zeros((DIM_PAD,), tl.float32)
    for g in tl.static_range(GROUP):
        q = tl.load(query_ptr + row * s_qb + (sel * GROUP + g) * s_qh + dims, mask=in_dim, other=0.0).to(tl.float32)
        positive += tl.maximum(q, 0.0)
        negative += tl.minimum(q, 0.0)
    page = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (page < pages)[:, None] & in_dim[None, :]
    high = tl.load(high_ptr + row * s_hb + kv * s_hh + page[:, None] * s_hp + dims[None, :], mask=ok, other=0.0)
    low = tl.load(low_ptr + row * s_lb + kv * s_lh + page[:, None] * s_lp + dims[None, :], mask=ok, other=0.0)
    score = tl.sum(high.to(tl.float32) * positive[None, :] + low.to(tl.float32) * negative[None, :], 1)
    tl.store(out_ptr + pid.to(tl.int64) * pages + page, score, mask=page < pages)


def page_scores_triton(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor, sel_heads: int,
                       rows: torch.Tensor, heads: torch.Tensor, block: int = BLOCK_PAGES) -> torch.Tensor:
    """`page_scores` of the decode query ``[B, Hq, d]`` for rows ``[B']`` and selection heads ``[B' or 1, H']``
    (index tensors): ``[B', H', P]`` fp32."""
    count, n_heads = rows.shape[0], heads.shape[-1]
    q_heads, dim = query.shape[1], query.shape[2]
    kv_heads, pages = low.shape[1], low.shape[2]
    out = torch.empty(count, n_heads, pages, dtype=torch.float32, device=query.device)
    if count * n_heads * pages == 0:
        return out
    if query.stride(-1) != 1 or low.stride(-1) != 1 or high.stride(-1) != 1:
        raise ValueError("page_scores_triton needs a unit stride on the head dimension of the query and the bounds")
    heads = heads.expand(count, n_heads)
    heads = heads if heads.stride(-1) == 1 else heads.contiguous()
    rows = rows if rows.is_contiguous() else rows.contiguous()
    _page_scores[(count * n_heads, triton.cdiv(pages, block))](
        query, low, high, rows, heads, out, pages,
        query.stride(0), query.stride(1), low.stride(0), low.stride(1), low.stride(2),
        high.stride(0), high.stride(1), high.stride(2), heads.stride(0),
        HEADS=n_heads, SEL_HEADS=sel_heads, KV_HEADS=kv_heads, GROUP=q_heads // sel_heads,
        DIM=dim, DIM_PAD=max(16, triton.next_power_of_2(dim)), BLOCK=block, num_warps=4, **pdl_options(out.device),
    )
    return out
