"""Triton dense decode attention split over the keys (flash-decoding), then merged by LSE.

Twin of `split_decode.split_decode_attention_torch` (same arguments, same results up to float
rounding). Two launches:

1. Program (row x KV head, split): the shared-prefix decode program
   (`prefix_attention_triton.prefix_split_program`) with each row a group of one member (its
   ``MEMBERS_ROW_OF_GROUP``: no members table to make or read), so the
   group's keys are the row's own ``key[b, kv]``, its key mask the row's ``valid[b]``, and its
   folded query rows the G = Hq / Hkv query heads of the KV head: each key and value of the split
   is read once for the whole group (one ``tl.dot`` per key tile). It writes the split's softmax
   unmerged, ``(out, lse)`` fp32 per (row, query head, split).
2. `gather_attention_triton.merge_parts` merges the splits exactly by log-sum-exp.

The split count comes from `plan_split_decode`, a pure function of the shapes and the SM count:
nothing in the launch path reads the device, so a step captured as a CUDA graph replays as is.
"""

from __future__ import annotations

import torch
import triton

from .gather_attention_triton import launch_options, merge_parts, num_sms
from .prefix_attention_triton import prefix_attention_split, new_parts, plan_prefix
from .dependent_launch import pdl_options
from .split_decode import check_split_decode

BLOCK_N = 32  # keys per tile (`benchmarks/split_decode.py --sweep` on the H100)
SPLIT_WAVES = 4  # full waves of programs over the SMs that the split aims for, at most
MIN_SPLIT_KEYS = 256  # no split shorter (rounded to whole tiles): each split has a fixed cost and a state to merge
MAX_SPLITS = 64  # a merge program holds splits x d fp32 states of a query row


def plan_split_decode(batch: int, kv_heads: int, n_keys: int, sms: int, block_n: int = BLOCK_N) -> int:
    """The number of key splits of a ``[B, Hkv, N, d]`` decode step (FlashInfer-style host plan).

    As many splits as keep the ``B x Hkv x splits`` programs within `SPLIT_WAVES` full waves over
    `sms` SMs (one split where the (row, KV head) programs alone fill them), but no split shorter
    than `MIN_SPLIT_KEYS` keys and at most `MAX_SPLITS`; each split holds the same whole number of
    `block_n`-key tiles (the last one fewer) and none is empty. A pure function of shapes: it reads
    nothing from the device, so a step replayed as a CUDA graph never depends on data."""
    tiles = max(1, triton.cdiv(n_keys, block_n))
    most = max(1, min(tiles // max(1, MIN_SPLIT_KEYS // block_n), MAX_SPLITS))
    wanted = min(most, max(1, SPLIT_WAVES * sms // max(1, batch * kv_heads)))
    return triton.cdiv(tiles, triton.cdiv(tiles, wanted))


def split_decode_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  valid: torch.Tensor | None, scale: float, *, return_lse: bool = False,
                                  block_n: int = BLOCK_N, splits: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None):
    """Same contract as `split_decode.split_decode_attention_torch` (see there); fp16, bf16 and fp32;
    head dims 16..256 (powers of two), a unit stride on d. The keyword-only arguments after
    `return_lse` override the launch configuration (tests, benchmark sweeps)."""
    batch, _, kv_heads, _ = check_split_decode(query, key, value, valid)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"key strides {key.stride()} and value strides {value.stride()}; accepted: any strides "
                         f"with a unit stride on d")
    splits = splits or plan_split_decode(batch, kv_heads, key.shape[2], num_sms(query.device), block_n)
    if valid is not None and valid.stride(-1) != 1:
        valid = valid.contiguous()
    launch = plan_prefix(query, key, value, scale, None, valid, block_n=block_n, splits=splits, row_groups=True)
    part_out, part_lse = new_parts(query, launch.num_splits, empty=False)  # every row is in its own group
    # three stages of K/V tiles for rows of <= 256 bytes (16-bit, d <= 128), two beyond: shared memory
    stages = num_stages or (3 if query.shape[-1] * query.element_size() <= 256 else 2)
    prefix_attention_split[launch.grid](
        *launch.tensors, part_out, part_lse, *launch.scalars, launch.num_splits, *launch.strides,
        **launch.constexprs, **launch_options(num_warps, stages if query.is_cuda else None),
        **pdl_options(part_out.device),
    )
    out, lse = merge_parts(query, part_out, part_lse, None)
    return (out, lse) if return_lse else out

