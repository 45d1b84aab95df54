"""Triton critical indices: one launch per decode step and layer instead of eight small kernels.

Twin of `critical_indices.critical_indices_torch`. Program (row, selection head) writes its N_c
indices: sink | heavy still in the middle window | local, or the row's first N_c valid columns for
a short row; int32 (what the gather kernel reads). With a work counter it also adds the valid
indices to it (one atomic add per program instead of a reduction kernel per layer).

`_write_critical_row` is that program's body: a kernel that computes heavy columns (the candidate
refinement, `label_topk_triton._label_candidates`) writes its row-heads' critical rows with it, in its own
launch (`critical_arguments`); where every column it picks lies in the middle window (its window is that one), it
writes the heavy part itself, with the columns, and the body only the sink, the local window and a short row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .critical_indices import CriticalWindows
from .dependent_launch import pdl_options, wait_for_previous_kernel


@triton.jit
def _write_critical_row(heavy_row, row, head, c_sink_ptr, c_local_ptr, c_dense_ptr, c_middle_ptr, c_short_ptr,
                        c_out_ptr, c_count_ptr, c_sb, c_lb, c_db, c_mb, c_ob, c_oh,
                        C_SINK: tl.constexpr, C_HEAVY: tl.constexpr, C_LOCAL: tl.constexpr, C_SINK_P: tl.constexpr,
                        C_HEAVY_P: tl.constexpr, C_LOCAL_P: tl.constexpr, C_COUNT: tl.constexpr, written=0,
                        HEAVY_WRITTEN: tl.constexpr = False):
    """Batch row `row`, selection head `head`: its N_c indices (sink | heavy still in the middle window | local, or
    the row's first N_c valid columns for a short row) from its heavy columns at `heavy_row` ``[C_HEAVY]`` (-1
    allowed), written as int32 at ``c_out[row, head]``; with C_COUNT its valid indices added to the counter (one
    atomic add, integer: order-free). The ``c_`` operands are `critical_arguments`'. HEAVY_WRITTEN: the caller wrote
    the heavy part already (`written` columns, all in the middle window, then NO_TOKEN, written before a barrier),
    which is then not read; a short row's is overwritten."""
    short = tl.load(c_short_ptr + row) != 0
    out = c_out_ptr + row * c_ob + head * c_oh
    dense = c_dense_ptr + row * c_db

    s = tl.arange(0, C_SINK_P)
    s_ok = s < C_SINK
    sink = tl.load(c_sink_ptr + row * c_sb + s, mask=s_ok, other=-1)
    sink = tl.where(short, tl.load(dense + s, mask=s_ok, other=-1), sink)
    tl.store(out + s, sink.to(tl.int32), mask=s_ok)

    k = tl.arange(0, C_HEAVY_P)
    k_ok = k < C_HEAVY
    if HEAVY_WRITTEN:
        # a short row's (the scalar broadcast as int32: the interpreter refuses a mask of block & scalar bool)
        refill = k_ok & (tl.zeros((C_HEAVY_P,), tl.int32) + short.to(tl.int32) != 0)
        heavy = tl.load(dense + C_SINK + k, mask=refill, other=-1)
        tl.store(out + C_SINK + k, heavy.to(tl.int32), mask=refill)
        heavy_valid = tl.where(short, tl.sum((k_ok & (heavy >= 0)).to(tl.int64), 0), written.to(tl.int64))
    else:
        heavy = tl.load(heavy_row + k, mask=k_ok, other=-1).to(tl.int64)
        start = tl.load(c_middle_ptr + row * c_mb)
        end = tl.load(c_middle_ptr + row * c_mb + 1)
        heavy = tl.where((heavy >= 0) & (heavy >= start) & (heavy < end), heavy, -1)
        heavy = tl.where(short, tl.load(dense + C_SINK + k, mask=k_ok, other=-1), heavy)
        tl.store(out + C_SINK + k, heavy.to(tl.int32), mask=k_ok)
        heavy_valid = tl.sum((k_ok & (heavy >= 0)).to(tl.int64), 0)

    j = tl.arange(0, C_LOCAL_P)
    j_ok = j < C_LOCAL
    local = tl.load(c_local_ptr + row * c_lb + j, mask=j_ok, other=-1)
    local = tl.where(short, tl.load(dense + C_SINK + C_HEAVY + j, mask=j_ok, other=-1), local)
    tl.store(out + C_SINK + C_HEAVY + j, local.to(tl.int32), mask=j_ok)
    if C_COUNT:
        valid = (tl.sum((s_ok & (sink >= 0)).to(tl.int64), 0) + heavy_valid
                 + tl.sum((j_ok & (local >= 0)).to(tl.int64), 0))
        tl.atomic_add(c_count_ptr, valid)


@triton.jit
def _critical_indices(
    heavy_ptr, s_hb, s_hh,
    c_sink_ptr, c_local_ptr, c_dense_ptr, c_middle_ptr, c_short_ptr, c_out_ptr, c_count_ptr,
    c_sb, c_lb, c_db, c_mb, c_ob, c_oh,
    HEADS: tl.constexpr, C_SINK: tl.constexpr, C_HEAVY: tl.constexpr, C_LOCAL: tl.constexpr,
    C_SINK_P: tl.constexpr, C_HEAVY_P: tl.constexpr, C_LOCAL_P: tl.constexpr, C_COUNT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    row = (pid // HEADS).to(tl.int64)
    head = pid % HEADS
    _write_critical_row(heavy_ptr + row * s_hb + head * s_hh, row, head, c_sink_ptr, c_local_ptr, c_dense_ptr,
                        c_middle_ptr, c_short_ptr, c_out_ptr, c_count_ptr, c_sb, c_lb, c_db, c_mb, c_ob, c_oh,
                        C_SINK, C_HEAVY, C_LOCAL, C_SINK_P, C_HEAVY_P, C_LOCAL_P, C_COUNT)


def critical_arguments(windows: CriticalWindows, heads: int, heavy: int) -> tuple[torch.Tensor, dict]:
    """The int32 output ``[B, heads, N_c]`` and the ``c_`` operands of `_write_critical_row` (keyword arguments of a
    kernel that writes critical rows) for the step's `windows` and `heavy` columns a head."""
    sink, local, dense, middle, short, count = windows
    batch, n_sink, n_local = sink.shape[0], sink.shape[1], local.shape[1]
    out = torch.empty(batch, heads, n_sink + heavy + n_local, dtype=torch.int32, device=sink.device)
    # rows may be strided (the windows' slices of one buffer); each row's entries must be adjacent
    sink, local, dense, middle, short = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (sink, local, dense, middle, short))
    short = short.view(torch.uint8) if short.dtype == torch.bool else short
    return out, dict(
        c_sink_ptr=sink, c_local_ptr=local, c_dense_ptr=dense, c_middle_ptr=middle, c_short_ptr=short, c_out_ptr=out,
        c_count_ptr=out if count is None else count, c_sb=sink.stride(0), c_lb=local.stride(0),
        c_db=dense.stride(0), c_mb=middle.stride(0), c_ob=out.stride(0), c_oh=out.stride(1),
        C_SINK=n_sink, C_HEAVY=heavy, C_LOCAL=n_local, C_SINK_P=max(1, triton.next_power_of_2(n_sink)),
        C_HEAVY_P=max(1, triton.next_power_of_2(heavy)), C_LOCAL_P=max(1, triton.next_power_of_2(n_local)),
        C_COUNT=count is not None)


def no_critical(placeholder: torch.Tensor) -> dict:
    """The ``c_`` operands of a launch that writes no critical rows (never read)."""
    return dict(c_sink_ptr=placeholder, c_local_ptr=placeholder, c_dense_ptr=placeholder, c_middle_ptr=placeholder,
                c_short_ptr=placeholder, c_out_ptr=placeholder, c_count_ptr=placeholder, c_sb=0, c_lb=0,
                c_db=0, c_mb=0, c_ob=0, c_oh=0, C_SINK=1, C_HEAVY=1, C_LOCAL=1, C_SINK_P=1, C_HEAVY_P=1, C_LOCAL_P=1,
                C_COUNT=False)


def critical_indices_triton(heavy: torch.Tensor, sink: torch.Tensor, local: torch.Tensor, dense: torch.Tensor,
                            middle: torch.Tensor, short: torch.Tensor, count: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Same contract as `critical_indices.critical_indices`, returning int32 indices."""
    batch, heads, n_heavy = heavy.shape
    out, critical = critical_arguments(CriticalWindows(sink, local, dense, middle, short, count), heads, n_heavy)
    heavy = heavy if heavy.stride(-1) == 1 else heavy.contiguous()
    _critical_indices[(batch * heads,)](heavy, heavy.stride(0), heavy.stride(1), HEADS=heads, **critical,
                                        **pdl_options(out.device))
    return out
