"""Triton weight product of a decode step: ``x [M, K] @ weight [N, K]^T (+ bias)`` for few rows (M <= 16).

A decode step's linear layers read every weight once for a handful of rows: the product is bound by the
weight's bytes. Program (block of ``block_n`` output columns, split of K): it streams its
``[block_n, K / split]`` slab of the weight once, contiguous along K, and multiplies it with all M rows
(padded to 16 for the tensor cores) in fp32. With ``split > 1`` the splits write fp32 partials
``[split, M, N]`` and a second launch sums them in split order, adds the bias and casts; with
``split == 1`` the one launch writes the output. The order of the sums is fixed: deterministic.

No device value is read on the host: both launches are CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_linear import MAX_ROWS, LinearTile


@triton.jit
def _decode_linear(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, k_per_split, s_xm, s_wn, s_om,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (column block, K split): the fp32 product of its weight slab with the M rows."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    start = tl.program_id(1) * k_per_split
    col_ok = cols < N
    row_ok = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w_base = w_ptr + cols.to(tl.int64)[:, None] * s_wn
    for k0 in range(start, start + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    ok = row_ok[:, None] & col_ok[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * s_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part = part_ptr + (tl.program_id(1) * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(part, acc, mask=ok)


@triton.jit
def _sum_splits(part_ptr, bias_ptr, out_ptr, M, N, split, s_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, column block): the sum of the `split` fp32 partials in split order, plus the bias."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(split):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def decode_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         tile: LinearTile) -> torch.Tensor:
    """``x [..., K]`` (at most `MAX_ROWS` rows in all) times ``weight [N, K]`` (unit stride on K) transposed,
    plus ``bias [N]``: ``[..., N]`` in x's dtype (contract: `decode_linear.decode_linear_torch`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"decode_linear_triton takes at most {MAX_ROWS} rows, got {m}")
    if weight.stride(-1) != 1 or flat.stride(-1) != 1:
        raise ValueError("decode_linear_triton needs a unit stride on K of the input and the weight")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m * n == 0:
        return out.reshape(*lead, n)
    chunk = triton.cdiv(triton.cdiv(k, tile.split), tile.block_k) * tile.block_k  # K per split, whole chunks
    split = triton.cdiv(k, chunk)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    bias_arg = bias if bias is not None else out
    _decode_linear[(triton.cdiv(n, tile.block_n), split)](
        flat, weight, bias_arg, out, part, m, n, k, chunk, flat.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None and split == 1, PARTIAL=split > 1, BLOCK_M=MAX_ROWS, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if split > 1:
        block = 256
        _sum_splits[(m, triton.cdiv(n, block))](part, bias_arg, out, m, n, split, out.stride(0),
                                                HAS_BIAS=bias is not None, BLOCK=block)
    return out.reshape(*lead, n)
