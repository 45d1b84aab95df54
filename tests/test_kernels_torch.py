"""Torch twins of the hot operations against independent float64 references."""

import math

import pytest
import torch

from hshare.kernels import dequantize_labels, gather_attention, label_scores, merge_attention_splits, \
    merge_attention_states, quantize_labels

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_label_round_trip_within_quantization_error(bits):
    labels = torch.randn(3, 2, 50, 16) * 3
    codes, scale, zero = quantize_labels(labels, bits)
    back = dequantize_labels(codes, scale, zero, bits)
    if bits == 16:
        assert codes.dtype == torch.float16 and scale is None
        torch.testing.assert_close(back, labels, rtol=1e-3, atol=1e-3)
        return
    assert codes.dtype == torch.uint8
    assert codes.shape[-1] == (8 if bits == 4 else 16)
    span = labels.amax(-1) - labels.amin(-1)
    step = span / ((1 << bits) - 1)
    err = (back - labels).abs().amax(-1)
    assert bool((err <= step / 2 + 1e-5).all())
    # extremes are exact: min maps to code 0 and max to the top code
    torch.testing.assert_close(back.amin(-1), labels.amin(-1), rtol=0, atol=1e-5)


def test_constant_label_vector_is_exact():
    labels = torch.full((1, 1, 3, 4), 2.5)
    back = dequantize_labels(*quantize_labels(labels, 4), 4)
    torch.testing.assert_close(back, labels)


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_label_scores_match_dequantized_dot(bits):
    keys = torch.randn(2, 3, 40, 8, dtype=torch.float64)
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    codes, scale, zero = quantize_labels(keys, bits)
    ref = torch.einsum("bhqr,bhnr->bhqn", q, dequantize_labels(codes, scale, zero, bits, torch.float64))
    torch.testing.assert_close(label_scores(q, codes, scale, zero, bits), ref)


def dense_reference(q, k, v, idx, scale):
    """Per (row, query head) softmax over the gathered set, in float64, with Python loops."""
    batch, q_heads, dim = q.shape
    kv_heads, sel_heads = k.shape[1], idx.shape[1]
    out = torch.zeros(batch, q_heads, dim, dtype=torch.float64)
    lse = torch.full((batch, q_heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            s = h * sel_heads // q_heads
            kv = s * kv_heads // sel_heads
            cols = [c for c in idx[b, s].tolist() if c >= 0]
            if not cols:
                continue
            logits = (k[b, kv, cols].double() @ q[b, h].double()) * scale
            lse[b, h] = torch.logsumexp(logits, 0)
            out[b, h] = torch.softmax(logits, 0) @ v[b, kv, cols].double()
    return out, lse


@pytest.mark.parametrize("q_heads,kv_heads,per", [(8, 2, "kv"), (8, 2, "query"), (4, 4, "kv"), (6, 1, "kv")])
@pytest.mark.parametrize("budget", [1, 7, 33])
def test_gather_attention_matches_reference(q_heads, kv_heads, per, budget):
    batch, n, dim = 3, 50, 16
    q = torch.randn(batch, q_heads, dim)
    storage_k = torch.randn(batch, kv_heads, n + 13, dim)  # a buffer view, as the cache hands it over
    storage_v = torch.randn(batch, kv_heads, n + 13, dim)
    k, v = storage_k[:, :, :n], storage_v[:, :, :n]
    sel = kv_heads if per == "kv" else q_heads
    idx = torch.stack([torch.randperm(n)[:budget] for _ in range(batch * sel)]).reshape(batch, sel, budget)
    idx[0, 0, budget // 2:] = -1  # a partly padded selection
    idx[1, -1, :] = -1  # a selection head with no token at all
    out, lse = gather_attention(q, k, v, idx, 0.25)
    ref_out, ref_lse = dense_reference(q, k, v, idx, 0.25)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_gather_attention_rejects_bad_head_count():
    with pytest.raises(ValueError, match="accepted"):
        gather_attention(torch.randn(1, 8, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4),
                         torch.zeros(1, 3, 2, dtype=torch.long), 1.0)


def dense_case(n: int) -> tuple:
    """fp64 query [2, 4, 8], keys/values [2, 4, n, 8] and every column [2, 4, n]."""
    return (torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 4, n, 8, dtype=torch.float64),
            torch.randn(2, 4, n, 8, dtype=torch.float64), torch.arange(n).expand(2, 4, n))


def test_merge_equals_attention_over_concatenation():
    q, k, v, cols = dense_case(30)
    whole = gather_attention(q, k, v, cols, 0.3)
    first = gather_attention(q, k, v, cols[..., :11].contiguous(), 0.3)
    second = gather_attention(q, k, v, cols[..., 11:].contiguous(), 0.3, partial=(first[0][:, :, None],
                                                                                   first[1][:, :, None]))
    torch.testing.assert_close(second[0], whole[0])
    torch.testing.assert_close(second[1], whole[1])


def test_merge_of_splits_equals_attention_over_concatenation():
    """S partial states (one of them empty) merged at once, and as incoming splits of gather."""
    q, k, v, cols = dense_case(40)
    whole = gather_attention(q, k, v, cols, 0.3)
    bounds = [(0, 7), (7, 7), (7, 23), (23, 31)]  # (7, 7): a split with no key
    parts = [gather_attention(q, k, v, torch.full((2, 4, 1), -1), 0.3) if a == b else
             gather_attention(q, k, v, cols[..., a:b].contiguous(), 0.3) for a, b in bounds]
    parts[1] = (torch.full_like(parts[1][0], float("nan")), parts[1][1])  # an empty part's out is never read
    out = torch.stack([p[0] for p in parts], dim=2)
    lse = torch.stack([p[1] for p in parts], dim=2)
    assert bool(torch.isneginf(lse[:, :, 1]).all())
    merged = merge_attention_splits(out, lse)
    head = gather_attention(q, k, v, cols[..., :31].contiguous(), 0.3)
    torch.testing.assert_close(merged[0], head[0])
    torch.testing.assert_close(merged[1], head[1])
    final = gather_attention(q, k, v, cols[..., 31:].contiguous(), 0.3, partial=(out, lse))
    torch.testing.assert_close(final[0], whole[0])
    torch.testing.assert_close(final[1], whole[1])


def test_merge_of_empty_parts_has_no_nan():
    out = torch.randn(3, 4)
    empty = torch.full((3,), -math.inf)
    merged, lse = merge_attention_states(out, empty, torch.zeros(3, 4), empty)
    assert torch.equal(merged, torch.zeros(3, 4)) and bool(torch.isneginf(lse).all())
    lse_b = torch.randn(3)
    merged, lse = merge_attention_states(torch.zeros(3, 4), empty, out, lse_b)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(lse, lse_b)
