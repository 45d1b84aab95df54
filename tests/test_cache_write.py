"""`write_kv_column`: the Triton kernel (CPU: TRITON_INTERPRET=1) and its torch twin against a
column assigned by hand, on storage views and token views of any strides."""

from __future__ import annotations

import pytest
import torch

from hshare.kernels import write_kv_column, write_kv_column_torch

triton = pytest.importorskip("triton")  # conftest selects the interpreter on machines without a GPU

from hshare.kernels.cache_write_triton import HEADS_PER_PROGRAM, write_kv_column_triton  # noqa: E402

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(batch, heads, capacity, dim, dtype, seed):
    """Storages ``[B, H, N, d]`` (the value's a transposed-layout view, as a tokens-last buffer
    exposes it) and a token ``[B, H, 1, d]`` made as attention makes it: a transposed view of
    ``[B, 1, H, d]``."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, capacity, dim, generator=generator).to(DEVICE, dtype)
    values = torch.randn(batch, heads, dim, capacity, generator=generator).to(DEVICE, dtype).transpose(2, 3)
    key = torch.randn(batch, 1, heads, dim, generator=generator).to(DEVICE, dtype).transpose(1, 2)
    value = torch.randn(batch, 1, heads, dim, generator=generator).to(DEVICE, dtype).transpose(1, 2)
    column = torch.randint(0, capacity, (1,), generator=generator).to(DEVICE)
    return keys, values, column, key, value


@pytest.mark.parametrize("write", [write_kv_column_torch, write_kv_column_triton, write_kv_column],
                         ids=["twin", "triton", "dispatch"])
@pytest.mark.parametrize("batch,heads,dim,dtype", [(1, 1, 16, torch.float32), (3, 8, 64, torch.bfloat16),
                                                   (2, HEADS_PER_PROGRAM + 3, 40, torch.float16)])
def test_writes_the_column_and_nothing_else(write, batch, heads, dim, dtype):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    keys, values, column, key, value = random_case(batch, heads, 7, dim, dtype, seed)
    want_keys, want_values = keys.clone(), values.clone()
    at = int(column)
    want_keys[:, :, at] = key[:, :, 0]  # by hand
    want_values[:, :, at] = value[:, :, 0]
    write(keys, values, column, key, value)
    assert torch.equal(keys, want_keys), seed
    assert torch.equal(values, want_values), seed


@pytest.mark.parametrize("write", [write_kv_column_torch, write_kv_column_triton], ids=["twin", "triton"])
def test_rejects_what_does_not_fit(write):
    keys, values, column, key, value = random_case(2, 4, 5, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="one dtype"):
        write(keys, values, column, key.half(), value)
    with pytest.raises(ValueError, match=r"\[B, H, 1, d\]"):
        write(keys, values, column, key[:1], value)
    with pytest.raises(ValueError, match="int64"):
        write(keys, values, column.int(), key, value)
