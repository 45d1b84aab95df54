"""Shared-prefix attention ops against an fp64 per-row reference over [prefix; own part]."""

import pytest
import torch

from hshare.kernels import attention_with_lse, attention_with_lse_torch, gather_attention_torch, merge_attention_states, \
    shared_prefix_attention
from hshare.prefix_store import group_membership

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)


def reference(q, keys, values, valid, scale):
    """Per-row softmax attention, fp64. q [Hq, T, d]; keys/values [Hkv, n, d]; valid [T, n] bool."""
    per_kv = q.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(per_kv, 0)
    v = values.double().repeat_interleave(per_kv, 0)
    logits = (q.double() @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return probs @ v, lse


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("prefix_len", [1, 37, 4099])
@pytest.mark.parametrize("steps", [1, 3])
def test_prefix_plus_own_part_equals_concatenated_attention(q_heads, kv_heads, prefix_len, steps):
    batch, dim, own_width = 5, 16, 9
    scale = dim ** -0.5
    q = torch.randn(batch, q_heads, steps, dim)
    prefix_k, prefix_v = torch.randn(1, kv_heads, prefix_len, dim), torch.randn(1, kv_heads, prefix_len, dim)
    own_k, own_v = torch.randn(batch, kv_heads, own_width, dim), torch.randn(batch, kv_heads, own_width, dim)
    own_lengths = torch.tensor([1, own_width, 4, 0, 7])  # ragged, one row with no own key at all
    columns = torch.arange(own_width)
    own_valid = columns[None] >= own_width - own_lengths[:, None]  # left-padded own parts: [B, S]
    # causal inside the own part for the T query rows (the last T own columns)
    causal = columns[None, :] <= (own_width - steps + torch.arange(steps))[:, None]  # [T, S]
    valid = own_valid[:, None, :] & causal[None]  # [B, T, S]

    members, row_slot = group_membership(torch.zeros(batch, dtype=torch.long), 1)
    prefix_out, prefix_lse = shared_prefix_attention(q, prefix_k, prefix_v, scale, members, row_slot)
    in_order = shared_prefix_attention(q, prefix_k, prefix_v, scale)  # the no-gather path of level 1
    torch.testing.assert_close(in_order, (prefix_out, prefix_lse), rtol=0, atol=0)
    per_kv = q_heads // kv_heads
    folded = q.reshape(batch, kv_heads, per_kv * steps, dim)
    mask = valid[:, None, None].expand(batch, 1, per_kv, steps, own_width).reshape(batch, 1, per_kv * steps, own_width)
    own_out, own_lse = attention_with_lse_torch(folded, own_k, own_v, scale, mask)
    out, lse = merge_attention_states(own_out.view(batch, q_heads, steps, dim), own_lse.view(batch, q_heads, steps),
                                      prefix_out, prefix_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    for row in range(batch):
        keys = torch.cat((prefix_k[0], own_k[row]), 1)
        values = torch.cat((prefix_v[0], own_v[row]), 1)
        row_valid = torch.cat((torch.ones(steps, prefix_len, dtype=torch.bool), valid[row]), 1)
        ref_out, ref_lse = reference(q[row], keys, values, row_valid, scale)
        torch.testing.assert_close(out[row].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[row].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_two_levels_groups_not_contiguous_and_sparse_own_part():
    """Level 1 for all rows, level 2 groups {0, 3}, {1, 4} (row 2 in none, a group padded), then a
    sparse own part through gather-attention's incoming partial."""
    batch, q_heads, kv_heads, dim = 5, 6, 2, 8
    scale = 0.3
    q = torch.randn(batch, q_heads, 1, dim)
    k1, v1 = torch.randn(1, kv_heads, 11, dim), torch.randn(1, kv_heads, 11, dim)
    k2, v2 = torch.randn(2, kv_heads, 6, dim), torch.randn(2, kv_heads, 6, dim)
    level2_valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    row_group2 = torch.tensor([0, 1, -1, 0, 1])
    own_k, own_v = torch.randn(batch, kv_heads, 10, dim), torch.randn(batch, kv_heads, 10, dim)
    indices = torch.randint(0, 10, (batch, kv_heads, 4))
    indices[2, 1] = -1  # a head with no own token

    level1 = shared_prefix_attention(q, k1, v1, scale, *group_membership(torch.zeros(batch, dtype=torch.long), 1))
    level2 = shared_prefix_attention(q, k2, v2, scale, *group_membership(row_group2, 2), key_valid=level2_valid)
    prefix_out, prefix_lse = merge_attention_states(*level1, *level2)
    out, lse = gather_attention_torch(q[:, :, 0], own_k, own_v, indices, scale,
                                      partial=(prefix_out, prefix_lse))  # T = 1: one split state
    for row in range(batch):
        parts_k, parts_v = [k1[0]], [v1[0]]
        if row_group2[row] >= 0:
            keep = level2_valid[row_group2[row]]
            parts_k.append(k2[row_group2[row]][:, keep])
            parts_v.append(v2[row_group2[row]][:, keep])
        for head in range(kv_heads):
            cols = indices[row, head][indices[row, head] >= 0]
            keys = torch.cat([p[head] for p in parts_k] + [own_k[row, head, cols]], 0)[None]
            values = torch.cat([p[head] for p in parts_v] + [own_v[row, head, cols]], 0)[None]
            heads = slice(head * 3, head * 3 + 3)
            ref_out, ref_lse = reference(q[row, heads], keys, values, torch.ones(1, keys.shape[1], dtype=torch.bool),
                                         scale)
            torch.testing.assert_close(out[row, heads].double(), ref_out[:, 0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[row, heads].double(), ref_lse[:, 0], rtol=1e-5, atol=1e-5)


def test_row_in_no_group_and_fully_masked_rows_give_no_nan():
    q = torch.randn(3, 2, 4, 8)
    keys, values = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, lse = shared_prefix_attention(q, keys, values, 0.5, *group_membership(torch.tensor([-1, 0, -1]), 1))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[[0, 2]]).all()
    assert torch.isfinite(lse[1]).all()
    masked = torch.zeros(3, 1, 4, 5, dtype=torch.bool)
    out, lse = attention_with_lse_torch(q, keys.expand(3, -1, -1, -1), values.expand(3, -1, -1, -1), 0.5, masked)
    assert not out.isnan().any() and torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_group_membership_hand_worked():
    members, row_slot = group_membership(torch.tensor([1, -1, 0, 1, 1]), 2)
    assert members.tolist() == [[2, -1, -1], [0, 3, 4]]
    assert row_slot.tolist() == [3, -1, 0, 4, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (PyTorch's fused kernels)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_cuda_attention_with_lse_matches_twin(dtype, masked):
    n, heads, rows, length, dim = 3, 4, 37, 1029, 128
    q = torch.randn(n, heads, rows, dim, device="cuda", dtype=dtype)
    k = torch.randn(n, heads, length, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    mask = None
    if masked:
        mask = torch.rand(n, 1, rows, length, device="cuda") < 0.7
        mask[1, :, 5] = False  # a fully masked row
    out, lse = attention_with_lse(q, k, v, 0.09, mask)
    ref_out, ref_lse = attention_with_lse_torch(q.float(), k.float(), v.float(), 0.09, mask)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)
