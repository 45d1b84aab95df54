"""Decode attention over a shared prefix level and each row's own columns, merged exactly by LSE
(Hydragen section 3 with HShare's sparse own part).

`shared_decode_attention` dispatches (`dispatch.use_triton`): CUDA tensors go to one Triton launch
(`shared_decode_triton`: the prefix level's programs beside the own part's gather programs, then one
merge), everything else to the plain-PyTorch twin `shared_decode_attention_torch` (the CPU path and
the test oracle): the level's attention (`shared_prefix_attention`) merged into gather-attention.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import use_triton
from .gather_attention import gather_attention_torch
from .prefix_attention import shared_prefix_attention


class PrefixKV(NamedTuple):
    """One prefix level of one layer, as `shared_prefix_attention` takes it.

    keys, values: ``[G, Hkv, L, d]``; members ``[G, M]`` / row_slot ``[B]`` (None: one group of every
    row in order); key_valid ``[G, L]`` bool or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    members: torch.Tensor | None = None
    row_slot: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None


def shared_decode_attention(query: torch.Tensor, prefix: PrefixKV, keys: torch.Tensor, values: torch.Tensor,
                            indices: torch.Tensor, scale: float,
                            partial: tuple[torch.Tensor, torch.Tensor] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention (contract: `shared_decode_attention_torch`); one Triton launch for CUDA tensors."""
    if use_triton(query):
        from .shared_decode_triton import shared_decode_attention_triton

        return shared_decode_attention_triton(query, prefix.keys, prefix.values, prefix.members, prefix.key_valid,
                                              keys, values, indices, scale, partial)
    return shared_decode_attention_torch(query, prefix, keys, values, indices, scale, partial)


def shared_decode_attention_torch(query: torch.Tensor, prefix: PrefixKV, keys: torch.Tensor, values: torch.Tensor,
                                  indices: torch.Tensor, scale: float,
                                  partial: tuple[torch.Tensor, torch.Tensor] | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per row and head over its group's prefix keys and its own selected columns.

    Args:
        query: ``[B, Hq, d]``.
        prefix: the level (`PrefixKV`).
        keys, values, indices, scale: the own part, as in `gather_attention_torch` (``indices``
            ``[B, H_sel, N_c]``, ``-1`` = no token).
        partial: optional ``(out [B, Hq, S, d], lse [B, Hq, S])`` unmerged states over other keys
            (further prefix levels).

    Returns:
        ``(out [B, Hq, d] in query's dtype, lse [B, Hq] fp32, fp64 for fp64 inputs)``; a head with
        no key anywhere gets ``out = 0``, ``lse = -inf``.
    """
    out, lse = shared_prefix_attention(query[:, :, None], prefix.keys, prefix.values, scale, prefix.members,
                                       prefix.row_slot, prefix.key_valid)  # [B, Hq, 1, d]: one state
    states = (out.to(lse.dtype), lse)
    if partial is not None:
        states = (torch.cat((states[0], partial[0].to(lse.dtype)), dim=2), torch.cat((states[1], partial[1]), dim=2))
    return gather_attention_torch(query, keys, values, indices, scale, states)
