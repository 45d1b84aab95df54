"""`hshare.kernels.dense_decode_attention` (a GQA decode query folded onto its KV heads) against a
brute-force softmax over K/V repeated per query head, as transformers' ``repeat_kv`` does."""

from __future__ import annotations

import pytest
import torch

from hshare.kernels import dense_decode_attention


def brute_force(query, key, value, valid, scaling):
    """Per (row, query head): softmax over the valid keys of its KV head, in float64."""
    batch, q_heads, _, dim = query.shape
    groups = q_heads // key.shape[1]
    out = torch.zeros(batch, 1, q_heads, value.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            k, v = key[b, h // groups].double(), value[b, h // groups].double()
            logits = (k @ query[b, h, 0].double()) * scaling
            logits[~valid[b]] = float("-inf")
            out[b, 0, h] = torch.softmax(logits, 0) @ v
    return out


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (6, 1), (32, 8)])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_brute_force(q_heads, kv_heads, mask_kind, dtype):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    batch, n, dim = int(torch.randint(1, 5, (1,), generator=generator)), int(torch.randint(1, 40, (1,), generator=generator)), 16
    query = torch.randn(batch, q_heads, 1, dim, generator=generator, dtype=dtype)
    key = torch.randn(batch, kv_heads, n, dim, generator=generator, dtype=dtype)
    value = torch.randn(batch, kv_heads, n, dim, generator=generator, dtype=dtype)
    valid = torch.rand(batch, n, generator=generator) < 0.7
    valid[:, -1] = True  # the decode token itself is always valid
    if mask_kind == "none":
        valid[:] = True
        mask = None
    elif mask_kind == "bool":
        mask = valid[:, None, None, :]
    else:
        mask = torch.zeros(batch, 1, 1, n + 3, dtype=dtype)  # wider than the keys: sliced like transformers
        mask[:, 0, 0, :n][~valid] = torch.finfo(dtype).min
    out = dense_decode_attention(query, key, value, mask, dim ** -0.5)
    assert out.shape == (batch, 1, q_heads, dim) and out.dtype == dtype
    torch.testing.assert_close(out.double(), brute_force(query, key, value, valid, dim ** -0.5),
                               rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)


def test_refuses_what_it_cannot_compute():
    query, key = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="one query per row"):
        dense_decode_attention(query, key, key, None, 1.0)
    with pytest.raises(ValueError, match="mask shared by the heads"):
        dense_decode_attention(query[:, :, :1], key, key, torch.ones(2, 4, 1, 5, dtype=torch.bool), 1.0)
