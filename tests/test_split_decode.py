"""`split_decode_attention`: the Triton kernel (CPU: TRITON_INTERPRET=1) and its torch twin against
a brute-force softmax per (row, query head) over the row's valid keys, in float64."""

from __future__ import annotations

import pytest
import torch

from hshare.kernels import merge_attention_states
from hshare.kernels.split_decode import split_decode_attention, split_decode_attention_torch

triton = pytest.importorskip("triton")  # conftest selects the interpreter on machines without a GPU

from hshare.kernels.split_decode_triton import BLOCK_N, MAX_SPLITS, MIN_SPLIT_KEYS, SPLIT_WAVES, \
    plan_split_decode, split_decode_attention_triton  # noqa: E402

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3,  # tf32 dot on the GPU
             torch.float16: 5e-3, torch.bfloat16: 2e-2}


def brute_force(query, key, value, valid, scale):
    """``(out [B, Hq, d], lse [B, Hq])`` float64: per (row, query head), softmax over the valid columns."""
    batch, q_heads, dim = query.shape
    group = q_heads // key.shape[1]
    out = torch.zeros(batch, q_heads, dim, dtype=torch.float64)
    lse = torch.full((batch, q_heads), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        cols = valid[b].nonzero()[:, 0].cpu()
        for h in range(q_heads):
            if len(cols) == 0:
                continue
            logits = key[b, h // group].cpu().double()[cols] @ query[b, h].cpu().double() * scale
            lse[b, h] = torch.logsumexp(logits, 0)
            out[b, h] = torch.softmax(logits, 0) @ value[b, h // group].cpu().double()[cols]
    return out, lse


def random_case(batch, q_heads, kv_heads, n, dim, dtype, capacity=None, seed=0):
    """query, key and value views ``[:, :, :n]`` of ``capacity``-column buffers whose unused columns are
    NaN (never read), and left-padded ``valid`` rows of different lengths, the last row without a key."""
    generator = torch.Generator().manual_seed(seed)
    capacity = capacity or n
    query = torch.randn(batch, q_heads, dim, generator=generator).to(DEVICE, dtype)
    storage = torch.randn(2, batch, kv_heads, capacity, dim, generator=generator).to(DEVICE, dtype)
    storage[..., n:, :] = float("nan")
    valid = torch.ones(batch, n, dtype=torch.bool, device=DEVICE)
    for row in range(1, batch):
        valid[row, : row * n // (2 * batch)] = False  # left padding, a different length per row
    if batch > 2:
        valid[-1] = False  # a row with no valid key
    return query, storage[0, :, :, :n], storage[1, :, :, :n], valid


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse).cpu(), empty)
    assert bool((out.cpu()[empty] == 0).all())
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu().double()[~empty], ref_lse[~empty], rtol=tol, atol=tol)


def triton_split(splits, block_n):
    def run(query, key, value, valid, scale, *, return_lse=False):
        return split_decode_attention_triton(query, key, value, valid, scale, return_lse=return_lse, splits=splits,
                                             block_n=block_n)
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2), (8, 2)])  # G = 1, 2, 4
def test_triton_matches_brute_force(dtype, dim, q_heads, kv_heads):
    """Several splits of a few 32-key tiles, N = 150 not a multiple of the tile, strided views."""
    query, key, value, valid = random_case(3, q_heads, kv_heads, 150, dim, dtype, capacity=165)
    out, lse = split_decode_attention_triton(query, key, value, valid, 0.2, return_lse=True, splits=3, block_n=32)
    assert_matches(out, lse, *brute_force(query, key, value, valid, 0.2), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2)])
def test_twin_matches_brute_force(dtype, q_heads, kv_heads):
    query, key, value, valid = random_case(3, q_heads, kv_heads, 90, 64, dtype, capacity=100, seed=1)
    out, lse = split_decode_attention_torch(query, key, value, valid, 0.3, return_lse=True)
    assert_matches(out, lse, *brute_force(query, key, value, valid, 0.3), dtype)


@pytest.mark.parametrize("impl", [split_decode_attention_torch, triton_split(None, 64)], ids=["twin", "triton"])
def test_single_split_default_plan_and_no_mask(impl):
    """The default plan at a short N (one split: shorter than `MIN_SPLIT_KEYS`), valid=None, return_lse off."""
    query, key, value, _ = random_case(2, 4, 2, 70, 64, torch.float32, seed=2)
    assert plan_split_decode(2, 2, 70, 4) == 1
    out = impl(query, key, value, None, 0.125)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 4, 64)
    every = torch.ones(2, 70, dtype=torch.bool, device=DEVICE)
    torch.testing.assert_close(out.cpu().double(), brute_force(query, key, value, every, 0.125)[0],
                               rtol=TOLERANCE[torch.float32], atol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("impl", [split_decode_attention_torch, triton_split(2, 16)], ids=["twin", "triton"])
def test_lse_merges_halves_exactly(impl):
    """Attention over keys [0, N/2) merged with [N/2, N) by their LSE equals attention over all; the
    padded rows' first half is empty (lse = -inf) for the longest padding."""
    query, key, value, valid = random_case(4, 8, 2, 96, 64, torch.float32, capacity=110, seed=3)
    valid[2, :60] = False  # no valid key in the first half
    half = 48
    first = impl(query, key[:, :, :half], value[:, :, :half], valid[:, :half], 0.2, return_lse=True)
    second = impl(query, key[:, :, half:], value[:, :, half:], valid[:, half:], 0.2, return_lse=True)
    assert torch.isneginf(first[1][2]).all()
    out, lse = merge_attention_states(*first, *second)
    assert_matches(out, lse, *brute_force(query, key, value, valid, 0.2), torch.float32)


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_dispatch_follows_hshare_kernels(mode, monkeypatch):
    monkeypatch.setenv("HSHARE_KERNELS", mode)
    query, key, value, valid = random_case(3, 4, 2, 40, 64, torch.bfloat16, seed=4)
    out, lse = split_decode_attention(query, key, value, valid, 0.2, return_lse=True)
    ref_out, ref_lse = brute_force(query, key, value, valid, 0.2)
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)
    alone = split_decode_attention(query, key, value, valid, 0.2)  # without the LSE (the twin: SDPA's arithmetic)
    assert_matches(alone, lse, ref_out, ref_lse, torch.bfloat16)


def test_plan_fills_up_to_several_waves_with_splits_of_whole_tiles():
    sms = 132
    for batch, kv_heads, n_keys in [(1, 8, 4096), (1, 8, 131072), (4, 32, 32768), (16, 8, 32768), (64, 32, 4096),
                                    (1, 1, 100), (2, 8, 1000), (3, 5, 77777)]:
        splits = plan_split_decode(batch, kv_heads, n_keys, sms)
        tiles = triton.cdiv(n_keys, BLOCK_N)
        per_split = triton.cdiv(tiles, splits)
        assert 1 <= splits <= MAX_SPLITS and triton.cdiv(tiles, per_split) == splits  # no empty split
        assert splits == 1 or per_split * BLOCK_N >= MIN_SPLIT_KEYS
        programs = batch * kv_heads * splits
        assert splits == 1 or programs <= SPLIT_WAVES * sms  # no partial wave beyond SPLIT_WAVES
        more = plan_split_decode(batch, kv_heads, n_keys, sms * 64)  # a larger GPU: only length or the cap stop it
        assert more == MAX_SPLITS or triton.cdiv(tiles, more) * BLOCK_N < 2 * MIN_SPLIT_KEYS
    assert plan_split_decode(64, 32, 4096, sms) == 1  # 2048 programs without a split already
    assert plan_split_decode(1, 8, 131072, sms) == MAX_SPLITS
    assert plan_split_decode(1, 8, 131072, sms, block_n=64) == MAX_SPLITS


@pytest.mark.parametrize("impl", [split_decode_attention_torch, split_decode_attention_triton], ids=["twin", "triton"])
def test_refuses_bad_inputs_by_name(impl):
    query, key, value, valid = random_case(2, 4, 2, 20, 64, torch.float32, seed=5)
    with pytest.raises(ValueError, match=r"Hq = 6 heads and key Hkv = 4; accepted: Hq a multiple of Hkv"):
        impl(torch.randn(2, 6, 64, device=DEVICE), torch.cat((key, key), 1), torch.cat((value, value), 1), valid, 0.1)
    with pytest.raises(ValueError, match=r"valid is torch.bool of shape \(2, 19\); accepted: None or bool \[B, N\]"):
        impl(query, key, value, valid[:, :19], 0.1)
    with pytest.raises(ValueError, match=r"accepted: None or bool"):
        impl(query, key, value, valid.float(), 0.1)
    with pytest.raises(ValueError, match=r"query has shape \(2, 4, 1, 64\); accepted: \[B, Hq, d\]"):
        impl(query[:, :, None], key, value, valid, 0.1)
    with pytest.raises(ValueError, match=r"accepted: both \[B, Hkv, N, d\]"):
        impl(query, key, value[:, :, :10], valid, 0.1)


@pytest.mark.skipif(DEVICE != "cuda", reason="default launch plans at real sizes: too slow for the CPU interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 8), (32, 8), (32, 1)])
def test_default_plans_fit_every_dtype_head_dim_and_group(dtype, dim, q_heads, kv_heads):
    """The default tiles, stages and splits compile and fit shared memory (16- and 64-row query tiles)."""
    query, key, value, valid = random_case(3, q_heads, kv_heads, 5000, dim, dtype, capacity=5003, seed=6)
    out, lse = split_decode_attention_triton(query, key, value, valid, dim ** -0.5, return_lse=True)
    ref_out, ref_lse = split_decode_attention_torch(query.double(), key.double(), value.double(), valid, dim ** -0.5,
                                                    return_lse=True)
    assert_matches(out, lse, ref_out.cpu(), ref_lse.cpu(), dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_replays_as_a_cuda_graph_on_new_data():
    """Capture needs no host sync; a replay over new keys, values and mask in the same buffers is exact."""
    query, key, value, valid = random_case(2, 8, 2, 3000, 128, torch.bfloat16, capacity=3100, seed=7)
    split_decode_attention(query, key, value, valid, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = split_decode_attention(query, key, value, valid, 0.1, return_lse=True)
    fresh = random_case(2, 8, 2, 3000, 128, torch.bfloat16, capacity=3100, seed=8)
    for buffer, new in zip((query, key, value, valid), fresh):
        buffer.copy_(new)
    valid[0, :2500] = False
    graph.replay()
    ref_out, ref_lse = split_decode_attention_torch(query.double(), key.double(), value.double(), valid, 0.1,
                                                    return_lse=True)
    assert_matches(out, lse, ref_out.cpu(), ref_lse.cpu(), torch.bfloat16)
