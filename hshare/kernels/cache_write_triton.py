"""Triton twin of `cache_write.write_kv_column_torch`: one launch writes a decode token's key and value.

Program (row b, head block): loads the column from the device (nothing read on the host, so a
captured step replays as is), then copies `HEADS_PER_PROGRAM` heads' ``d`` entries of the key and of
the value into the storages at that column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_write import check_kv_column
from .dependent_launch import pdl_options, wait_for_previous_kernel

HEADS_PER_PROGRAM = 8  # heads one program copies (their keys and values: a few KiB at d = 128)


@triton.jit
def _write_kv_column(
    ks_ptr, vs_ptr, column_ptr, k_ptr, v_ptr, heads,
    s_ksb, s_ksh, s_ksn, s_ksd, s_vsb, s_vsh, s_vsn, s_vsd, s_kb, s_kh, s_kd, s_vb, s_vh, s_vd,
    DIM: tl.constexpr, DIM_PAD: tl.constexpr, HEADS_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    dims = tl.arange(0, DIM_PAD)
    ok = (head < heads)[:, None] & (dims < DIM)[None, :]
    h = head.to(tl.int64)[:, None]
    column = tl.load(column_ptr)
    d = dims[None, :]
    k = tl.load(k_ptr + b * s_kb + h * s_kh + d * s_kd, mask=ok)
    v = tl.load(v_ptr + b * s_vb + h * s_vh + d * s_vd, mask=ok)
    tl.store(ks_ptr + b * s_ksb + h * s_ksh + column * s_ksn + d * s_ksd, k, mask=ok)
    tl.store(vs_ptr + b * s_vsb + h * s_vsh + column * s_vsn + d * s_vsd, v, mask=ok)


def write_kv_column_triton(key_storage: torch.Tensor, value_storage: torch.Tensor, column: torch.Tensor,
                           key: torch.Tensor, value: torch.Tensor) -> None:
    """Same contract as `cache_write.write_kv_column_torch` (see there)."""
    check_kv_column(key_storage, value_storage, column, key, value)
    batch, heads, _, dim = key_storage.shape
    block = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
    _write_kv_column[(batch, triton.cdiv(heads, block))](
        key_storage, value_storage, column, key, value, heads,
        *key_storage.stride(), *value_storage.stride(), *key.stride()[:2], key.stride(3), *value.stride()[:2],
        value.stride(3),
        DIM=dim, DIM_PAD=triton.next_power_of_2(dim), HEADS_BLOCK=block, **pdl_options(key_storage.device),
    )
