"""A decode token's key and value written into the cache's static storage at one column.

Static-shape decode (`hshare.static_decode`) writes each layer's new key and value at a column held
in a device tensor, so that a captured step writes where the replayed step is. Two ``index_copy_``
calls are two launches a layer; the Triton kernel (`cache_write_triton.write_kv_column_triton`)
writes both in one.

`write_kv_column` dispatches (`dispatch.use_triton`): CUDA tensors go to the Triton kernel,
everything else to the twin `write_kv_column_torch` (the CPU path and the test oracle).
"""

from __future__ import annotations

import torch

from .dispatch import use_triton


def write_kv_column(key_storage: torch.Tensor, value_storage: torch.Tensor, column: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor) -> None:
    """Write the token (contract: `write_kv_column_torch`); Triton for CUDA tensors."""
    if use_triton(key):
        from .cache_write_triton import write_kv_column_triton

        write_kv_column_triton(key_storage, value_storage, column, key, value)
    else:
        write_kv_column_torch(key_storage, value_storage, column, key, value)


def write_kv_column_torch(key_storage: torch.Tensor, value_storage: torch.Tensor, column: torch.Tensor,
                          key: torch.Tensor, value: torch.Tensor) -> None:
    """``key_storage[:, :, column] = key`` and ``value_storage[:, :, column] = value``, in place.

    Args:
        key_storage, value_storage: ``[B, H, N, d]``, any strides.
        column: ``[1]`` int64 on the storage's device, in ``[0, N)``.
        key, value: ``[B, H, 1, d]`` of the storage's dtype, any strides.
    """
    check_kv_column(key_storage, value_storage, column, key, value)
    key_storage.index_copy_(2, column, key)
    value_storage.index_copy_(2, column, value)


def check_kv_column(key_storage: torch.Tensor, value_storage: torch.Tensor, column: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor) -> None:
    """Check the contract of `write_kv_column_torch`; ValueError naming what does not fit."""
    batch, heads, _, dim = key_storage.shape
    if value_storage.shape != key_storage.shape or key.shape != (batch, heads, 1, dim) or value.shape != key.shape:
        raise ValueError(f"storages {tuple(key_storage.shape)} / {tuple(value_storage.shape)} and token "
                         f"{tuple(key.shape)} / {tuple(value.shape)}; accepted: storages [B, H, N, d] of one shape, "
                         f"key and value [B, H, 1, d] = [{batch}, {heads}, 1, {dim}]")
    if {key.dtype, value.dtype, value_storage.dtype} != {key_storage.dtype}:
        raise ValueError(f"storages {key_storage.dtype} / {value_storage.dtype}, token {key.dtype} / {value.dtype}; "
                         f"accepted: one dtype")
    if column.shape != (1,) or column.dtype != torch.long:
        raise ValueError(f"column is {column.dtype} {tuple(column.shape)}; accepted: int64 [1]")
