"""Exact merge of partial attention results by log-sum-exp (Hydragen section 3, FlashDecoding).

Attention over K = K1 || K2 equals ``(o1 e^{l1} + o2 e^{l2}) / (e^{l1} + e^{l2})`` where o_i is the
softmax-normalised output over K_i and l_i its natural-log LSE. The merged LSE is returned so that
merges chain (several prefix levels, a sparse part and a dense part). A part over no key has
``l = -inf``; two empty parts give ``o = 0``, ``l = -inf`` and never NaN.
"""

from __future__ import annotations

import torch


def merge_attention_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attention results over disjoint key sets.

    Args:
        out: ``[..., S, d]`` partial outputs (any float dtype; ignored where the part is empty).
        lse: ``[..., S]`` natural-log LSE of the logits each part saw (fp32/fp64; -inf = empty).

    Returns:
        ``(out [..., d] in out's dtype, lse [...] fp32 or fp64)``.
    """
    acc = torch.float64 if lse.dtype == torch.float64 else torch.float32
    lse = lse.to(acc)
    top = lse.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all parts empty: no inf - inf
    weights = torch.exp(lse - top)  # 0 for an empty part
    total = weights.sum(dim=-1)
    weighted = torch.where(weights[..., None] > 0, out.to(acc) * weights[..., None], torch.zeros((), dtype=acc,
                                                                                                  device=out.device))
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    merged = weighted.sum(dim=-2) / safe_total[..., None]
    return merged.to(out.dtype), top[..., 0] + torch.log(total)  # log(0) = -inf when every part is empty


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results (`merge_attention_splits` with S = 2).

    Args:
        out_a, out_b: ``[..., d]`` partial outputs (any float dtype).
        lse_a, lse_b: ``[...]`` natural-log LSE of the logits each part saw (fp32/fp64; -inf = empty).

    Returns:
        ``(out [..., d] in out_a's dtype, lse [...] fp32 or fp64)``.
    """
    acc = torch.float64 if torch.float64 in (lse_a.dtype, lse_b.dtype) else torch.float32
    out, lse = merge_attention_splits(torch.stack((out_a.to(acc), out_b.to(acc)), dim=-2),
                                      torch.stack((lse_a.to(acc), lse_b.to(acc)), dim=-1))
    return out.to(out_a.dtype), lse
