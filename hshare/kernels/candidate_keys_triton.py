"""Triton candidate refinement by exact logits: the twin of `candidate_keys.candidate_key_topk_torch`.

Two launches:

1. `_candidate_key_scores`, a program per (row-head, tile of `TILE_C` candidates): it sums the decode query over
   the KV head's query group (fp32), reads its candidates' key rows (each row whole: coalesced), scores them
   (``q . k`` in fp32) and writes their order-preserving int32 keys (`key_search_triton._score_key`; INT32_MIN:
   no candidate, outside the row's window or a non-finite logit) to the row-head's slots of a scratch buffer. One tile a
   program and few registers: many programs an SM keep the gathers in flight (the tile chosen with
   `benchmarks/candidate_timing.py --key-tiles`).
2. `label_topk_triton.top_scored`, a program per row-head: its C keys from the scratch (L2) and the columns of its
   top `heavy` in candidate order (the label candidate top-k's program and search, reading the keys).

Bytes: each candidate's key row once, 4 bytes of scratch written and read; the candidates' columns
twice. Sized on the host from shapes only, so the launches are CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .key_search_triton import _score_key
from .critical_indices import CriticalWindows, with_critical
from .label_topk_triton import (MAX_CANDIDATES, _candidate_columns, _window, candidate_slots, index_operands,
                                top_scored, window_operand)
from .dependent_launch import pdl_options, wait_for_previous_kernel

TILE_C = 64  # candidates (key rows) a scoring program scores


@triton.jit
def _candidate_key_scores(
    query_ptr, key_ptr, rows_ptr, heads_ptr, window_ptr, cand_ptr, scratch_ptr, n, candidates,
    s_qb, s_qh, s_kb, s_kh, s_kn, s_hb, s_ca, s_ch,
    HEADS: tl.constexpr, ROWS_INDEXED: tl.constexpr, HEADS_INDEXED: tl.constexpr, GROUP: tl.constexpr,
    DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, TILE_C_: tl.constexpr, C_PAD: tl.constexpr, BY_HEAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (row-head pid, tile): its tile's keys into the scratch ``[A * H', C_PAD]``. BY_HEAD: the candidates
    are every selection head's, the program's head's entry read (else its position among the row's heads)."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    slots = tl.program_id(1) * TILE_C_ + tl.arange(0, TILE_C_)
    i, row, head, _, cols = _candidate_columns(rows_ptr, heads_ptr, cand_ptr, pid, slots, candidates, s_hb, s_ca, s_ch,
                                               HEADS, ROWS_INDEXED, HEADS_INDEXED, BY_HEAD)
    cols = cols.to(tl.int64)
    dims = tl.arange(0, DIM)
    query_row = query_ptr + row * s_qb + (head * GROUP) * s_qh
    q = tl.load(query_row + dims).to(tl.float32)
    for g in tl.static_range(1, GROUP):
        q += tl.load(query_row + g * s_qh + dims).to(tl.float32)
    key_base = key_ptr + row * s_kb + head * s_kh
    scratch_row = scratch_ptr + pid.to(tl.int64) * C_PAD
    present = slots < candidates
    start, end = _window(window_ptr, i, n, HAS_WINDOW)
    inside = present & (cols >= start) & (cols < end)
    k = tl.load(key_base + cols[:, None] * s_kn + dims[None, :], mask=inside[:, None], other=0.0)
    score = tl.sum(k.to(tl.float32) * q[None, :], 1)
    ok = inside & (tl.abs(score) < float("inf"))  # NaN fails the comparison too
    tl.store(scratch_row + slots, tl.where(ok, _score_key(score), -2147483648), mask=present)


def candidate_key_topk_triton(query: torch.Tensor, keys: torch.Tensor, heavy: int, candidates: torch.Tensor,
                              window: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                              heads: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                              num_warps: int | None = None, critical: CriticalWindows | None = None
                              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `candidate_keys.candidate_key_topk` (``C <= MAX_CANDIDATES``; head dims 16..256, powers of
    two; with `critical`, checked there, the columns' int32 critical indices written by the top-k's programs);
    `num_warps` overrides the scoring launch's (tests, benchmark sweeps)."""
    count, width = candidates.shape[0], candidates.shape[-1]
    batch, q_heads, dim = query.shape
    by_head = out is not None
    n_heads = heads.shape[-1] if by_head else candidates.shape[1]
    if by_head and (out.shape != (count, candidates.shape[1], heavy) or out.dtype != torch.int64):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}; accepted: int64 {(count, candidates.shape[1], heavy)} "
                         "(every selection head's entries)")
    if dim & (dim - 1) or not 16 <= dim <= 256 or keys.stride(-1) != 1:
        raise ValueError(f"keys {tuple(keys.shape)} with strides {keys.stride()}; accepted: head_dim 16..256, a "
                         "power of two, and a unit stride on d")
    if width > MAX_CANDIDATES:
        raise ValueError(f"{width} candidates per head; accepted: at most {MAX_CANDIDATES} (the torch twin takes more)")
    if not by_head:
        out = torch.empty(count, n_heads, heavy, dtype=torch.int64, device=keys.device)
    if heavy == 0 or count * n_heads == 0:
        return with_critical(out, critical)
    query = query if query.stride(-1) == 1 else query.contiguous()
    candidates = candidates if candidates.stride(-1) == 1 else candidates.contiguous()
    rows, heads, _, s_hb, _, flags = index_operands(rows, heads, None, count, keys)
    window, has_window = window_operand(window, count, keys)
    pad = candidate_slots(width)
    programs = count * n_heads
    scratch = torch.empty(programs, pad, dtype=torch.int32, device=keys.device)
    shape = dict(HEADS=n_heads, HEADS_INDEXED=flags["HEADS_INDEXED"], C_PAD=pad, BY_HEAD=by_head)
    _candidate_key_scores[(programs, triton.cdiv(width, TILE_C))](
        query, keys, rows, heads, window, candidates, scratch, keys.shape[2], width, query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), s_hb, candidates.stride(0), candidates.stride(1),
        ROWS_INDEXED=flags["ROWS_INDEXED"], GROUP=q_heads // keys.shape[1], DIM=dim, HAS_WINDOW=has_window,
        TILE_C_=TILE_C, **shape, num_warps=num_warps or 4, **pdl_options(keys.device),
    )
    indices = top_scored(scratch, candidates, out, heavy, heads, s_hb, n_heads, flags["HEADS_INDEXED"], by_head,
                         critical)
    return out if critical is None else (out, indices)
