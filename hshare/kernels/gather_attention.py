"""Sparse decode attention over selected token indices, with its natural-log LSE.

One decode query per row and query head attends to the N_c critical tokens of its *selection
head*. With ``H_sel = Hkv`` (selection per KV head) the g = Hq / Hkv query heads of a group share
one gathered set, so each gathered key/value row is read once; with ``H_sel = Hq`` (per query
head) every query head has its own set from its KV head.

`gather_attention` dispatches (`dispatch.use_triton`): CUDA tensors go to the Triton kernel
(`gather_attention_triton`), everything else to the plain-PyTorch twin `gather_attention_torch`
(the CPU path and the test oracle).
"""

from __future__ import annotations

import torch

from .dispatch import use_triton
from .merge import merge_attention_splits


def gather_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                     scale: float, partial: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode attention (contract: `gather_attention_torch`); Triton for CUDA tensors."""
    if use_triton(query):
        from .gather_attention_triton import gather_attention_triton

        return gather_attention_triton(query, keys, values, indices, scale, partial)
    return gather_attention_torch(query, keys, values, indices, scale, partial)


def gather_attention_torch(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                     scale: float, partial: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per head over gathered key/value rows.

    Args:
        query: ``[B, Hq, d]``.
        keys, values: ``[B, Hkv, n, d]``, any strides (the cache's own buffer views).
        indices: ``[B, H_sel, N_c]`` integer token columns in ``[0, n)``; ``-1`` = no token
            (padding, a short row): never read. ``H_sel`` is Hkv or Hq.
        scale: softmax scale (the module's ``scaling``).
        partial: optional ``(out [B, Hq, S, d], lse [B, Hq, S])``, S >= 1 unmerged partial states
            over other keys (a shared prefix: its key splits and levels) to merge exactly with this
            part (an empty one has ``lse = -inf``).

    Returns:
        ``(out [B, Hq, d] in query's dtype, lse [B, Hq] fp32, fp64 for fp64 inputs)``. A head with no
        valid index gets ``out = 0`` and ``lse = -inf`` (never NaN).
    """
    batch, q_heads, dim = query.shape
    kv_heads = keys.shape[1]
    sel_heads = indices.shape[1]
    if sel_heads not in (kv_heads, q_heads) or q_heads % sel_heads:
        raise ValueError(f"indices have {sel_heads} heads; accepted: Hkv = {kv_heads} or Hq = {q_heads}")
    per_sel = q_heads // sel_heads  # query heads that read one selection head's set
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32

    valid = indices >= 0
    cols = indices.clamp(min=0).long()
    rows = torch.arange(batch, device=query.device)[:, None, None]
    kv_of_sel = (torch.arange(sel_heads, device=query.device) * kv_heads // sel_heads)[None, :, None]
    k_sel = keys[rows, kv_of_sel, cols]  # [B, H_sel, N_c, d]
    v_sel = values[rows, kv_of_sel, cols]

    q = query.reshape(batch, sel_heads, per_sel, dim).to(acc)
    logits = (q @ k_sel.to(acc).transpose(-1, -2)) * scale  # [B, H_sel, per_sel, N_c]
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # -inf where no valid index
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - safe_lse[..., None])  # exp(-inf) = 0 for masked entries
    out = probs @ v_sel.to(acc)
    out = out.reshape(batch, q_heads, dim)
    lse = lse.reshape(batch, q_heads)
    if partial is not None:
        out, lse = merge_attention_splits(torch.cat((partial[0].to(acc), out[:, :, None]), dim=2),
                                          torch.cat((partial[1].to(acc), lse[:, :, None]), dim=2))
    return out.to(query.dtype), lse
