"""Candidate refinement by exact logits (``SharingConfig.refine_by = "keys"``): each (row, selection head) keeps
the top `heavy` of its candidate columns by ``sum_g q_g . k``, the decode query summed over the KV head's query
group against the column's key, read from the KV cache (C key rows; nothing of width n).

The twin is the label refinement with every channel a label at full precision (`candidate_label_topk_torch`
over the keys themselves); the Triton kernels (`candidate_keys_triton`) read each candidate's key row once,
split over programs, then a program per (row, head) picks its top `heavy`.
"""

from __future__ import annotations

import functools

import torch

from .critical_indices import CriticalWindows, check_critical_refinement, with_critical
from .dispatch import use_triton
from .label_topk import _candidates_fit, candidate_label_topk_torch
from .selection_heads import refine_into


def candidate_key_topk(query: torch.Tensor, keys: torch.Tensor, heavy: int, candidates: torch.Tensor,
                       window: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                       heads: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                       critical: CriticalWindows | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Top-`heavy` of candidate columns by their exact logits.

    Args:
        query: ``[B, Hq, d]`` the decode query of every row.
        keys: ``[B, Hkv, n, d]`` one layer's keys (any strides with a unit stride on d); selection head s is KV
            head s (one selection a KV head), its logits summed over query heads ``[s g, (s + 1) g)``.
        heavy: columns kept; candidates: ``[A, H', C]`` candidate columns per (row, head), negative = none.
        window: ``[A, 2]`` integer, the column bounds of the row's window a candidate must lie in (as
            `candidate_label_topk`'s; None = all).
        rows: ``[A]`` batch rows (None = all); heads: ``[A or 1, H']`` selection heads (None = all).
        out: ``[A, Hkv, heavy]`` int64: then `candidates` are every head's ``[A, Hkv, C]`` and each of the heads
            `heads` (required) refines its own and writes its entries of `out` in place.
        critical: as `candidate_label_topk`'s (the critical indices, written by the top-k's launch on CUDA).

    Returns:
        ``[A, H', heavy]`` int64 (or `out`): the columns of the ``min(heavy, allowed)`` best allowed candidates (in the
        window, finite logit) in candidate order, then ``NO_TOKEN``; among equal logits the earlier
        candidates. CUDA (fp16, bf16, fp32 keys): two Triton launches up to the candidate top-k's ``MAX_CANDIDATES``
        (wider: the twin, with a RuntimeWarning); elsewhere the twin. With `critical`: ``(columns,
        critical.indices(columns))``.
    """
    if out is not None and heads is None:
        raise ValueError("candidate_key_topk: out= refines some heads in place; accepted: heads [A or 1, H'] given")
    if critical is not None:
        check_critical_refinement(rows, candidates.shape[1] if heads is None else heads.shape[-1], candidates.shape[1])
    if query.shape[1] % keys.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} are not a multiple of the keys' heads {keys.shape[1]}")
    if use_triton(keys) and keys.dtype != torch.float64 and heavy > 0 and keys.shape[2] > 0 \
            and _candidates_fit(candidates.shape[-1], False):
        from .candidate_keys_triton import candidate_key_topk_triton

        return candidate_key_topk_triton(query, keys, heavy, candidates, window, rows, heads, out=out,
                                         critical=critical)
    if out is not None:
        columns = refine_into(out, candidates, heads, lambda own: candidate_key_topk_torch(
            query, keys, heavy, own, window, rows, heads))
    else:
        columns = candidate_key_topk_torch(query, keys, heavy, candidates, window, rows, heads)
    return with_critical(columns, critical)


def candidate_key_topk_torch(query: torch.Tensor, keys: torch.Tensor, heavy: int, candidates: torch.Tensor,
                             window: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                             heads: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `candidate_key_topk` (same contract, no `out`): the label refinement's twin over the keys as
    labels of every channel at full precision."""
    channels = every_channel(keys.shape[1], keys.shape[-1], keys.device)
    return candidate_label_topk_torch(query, channels, keys, None, None, 16, heavy, candidates, window, rows,
                                      heads)


@functools.lru_cache(maxsize=None)
def every_channel(heads: int, dim: int, device: torch.device) -> torch.Tensor:
    """``[1, heads, dim]`` int64: every channel of every head (made once per shape and device)."""
    return torch.arange(dim, device=device).repeat(1, heads, 1)
