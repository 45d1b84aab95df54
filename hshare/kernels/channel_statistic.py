"""Heavy-channel statistic of a prompt: per query head and channel, the sum over valid tokens of
``|q_c * k_c|`` (DoubleSparse's channel importance, used to pick the label channels per prompt
when a model has no calibration file, and summed over text by `hshare calibrate`).

`channel_statistic` dispatches (`dispatch.use_triton`): CUDA tensors go to one Triton launch
(`channel_statistic_triton`, which reads the queries and keys once in their own dtype), everything
else to the twin `channel_statistic_torch` (the CPU path and the test oracle).
"""

from __future__ import annotations

import torch

from .dispatch import use_triton

STATISTIC_CHUNK_ELEMENTS = 1 << 24  # float32 elements of one chunk's temporaries in the twin (64 MiB)


def channel_statistic(query: torch.Tensor, keys: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
    """The statistic (contract: `channel_statistic_torch`); Triton for CUDA tensors."""
    if use_triton(query):
        from .channel_statistic_triton import channel_statistic_triton

        return channel_statistic_triton(query, keys, token_valid)
    return channel_statistic_torch(query, keys, token_valid)


def channel_statistic_torch(query: torch.Tensor, keys: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
    """Sum over valid tokens of ``|q_c * k_c|`` per query head.

    Computed over chunks of tokens, so that the float32 temporaries stay near
    `STATISTIC_CHUNK_ELEMENTS` whatever the prompt (a whole Llama-2-7B prefill of 16 x 4096 tokens
    would otherwise make several 1 GiB float32 copies of the queries and keys per layer).

    Args:
        query: ``[B, Hq, T, d]`` post-RoPE queries.
        keys: ``[B, Hkv, T, d]`` post-RoPE keys of the same tokens.
        token_valid: ``[B, T]`` bool.

    Returns:
        ``[B, Hq, d]`` float32.
    """
    batch, q_heads, tokens, dim = query.shape
    kv_heads = keys.shape[1]
    total = torch.zeros(batch, kv_heads, q_heads // kv_heads, dim, dtype=torch.float32, device=query.device)
    chunk = max(1, STATISTIC_CHUNK_ELEMENTS // max(1, batch * q_heads * dim))
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        q = query[:, :, start:end].float().abs().reshape(batch, kv_heads, q_heads // kv_heads, end - start, dim)
        k = keys[:, :, start:end].float().abs() * token_valid[:, None, start:end, None]
        total += (q * k[:, :, None]).sum(3)
    return total.reshape(batch, q_heads, dim)
