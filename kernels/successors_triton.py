"""Triton successors: one launch per selecting layer instead of a sort and a dozen elementwise kernels.

Twin of `successors.with_successors_torch`. Program (row, head) loads its k columns, writes them, sorts them
in registers (padding sorts last, past every column), reads each sorted column's neighbour to see whether
its successor is already kept, and writes the successors of the first `width` - k sorted entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _with_successors(
    columns_ptr, window_ptr, out_ptr, n, s_cb, s_ch, s_wb, s_ob, s_oh,
    HEADS: tl.constexpr, K: tl.constexpr, EXTRA: tl.constexpr, K_P: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // HEADS).to(tl.int64)
    head = pid % HEADS
    i = tl.arange(0, K_P)
    ok = i < K
    columns = tl.load(columns_ptr + row * s_cb + head * s_ch + i, mask=ok, other=0)
    out = out_ptr + row * s_ob + head * s_oh
    tl.store(out + i, columns, mask=ok)
    ordered = tl.sort(tl.where(ok, columns, n + 1))  # NO_TOKEN first, padding (n + 1) last
    successor = ordered + 1
    following = tl.gather(ordered, tl.minimum(i + 1, K_P - 1), 0)
    taken = (following == successor) & (i + 1 < K_P)
    selectable = (ordered >= 0) & (successor < n)
    inside = tl.load(window_ptr + row * s_wb + tl.where(selectable, successor, 0), mask=selectable, other=0) != 0
    keep = selectable & inside & ~taken
    tl.store(out + K + i, tl.where(keep, successor, -1), mask=i < EXTRA)


def with_successors_triton(columns: torch.Tensor, window: torch.Tensor, width: int) -> torch.Tensor:
    """Same contract as `successors.with_successors_torch`."""
    batch, heads, k = columns.shape
    out = torch.empty(batch, heads, width, dtype=columns.dtype, device=columns.device)
    if batch * heads == 0 or width == 0:
        return out
    if columns.stride(-1) != 1:
        columns = columns.contiguous()
    if window.stride(-1) != 1:
        window = window.contiguous()
    _with_successors[(batch * heads,)](
        columns, window, out, window.shape[-1], columns.stride(0), columns.stride(1), window.stride(0),
        out.stride(0), out.stride(1),
        HEADS=heads, K=k, EXTRA=width - k, K_P=triton.next_power_of_2(max(k, 2)),
    )
    return out
