"""The weight products of a decode step (``F.linear`` of few rows): cuBLAS or a weight-streaming Triton
product, whichever this GPU runs faster at the shape.

A decode step multiplies a handful of rows by every weight of the model once: each product is bound by
the weight's bytes, and cuBLAS streams the smaller ones (a layer's q, k, v and o projections) well below
the device's bandwidth. `decode_linear_triton` streams a weight in column blocks and K splits
(`LinearTile`).

Which one runs is planned once per (rows, N, K, dtype, device) by timing on the device (`plan_linear`):
cuBLAS and the Triton tiles of `candidate_tiles`, each with the L2 cache flushed before every call (a
decode step reads each weight once, cold), the fastest kept. A shape is never moved to the slower path.
Plans are made only outside CUDA-graph capture (the first, eager step of a kind); a product met first
inside a capture, CPU tensors, float32 / float64 and more than `MAX_ROWS` rows run ``F.linear``, the
twin `decode_linear_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dispatch import use_triton

MAX_ROWS = 16  # rows of one Triton program's tile (tl.dot's smallest M)
_TRITON_DTYPES = (torch.bfloat16, torch.float16)  # float32 would go through TF32 in tl.dot: cuBLAS keeps it


@dataclass(frozen=True)
class LinearTile:
    """A launch configuration of `decode_linear_triton`: output columns per program, the K chunk of one
    load, the number of K splits, warps and pipeline stages."""

    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearTile.{name}={value} must be a power of two >= 16")
        if self.split < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"LinearTile {self} needs split, num_warps and num_stages >= 1")


def candidate_tiles(n: int, k: int, sms: int) -> list[LinearTile]:
    """The Triton tiles a plan times for an ``[rows, k] x [n, k]^T`` product on a GPU of `sms`
    multiprocessors: column blocks of 32 (K chunks of 512) and of 64 (chunks of 128), each split over K
    so that a product of fewer column blocks than multiprocessors launches about two waves."""
    tiles = []
    for block_n, block_k in ((32, 512), (64, 128)):
        blocks = -(-n // block_n)
        split = 1 if blocks >= sms else min(8, max(1, round(2 * sms / blocks)))
        while split > 1 and -(-k // split) < block_k:  # every split at least one chunk
            split -= 1
        tiles.append(LinearTile(block_n, block_k, split))
    return tiles


_PLANS: dict[tuple, LinearTile | None] = {}  # (rows, N, K, dtype, device) -> the Triton tile, or None: cuBLAS


def plan_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearTile | None:
    """The path of an ``x [..., K] x weight [N, K]^T`` product: a Triton tile, or None (cuBLAS). Timed once
    per (rows, N, K, dtype, device) outside capture; inside a capture an unplanned shape gets cuBLAS."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (use_triton(x) and x.is_cuda and x.dtype in _TRITON_DTYPES and weight.dtype == x.dtype
            and 0 < rows <= MAX_ROWS and weight.stride(-1) == 1):
        return None
    key = (rows, weight.shape[0], weight.shape[1], x.dtype, x.device)
    if key not in _PLANS:
        if torch.cuda.is_current_stream_capturing():
            return None
        _PLANS[key] = _fastest(x, weight, bias)
    return _PLANS[key]


def _fastest(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearTile | None:
    """Time cuBLAS and each candidate tile on these operands, cold (triton's ``do_bench`` flushes the L2
    cache before each call); the fastest (cuBLAS on ties)."""
    import triton.testing

    from .decode_linear_triton import decode_linear_triton

    flat = x.reshape(-1, x.shape[-1]).contiguous()
    best, best_ms = None, triton.testing.do_bench(lambda: F.linear(flat, weight, bias), warmup=5, rep=20)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for tile in candidate_tiles(weight.shape[0], weight.shape[1], sms):
        ms = triton.testing.do_bench(lambda: decode_linear_triton(flat, weight, bias, tile), warmup=5, rep=20)
        if ms < best_ms:
            best, best_ms = tile, ms
    return best


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a decode step (contract: `decode_linear_torch`): the planned
    Triton tile where one is faster on this GPU (`plan_linear`), else ``F.linear``."""
    tile = plan_linear(x, weight, bias)
    if tile is None:
        return decode_linear_torch(x, weight, bias)
    from .decode_linear_triton import decode_linear_triton

    return decode_linear_triton(x, weight, bias, tile)


def decode_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T + bias [N]``: ``[..., N]`` in x's dtype (``F.linear``; the twin)."""
    return F.linear(x, weight, bias)
