"""Exact merge of partial attention results by log-sum-exp (Hydragen section 3, FlashDecoding).

Attention over K = K1 || K2 equals ``(o1 e^{l1} + o2 e^{l2}) / (e^{l1} + e^{l2})`` where o_i is the
softmax-normalised output over K_i and l_i its natural-log LSE. The merged LSE is returned so that
merges chain (several prefix levels, a sparse part and a dense part). A part over no key has
``l = -inf``; two empty parts give ``o = 0``, ``l = -inf`` and never NaN.
"""

from __future__ import annotations

import torch


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results.

    Args:
        out_a, out_b: ``[..., d]`` partial outputs (any float dtype).
        lse_a, lse_b: ``[...]`` natural-log LSE of the logits each part saw (fp32/fp64; -inf = empty).

    Returns:
        ``(out [..., d] in out_a's dtype, lse [...] fp32 or fp64)``.
    """
    acc = torch.float64 if lse_a.dtype == torch.float64 else torch.float32
    lse_a = lse_a.to(acc)
    lse_b = lse_b.to(acc)
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # both empty: no inf - inf
    weight_a = torch.exp(lse_a - top)
    weight_b = torch.exp(lse_b - top)
    total = weight_a + weight_b
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a.to(acc) * weight_a[..., None] + out_b.to(acc) * weight_b[..., None]) / safe_total[..., None]
    lse = top + torch.log(total)  # log(0) = -inf for two empty parts
    return out.to(out_a.dtype), lse
