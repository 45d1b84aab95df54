"""The weight products of a decode step (`kernels.decode_linear`, `hshare.weight_products`).

The Triton product against a float64 ``F.linear`` (interpreted on CPU, compiled on a GPU), the tiles a
plan times, the plan's refusals, and the routing of ``torch.nn.Linear`` inside recorded steps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hshare import weight_products
from hshare.kernels import decode_linear as dl
from conftest import VOCAB, tiny_llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_available(), reason="no triton, or no GPU and TRITON_INTERPRET is not set")
@pytest.mark.parametrize("rows,n,k,tile", [
    (1, 40, 100, dl.LinearTile(32, 64, 1)),
    (4, 130, 300, dl.LinearTile(32, 64, 3)),  # columns past the last block, K past the last chunk, 3 splits
    (16, 64, 1000, dl.LinearTile(64, 128, 4)),
    (3, 33, 17, dl.LinearTile(32, 16, 2)),  # the second split holds one partial chunk
    (7, 96, 256, dl.LinearTile(32, 128, 5)),  # more splits than chunks: the launch takes one a chunk
])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_product_matches_float64(rows, n, k, tile, bias):
    from hshare.kernels.decode_linear_triton import decode_linear_triton

    gen = torch.Generator().manual_seed(rows * n + k)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(rows, 1, k, generator=gen).to(DEVICE, dtype)  # [B, 1, K], as a decode step calls it
    weight = torch.randn(n, k, generator=gen).to(DEVICE, dtype) / k ** 0.5
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    got = decode_linear_triton(x, weight, b, tile)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.shape == (rows, 1, n) and got.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not _triton_available(), reason="no triton, or no GPU and TRITON_INTERPRET is not set")
def test_triton_product_refuses_more_rows_than_a_tile():
    from hshare.kernels.decode_linear_triton import decode_linear_triton

    x = torch.randn(dl.MAX_ROWS + 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="at most 16 rows"):
        decode_linear_triton(x, torch.randn(16, 32, device=DEVICE), None, dl.LinearTile(32, 32, 1))


@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 4096), (4096, 14336), (14336, 4096), (128256, 4096), (96, 64)])
@pytest.mark.parametrize("sms", [1, 132])
def test_candidate_tiles_cover_the_device_and_keep_a_chunk_per_split(n, k, sms):
    for tile in dl.candidate_tiles(n, k, sms):
        blocks = -(-n // tile.block_n)
        assert 1 <= tile.split <= 8 and -(-k // tile.split) >= min(tile.block_k, k)
        if blocks >= sms:
            assert tile.split == 1  # a wave of column blocks already: no partials to sum
        elif tile.split < 8 and -(-k // (tile.split + 1)) >= tile.block_k:
            assert blocks * tile.split >= sms  # split until the programs fill the device


def test_plans_are_cublas_off_the_gpu_and_for_what_the_kernel_does_not_take():
    weight = torch.randn(48, 32)
    for x in (torch.randn(4, 1, 32), torch.randn(4, 1, 32, dtype=torch.float64), torch.randn(17, 32)):
        assert dl.plan_linear(x, weight.to(x.dtype), None) is None
    x, b = torch.randn(3, 1, 32), torch.randn(48)
    assert torch.equal(dl.decode_linear(x, weight, b), F.linear(x, weight, b))
    assert torch.equal(torch.ops.hshare.decode_linear(x, weight, b), F.linear(x, weight, b))


def test_routed_swaps_every_linear_and_restores():
    model = tiny_llama(layers=2)
    ids = torch.randint(3, VOCAB, (2, 9))
    original = torch.nn.Linear.forward
    calls = []
    with torch.no_grad():
        reference = model(ids).logits
        real = weight_products.decode_linear
        try:
            weight_products.decode_linear = lambda *args: calls.append(args[1].shape) or real(*args)
            with weight_products.routed():
                assert torch.nn.Linear.forward is not original
                routed = model(ids).logits
        finally:
            weight_products.decode_linear = real
    assert torch.nn.Linear.forward is original
    assert torch.equal(routed, reference)  # on CPU every product is F.linear
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(calls) == sorted(m.weight.shape for m in linears)  # each linear layer once, the LM head included
    with pytest.raises(RuntimeError), weight_products.routed():
        raise RuntimeError("a failing step")
    assert torch.nn.Linear.forward is original


@pytest.mark.slow  # inductor compiles the MLP with the routed op inside (C++ compiler on the CPU)
def test_compiled_mlp_keeps_the_routed_product_whole():
    from hshare.elementwise_fusion import ElementwiseFusion

    model = tiny_llama(layers=2)
    fusion = ElementwiseFusion(model)
    with weight_products.routed():
        assert fusion.warm_up(rows=2) is None
    ids = torch.randint(3, VOCAB, (2, 11))
    with torch.no_grad():
        reference = model(ids).logits
        with fusion.active(), weight_products.routed():
            fused = model(ids).logits
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
