"""Triton critical indices: one launch per decode step and layer instead of eight small kernels.

Twin of `critical_indices.critical_indices_torch`. Program (row, selection head) writes its N_c
indices: sink | heavy still in the middle window | local, or the row's first N_c valid columns for
a short row; int32 (what the gather kernel reads). With a work counter it also adds the valid
indices to it (one atomic add per program instead of a reduction kernel per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .dependent_launch import pdl_options, wait_for_previous_kernel


@triton.jit
def _critical_indices(
    heavy_ptr, sink_ptr, local_ptr, dense_ptr, middle_ptr, short_ptr, out_ptr, count_ptr, n,
    s_hb, s_hh, s_sb, s_lb, s_db, s_mb, s_ob, s_oh,
    HEADS: tl.constexpr, SINK: tl.constexpr, HEAVY: tl.constexpr, LOCAL: tl.constexpr,
    SINK_P: tl.constexpr, HEAVY_P: tl.constexpr, LOCAL_P: tl.constexpr, COUNT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    row = (pid // HEADS).to(tl.int64)
    head = pid % HEADS
    short = tl.load(short_ptr + row) != 0
    out = out_ptr + row * s_ob + head * s_oh
    dense = dense_ptr + row * s_db

    s = tl.arange(0, SINK_P)
    s_ok = s < SINK
    sink = tl.load(sink_ptr + row * s_sb + s, mask=s_ok, other=-1)
    sink = tl.where(short, tl.load(dense + s, mask=s_ok, other=-1), sink)
    tl.store(out + s, sink.to(tl.int32), mask=s_ok)

    k = tl.arange(0, HEAVY_P)
    k_ok = k < HEAVY
    heavy = tl.load(heavy_ptr + row * s_hb + head * s_hh + k, mask=k_ok, other=-1)
    in_range = (heavy >= 0) & (heavy < n)
    still = tl.load(middle_ptr + row * s_mb + tl.where(in_range, heavy, 0), mask=k_ok & in_range, other=0) != 0
    heavy = tl.where(still, heavy, -1)
    heavy = tl.where(short, tl.load(dense + SINK + k, mask=k_ok, other=-1), heavy)
    tl.store(out + SINK + k, heavy.to(tl.int32), mask=k_ok)

    j = tl.arange(0, LOCAL_P)
    j_ok = j < LOCAL
    local = tl.load(local_ptr + row * s_lb + j, mask=j_ok, other=-1)
    local = tl.where(short, tl.load(dense + SINK + HEAVY + j, mask=j_ok, other=-1), local)
    tl.store(out + SINK + HEAVY + j, local.to(tl.int32), mask=j_ok)
    if COUNT:  # the valid indices of this (row, head), added to the work counter (integer: order-free)
        valid = tl.sum((s_ok & (sink >= 0)).to(tl.int64), 0) + tl.sum((k_ok & (heavy >= 0)).to(tl.int64), 0) \
            + tl.sum((j_ok & (local >= 0)).to(tl.int64), 0)
        tl.atomic_add(count_ptr, valid)


def critical_indices_triton(heavy: torch.Tensor, sink: torch.Tensor, local: torch.Tensor, dense: torch.Tensor,
                            middle: torch.Tensor, short: torch.Tensor, count: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Same contract as `critical_indices.critical_indices`, returning int32 indices."""
    batch, heads, n_heavy = heavy.shape
    n_sink, n_local = sink.shape[1], local.shape[1]
    budget = n_sink + n_heavy + n_local
    out = torch.empty(batch, heads, budget, dtype=torch.int32, device=heavy.device)
    # rows may be strided (the windows' slices of one buffer); each row's entries must be adjacent
    heavy, sink, local, dense, middle, short = (t if t.stride(-1) == 1 else t.contiguous()
                                                for t in (heavy, sink, local, dense, middle, short))
    middle, short = (t.view(torch.uint8) if t.dtype == torch.bool else t for t in (middle, short))
    _critical_indices[(batch * heads,)](
        heavy, sink, local, dense, middle, short, out, out if count is None else count, middle.shape[1],
        heavy.stride(0), heavy.stride(1), sink.stride(0), local.stride(0), dense.stride(0), middle.stride(0),
        out.stride(0), out.stride(1),
        HEADS=heads, SINK=n_sink, HEAVY=n_heavy, LOCAL=n_local,
        SINK_P=max(1, triton.next_power_of_2(n_sink)), HEAVY_P=max(1, triton.next_power_of_2(n_heavy)),
        LOCAL_P=max(1, triton.next_power_of_2(n_local)), COUNT=count is not None, **pdl_options(out.device),
    )
    return out
