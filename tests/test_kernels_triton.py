"""Triton kernels against their torch twins and an fp64 reference (CPU: TRITON_INTERPRET=1)."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest selects the interpreter on machines without a GPU

from hshare.kernels import gather_attention_torch  # noqa: E402
from hshare.kernels.gather_attention_triton import gather_attention_triton  # noqa: E402

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(batch, q_heads, kv_heads, sel_heads, n, budget, dim, dtype):
    q = torch.randn(batch, q_heads, dim, device=DEVICE).to(dtype)
    storage_k = torch.randn(batch, kv_heads, n + 7, dim, device=DEVICE).to(dtype)
    storage_v = torch.randn(batch, kv_heads, n + 7, dim, device=DEVICE).to(dtype)
    idx = torch.stack([torch.randperm(n, device=DEVICE)[:budget] for _ in range(batch * sel_heads)])
    idx = idx.reshape(batch, sel_heads, budget).to(torch.int32)
    idx[0, 0, budget // 3:] = -1  # padding inside a selection
    idx[-1, -1, :] = -1  # a fully masked selection head
    return q, storage_k[:, :, :n], storage_v[:, :, :n], idx


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("q_heads,kv_heads,per_query", [(4, 2, False), (4, 2, True), (2, 2, False), (8, 1, False)])
@pytest.mark.parametrize("budget", [37, 130])
def test_gather_attention_triton_matches_twin(dtype, tol, q_heads, kv_heads, per_query, budget):
    if dtype == torch.float32 and DEVICE == "cuda":
        tol = 5e-3  # tf32 dot on the GPU
    sel = q_heads if per_query else kv_heads
    q, k, v, idx = random_case(2, q_heads, kv_heads, sel, 200, budget, 16, dtype)
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    out, lse = gather_attention_triton(q, k, v, idx, 0.3)
    ref_out, ref_lse = gather_attention_torch(q.double(), k.double(), v.double(), idx, 0.3)
    assert not out.isnan().any() and not lse.isnan().any()
    masked = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), masked)
    assert bool((out[masked] == 0).all())
    err = (out.double() - ref_out).norm() / ref_out.norm()
    assert err < tol
    torch.testing.assert_close(lse[~masked].double(), ref_lse[~masked], rtol=tol, atol=tol)


def test_gather_attention_triton_merges_incoming_partial_states():
    """Three incoming states over disjoint index ranges (one empty, its out poisoned) + the own part."""
    q, k, v, idx = random_case(2, 4, 2, 2, 90, 40, 16, torch.float32)
    idx[-1, -1, :5] = torch.arange(5, dtype=torch.int32)  # no fully masked head here
    parts = [gather_attention_torch(q, k, v, idx[..., a:b].contiguous(), 0.25) for a, b in ((0, 9), (9, 17))]
    empty = (torch.full_like(parts[0][0], float("nan")), torch.full_like(parts[0][1], float("-inf")))
    parts.insert(1, empty)
    partial = (torch.stack([p[0] for p in parts], 2), torch.stack([p[1] for p in parts], 2))
    out, lse = gather_attention_triton(q, k, v, idx[..., 17:].contiguous(), 0.25, partial=partial)
    ref_out, ref_lse = gather_attention_torch(q, k, v, idx, 0.25)
    tol = 5e-3 if DEVICE == "cuda" else 1e-5  # tf32 dot on the GPU; exact fp32 in the interpreter
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=tol, atol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="default launch plans at real sizes: too slow for the CPU interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("batch,length", [(2, 1500), (40, 4100)])
def test_shared_decode_default_plans_fit_every_dtype_and_head_dim(dtype, dim, batch, length):
    """The default tiles, stages and splits compile and fit the GPU's shared memory for every
    supported dtype and head dim (16-row and 64-row query tiles, short and >= 4096-token prefixes),
    and agree with the twin; the level alone too (the kernel of second and further levels)."""
    from hshare.kernels import PrefixKV, merge_attention_splits, shared_decode_attention_torch
    from hshare.kernels.prefix_attention_triton import shared_prefix_decode_states_triton
    from hshare.kernels.shared_decode_triton import shared_decode_attention_triton

    q, own_k, own_v, idx = random_case(batch, 8, 2, 2, 300, 200, dim, dtype)
    prefix = PrefixKV(torch.randn(1, 2, length, dim, device=DEVICE).to(dtype),
                      torch.randn(1, 2, length, dim, device=DEVICE).to(dtype))
    out, lse = shared_decode_attention_triton(q, prefix.keys, prefix.values, None, None, own_k, own_v, idx, 0.1)
    double = PrefixKV(prefix.keys.double(), prefix.values.double())
    ref_out, ref_lse = shared_decode_attention_torch(q.double(), double, own_k.double(), own_v.double(), idx, 0.1)
    tol = 2e-2 if dtype != torch.float32 else 5e-3
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)

    level = merge_attention_splits(*shared_prefix_decode_states_triton(q, prefix.keys, prefix.values, 0.1))
    want = shared_prefix_decode_states_twin(q, prefix.keys, prefix.values, 0.1)
    torch.testing.assert_close(level[0].double(), want[0][:, :, 0], rtol=tol, atol=tol)
    torch.testing.assert_close(level[1].double(), want[1][:, :, 0], rtol=tol, atol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="default launch plans at real sizes: too slow for the CPU interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (8, 8)])
def test_gather_attention_default_plans_fit_every_dtype_and_head_dim(dtype, dim, q_heads, kv_heads):
    """Gather-attention's default launch compiles and fits for every supported dtype and head dim."""
    q, k, v, idx = random_case(3, q_heads, kv_heads, kv_heads, 3000, 700, dim, dtype)
    out, lse = gather_attention_triton(q, k, v, idx, 0.1)
    ref_out, ref_lse = gather_attention_torch(q.double(), k.double(), v.double(), idx, 0.1)
    tol = 2e-2 if dtype != torch.float32 else 5e-3
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN x 0 of the poisoned split
@pytest.mark.parametrize("rows,num_warps", [(None, None), (1, 1), (2, 2), (8, 4)])
@pytest.mark.parametrize("with_prior", [False, True])
def test_merge_parts_matches_twin(rows, num_warps, with_prior):
    """The split merge, several query rows per program (the last program partly empty: 15 rows),
    against the twin over all states: random states, a NaN-poisoned empty split, a row whose every
    state is empty, incoming prior states."""
    from hshare.kernels import merge_attention_splits
    from hshare.kernels.gather_attention_triton import merge_parts

    batch, q_heads, dim, splits, prior_splits = 5, 3, 16, 5, 3
    q = torch.randn(batch, q_heads, dim, device=DEVICE)
    part_out = torch.randn(batch, q_heads, splits, dim, device=DEVICE)
    part_lse = torch.randn(batch, q_heads, splits, device=DEVICE) * 3
    part_lse[1, 2, 3] = float("-inf")
    part_out[1, 2, 3] = float("nan")  # an empty split: its out is never read
    part_lse[4, 0] = float("-inf")  # every split of a row empty
    prior = (torch.randn(batch, q_heads, prior_splits, dim, device=DEVICE),
             torch.randn(batch, q_heads, prior_splits, device=DEVICE)) if with_prior else None
    if with_prior:
        prior[1][4, 0] = float("-inf")
    out, lse = merge_parts(q, part_out, part_lse, prior, rows=rows, num_warps=num_warps)
    states = (part_out, part_lse) if prior is None else (torch.cat((part_out, prior[0]), 2),
                                                         torch.cat((part_lse, prior[1]), 2))
    want_out, want_lse = merge_attention_splits(states[0].double(), states[1].double())
    assert not out.isnan().any() and bool((out[4, 0] == 0).all()) and bool(torch.isneginf(lse[4, 0]))
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("n", [1, 129, 300])
def test_score_heads_triton_matches_reference(bits, n):
    from hshare.kernels import dequantize_labels, quantize_labels
    from hshare.kernels.labels_triton import score_heads_triton

    batch, sel_heads, channels = 3, 4, 16
    storage = torch.randn(batch, sel_heads, n + 50, channels, device=DEVICE)
    codes, scale, zero = (None if t is None else t[:, :, :n] for t in quantize_labels(storage, bits))
    rows = torch.tensor([2, 0], device=DEVICE)
    heads = torch.tensor([[3, 1], [0, 2]], device=DEVICE)
    q = torch.randn(2, 2, channels, device=DEVICE)
    got = score_heads_triton(q, codes, scale, zero, bits, rows, heads)
    keys = dequantize_labels(codes, scale, zero, bits, torch.float64)
    for i, row in enumerate(rows.tolist()):
        for j, head in enumerate(heads[i].tolist()):
            ref = keys[row, head] @ q[i, j].double()
            torch.testing.assert_close(got[i, j].double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,sel_heads,per_row", [(2, 2, False), (2, 4, True), (1, 3, False)])
@pytest.mark.parametrize("tokens", [1, 3, 45])  # 45: a whole tile of tokens and a partial one
def test_append_labels_triton_matches_twin_exactly(bits, dtype, kv_heads, sel_heads, per_row, tokens):
    from hshare.kernels.labels import append_labels, label_storage_dtype
    from hshare.kernels.labels_triton import append_labels_triton

    if sel_heads == 3:
        sel_heads = 2  # MQA: two selection heads read the one KV head
    batch, dim, r = 3, 32, 8
    keys_storage = torch.randn(batch, kv_heads, tokens + 5, dim, device=DEVICE).to(dtype)
    keys = keys_storage[:, :, 2:2 + tokens]  # strided view, as the cache hands them
    keys[0, 0, 0, :] = 0.25  # a constant label: scale 0
    channels = torch.stack([torch.randperm(dim, device=DEVICE)[:r] for _ in range((batch if per_row else 1) * sel_heads)])
    channels = channels.reshape(-1, sel_heads, r)
    store = label_storage_dtype(dtype)
    outs = []
    for fn in (append_labels_triton, None):
        codes = torch.full((batch, sel_heads, tokens + 4, r * bits // 8), 77, dtype=torch.uint8, device=DEVICE)
        scale = torch.full((batch, sel_heads, tokens + 4), 9.0, dtype=store, device=DEVICE)
        zero = torch.full_like(scale, 9.0)
        views = codes[:, :, 1:1 + tokens], scale[:, :, 1:1 + tokens], zero[:, :, 1:1 + tokens]
        if fn is None:
            import os
            os.environ["HSHARE_KERNELS"] = "torch"
            try:
                append_labels(keys, channels, bits, *views)
            finally:
                del os.environ["HSHARE_KERNELS"]
        else:
            fn(keys, channels, bits, *views)
        outs.append((codes, scale, zero))
    for got, want in zip(*outs):
        assert torch.equal(got, want)  # same codes, scale and zero, nothing written outside the tokens


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_labels_at_a_device_column(bits, dtype):
    """Static shapes: the key at a column held in a device tensor, read from the whole key buffer and
    its label written at that column of the whole label buffers; the kernel and the twin write what
    quantizing that key alone gives (`quantize_labels`), and nothing else."""
    from hshare.kernels.labels import append_labels, label_storage_dtype, quantize_labels

    batch, kv_heads, sel_heads, n, dim, r = 3, 2, 4, 11, 32, 8
    keys = torch.randn(batch, kv_heads, n, dim, device=DEVICE).to(dtype)
    channels = torch.stack([torch.randperm(dim, device=DEVICE)[:r] for _ in range(batch * sel_heads)])
    channels = channels.reshape(batch, sel_heads, r)
    column = int(torch.randint(0, n, ()))
    kv_of_sel = torch.arange(sel_heads) * kv_heads // sel_heads
    picked = keys[:, kv_of_sel, column].gather(-1, channels)  # [B, H_sel, r]
    want = quantize_labels(picked, bits)
    store = label_storage_dtype(dtype)
    for kernels in ("triton", "torch"):
        codes = torch.full((batch, sel_heads, n, r * bits // 8), 77, dtype=torch.uint8, device=DEVICE)
        scale = torch.full((batch, sel_heads, n), 9.0, dtype=store, device=DEVICE)
        zero = torch.full_like(scale, 9.0)
        os.environ["HSHARE_KERNELS"] = kernels
        try:
            append_labels(keys, channels, bits, codes, scale, zero, column=torch.tensor([column], device=DEVICE))
        finally:
            del os.environ["HSHARE_KERNELS"]
        for got, expected, untouched in zip((codes, scale, zero), want, (77, 9.0, 9.0)):
            assert torch.equal(got[:, :, column], expected), kernels
            others = torch.cat((got[:, :, :column], got[:, :, column + 1:]), dim=2)
            assert bool((others == untouched).all()), kernels


@pytest.mark.slow  # ~40 s in the interpreter
@pytest.mark.parametrize("preset,prefix", [("ds", "off"), ("hshare-1_2-1_2-1_2", "on"), ("hshare-refine", "off")])
def test_generate_same_with_kernels_and_twins(monkeypatch, preset, prefix):
    """A patched generate routed through every Triton kernel (interpreter on CPU) gives the twins'
    tokens and logits: label append, label scores and top-k (of candidates too), gather-attention (with the
    prefix partial)."""
    import hshare
    from conftest import tiny_llama, VOCAB

    model = tiny_llama().to(DEVICE)
    shared = torch.randint(3, VOCAB, (20,))
    rows = [torch.cat((shared, torch.randint(3, VOCAB, (n,)))) for n in (30, 41)]
    ids = torch.zeros(2, 61, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, 61 - len(r):], mask[i, 61 - len(r):] = r, 1
    results = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("HSHARE_KERNELS", mode)
        with hshare.patched(model, preset, sink=2, local=4, heavy=6, prefix=prefix):
            out = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=5, min_new_tokens=5,
                                 do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        results.append((out.sequences, torch.stack(out.logits, 1)))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-3, atol=1e-3)


def _reference_over_prefix(q, keys, values, scale, members, key_valid):
    """fp64 softmax of each row over its group's valid prefix keys: ``(out [B, Hq, d], lse [B, Hq])``."""
    batch, q_heads, dim = q.shape
    per_kv = q_heads // keys.shape[1]
    out = torch.zeros(batch, q_heads, dim, dtype=torch.float64)
    lse = torch.full((batch, q_heads), float("-inf"), dtype=torch.float64)
    groups = [list(range(batch))] if members is None else [[r for r in m.tolist() if r >= 0] for m in members]
    for group, rows in enumerate(groups):
        keep = torch.ones(keys.shape[2], dtype=torch.bool) if key_valid is None else key_valid[group].cpu()
        for row in rows:
            for head in range(q_heads):
                k = keys[group, head // per_kv].cpu().double()[keep]
                v = values[group, head // per_kv].cpu().double()[keep]
                logits = (k @ q[row, head].cpu().double()) * scale
                if len(logits):
                    lse[row, head] = torch.logsumexp(logits, 0)
                    out[row, head] = torch.softmax(logits, 0) @ v
    return out, lse


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("length,splits", [(1, None), (37, 1), (301, 3), (301, None)])
def test_prefix_decode_states_triton_level_one(q_heads, kv_heads, length, splits):
    """Level 1 (every row, in order): the unmerged split states merge to exact attention over the
    prefix, alone and through gather-attention's merge with an own part (fp64 reference)."""
    from hshare.kernels import merge_attention_splits
    from hshare.kernels.prefix_attention_triton import shared_prefix_decode_states_triton

    batch, dim, scale = 3, 16, 0.3
    q = torch.randn(batch, q_heads, dim, device=DEVICE)
    keys, values = torch.randn(1, kv_heads, length, dim, device=DEVICE), torch.randn(1, kv_heads, length, dim,
                                                                                        device=DEVICE)
    states = shared_prefix_decode_states_triton(q, keys, values, scale, splits=splits)
    assert states[0].shape[:3] == states[1].shape == (batch, q_heads, states[1].shape[2])
    out, lse = merge_attention_splits(*states)
    ref_out, ref_lse = _reference_over_prefix(q, keys, values, scale, None, None)
    tol = 5e-3 if DEVICE == "cuda" else 1e-5  # tf32 dot on the GPU
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=tol, atol=tol)

    own_k, own_v, idx = (torch.randn(batch, kv_heads, 20, dim, device=DEVICE),
                         torch.randn(batch, kv_heads, 20, dim, device=DEVICE),
                         torch.randint(0, 20, (batch, kv_heads, 6), device=DEVICE))
    idx[0, 0] = -1  # a head whose own part is empty: the prefix alone
    got = gather_attention_triton(q, own_k, own_v, idx, scale, partial=states)
    twin = shared_prefix_decode_states_twin(q, keys, values, scale)
    want = gather_attention_torch(q.double(), own_k.double(), own_v.double(), idx, scale,
                                  partial=(twin[0].double(), twin[1].double()))
    torch.testing.assert_close(got[0].double(), want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1].double(), want[1], rtol=tol, atol=tol)


def shared_prefix_decode_states_twin(q, keys, values, scale, members=None, row_slot=None, key_valid=None):
    from hshare.kernels import shared_prefix_attention

    out, lse = shared_prefix_attention(q[:, :, None].double(), keys.double(), values.double(), scale, members,
                                       row_slot, key_valid)
    return out, lse


@pytest.mark.parametrize("block_m", [None, 16])
def test_prefix_decode_states_triton_groups_not_contiguous(block_m):
    """Level 2: groups {0, 3} and {4, 1} of 6 rows (rows 2 and 5 in none, a group padded with -1),
    the second group's keys partly invalid, GQA 6/2: each row's states cover its group only."""
    from hshare.kernels import merge_attention_splits
    from hshare.kernels.prefix_attention_triton import shared_prefix_decode_states_triton
    from hshare.prefix_store import group_membership

    batch, q_heads, kv_heads, dim, scale = 6, 6, 2, 16, 0.25
    q = torch.randn(batch, q_heads, dim, device=DEVICE)
    keys, values = torch.randn(2, kv_heads, 70, dim, device=DEVICE), torch.randn(2, kv_heads, 70, dim, device=DEVICE)
    key_valid = torch.ones(2, 70, dtype=torch.bool, device=DEVICE)
    key_valid[1, 45:] = False
    members, row_slot = group_membership(torch.tensor([0, 1, -1, 0, 1, -1], device=DEVICE), 2)
    members = torch.cat((members, torch.full((2, 1), -1, device=DEVICE, dtype=members.dtype)), 1)  # padded groups
    states = shared_prefix_decode_states_triton(q, keys, values, scale, members, key_valid, block_m=block_m, splits=2)
    out, lse = merge_attention_splits(*states)
    ref_out, ref_lse = _reference_over_prefix(q, keys, values, scale, members, key_valid)
    tol = 5e-3 if DEVICE == "cuda" else 1e-5
    assert not out.isnan().any()
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(ref_lse))  # rows 2 and 5: in no group
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=tol, atol=tol)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], rtol=tol, atol=tol)


def test_prefix_decode_states_dispatch(monkeypatch):
    """`shared_prefix_decode_states` routes to the kernel or the twin; both merge to the same result."""
    from hshare.kernels import merge_attention_splits, shared_prefix_decode_states

    q = torch.randn(3, 4, 16, device=DEVICE)
    keys, values = torch.randn(1, 2, 130, 16, device=DEVICE), torch.randn(1, 2, 130, 16, device=DEVICE)
    results = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("HSHARE_KERNELS", mode)
        results.append(merge_attention_splits(*shared_prefix_decode_states(q, keys, values, 0.25)))
    tol = 5e-3 if DEVICE == "cuda" else 1e-5
    torch.testing.assert_close(results[1], results[0], rtol=tol, atol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU with > 9 GB free (a cache of more than 2**31 elements)")
def test_gather_attention_offsets_beyond_int32():
    from hshare.kernels.gather_attention_triton import gather_attention_triton

    n = 2**23 + 64  # 2 rows x n x 128 > 2**31 elements: row 1 starts beyond int32 offsets
    keys = torch.empty(2, 1, n, 128, device="cuda", dtype=torch.bfloat16)
    cols = torch.tensor([0, 5, n - 3, n - 1], device="cuda")
    keys[:, :, cols] = torch.randn(2, 1, 4, 128, device="cuda", dtype=torch.bfloat16)
    idx = cols.to(torch.int32).expand(2, 1, 4).contiguous()
    q = torch.randn(2, 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = gather_attention_triton(q, keys, keys, idx, 0.1)
    ref, ref_lse = gather_attention_torch(q.float(), keys[:, :, cols].float(), keys[:, :, cols].float(),
                                          torch.arange(4, device="cuda").expand(2, 1, 4), 0.1)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("sink,local,heavy", [(2, 4, 6), (0, 3, 5), (3, 5, 0), (1, 1, 7)])
def test_critical_indices_triton_matches_twin(sink, local, heavy):
    from hshare.kernels import critical_indices_torch
    from hshare.kernels.critical_indices_triton import critical_indices_triton
    from hshare.selection import RowWindows

    batch, heads, n = 4, 3, 40
    valid = torch.ones(batch, n, dtype=torch.bool, device=DEVICE)
    valid[0, :25] = False  # left padding: row 0 has 15 tokens
    valid[1, :37] = False  # a short row (3 tokens)
    valid[2, 10:14] = False  # a hole (a user's mask)
    windows = RowWindows.build(valid, sink, local, sink + local + heavy)
    # stale, padded and fresh columns: a selection's, valid when chosen (never the hole), or -1
    picks = torch.randint(-1, n, (batch, heads, heavy), device=DEVICE)
    picks[2] = torch.where((picks[2] >= 10) & (picks[2] < 14), -1, picks[2])
    start = int(torch.randint(0, 1000, ()))
    counts = [torch.tensor([start], dtype=torch.int64, device=DEVICE) for _ in range(2)]
    got = critical_indices_triton(picks, windows.sink, windows.local, windows.dense, windows.middle_bounds,
                                  windows.short, counts[0])
    want = critical_indices_torch(picks, windows.sink, windows.local, windows.dense, windows.middle_bounds,
                                  windows.short, counts[1])
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    valid_entries = start + int((want >= 0).sum())  # the work counter: every valid index, added once
    assert int(counts[0]) == valid_entries and int(counts[1]) == valid_entries


@pytest.mark.parametrize("q_heads,kv_heads,sel_per_query", [(4, 4, False), (8, 2, False), (8, 2, True), (4, 1, False)])
@pytest.mark.parametrize("level", ["all rows", "groups"])
def test_shared_decode_attention_triton_matches_twin(q_heads, kv_heads, sel_per_query, level):
    """One launch (prefix programs beside the own part's gather programs) against the fp64 twin:
    level 1 of every row, or non-contiguous groups with a row in none, a padded group and invalid
    keys; sparse own indices with padding and a head with no own token; further incoming states."""
    from hshare.kernels import PrefixKV, shared_decode_attention_torch, shared_prefix_decode_states
    from hshare.kernels.shared_decode_triton import shared_decode_attention_triton
    from hshare.prefix_store import group_membership

    batch, dim, scale = 5, 16, 0.3
    q, own_k, own_v, idx = random_case(batch, q_heads, kv_heads, q_heads if sel_per_query else kv_heads, 40, 9, dim,
                                       torch.float32)
    if level == "all rows":
        prefix = PrefixKV(torch.randn(1, kv_heads, 75, dim, device=DEVICE), torch.randn(1, kv_heads, 75, dim,
                                                                                         device=DEVICE))
    else:
        members, row_slot = group_membership(torch.tensor([1, 0, -1, 1, 0], device=DEVICE), 2)
        key_valid = torch.ones(2, 50, dtype=torch.bool, device=DEVICE)
        key_valid[0, 31:] = False
        prefix = PrefixKV(torch.randn(2, kv_heads, 50, dim, device=DEVICE), torch.randn(2, kv_heads, 50, dim,
                                                                                         device=DEVICE),
                          members, row_slot, key_valid)
    other = PrefixKV(torch.randn(1, kv_heads, 20, dim, device=DEVICE), torch.randn(1, kv_heads, 20, dim, device=DEVICE))
    partial = shared_prefix_decode_states(q, *other[:2], scale)
    out, lse = shared_decode_attention_triton(q, prefix.keys, prefix.values, prefix.members, prefix.key_valid,
                                              own_k, own_v, idx, scale, partial)
    double = PrefixKV(prefix.keys.double(), prefix.values.double(), *prefix[2:])
    want_partial = shared_prefix_decode_states(q.double(), other.keys.double(), other.values.double(), scale)
    ref_out, ref_lse = shared_decode_attention_torch(q.double(), double, own_k.double(), own_v.double(), idx, scale,
                                                     want_partial)
    tol = 5e-3 if DEVICE == "cuda" else 1e-5  # tf32 dot on the GPU
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,dim", [(4, 4, 16), (6, 2, 16), (3, 1, 24)])  # MHA, GQA, a dim not a power of 2
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_channel_statistic_triton_matches_twin(dtype, q_heads, kv_heads, dim, splits):
    from hshare.kernels import channel_statistic_torch
    from hshare.kernels.channel_statistic_triton import channel_statistic_triton

    batch, tokens = 3, 77  # not a multiple of the token tile
    query = torch.randn(batch, tokens, q_heads, dim, device=DEVICE).to(dtype).transpose(1, 2)  # the model's layout
    keys = torch.randn(batch, kv_heads, tokens, dim, device=DEVICE).to(dtype)
    valid = torch.rand(batch, tokens, device=DEVICE) > 0.2
    valid[0, :40] = False  # left padding
    valid[2] = False  # a row with no valid token sums to zero
    got = channel_statistic_triton(query, keys, valid, splits=splits)
    want = channel_statistic_torch(query, keys, valid)
    assert got.dtype == torch.float32 and got.shape == (batch, q_heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[2], torch.zeros_like(got[2])) and got[0].abs().sum() > 0


@pytest.mark.parametrize("rows,heads,n,heavy", [(3, 2, 1, 4), (2, 3, 37, 8), (2, 2, 300, 40), (1, 4, 700, 512)])
@pytest.mark.parametrize("ties", [False, True])
def test_heavy_topk_triton_keeps_the_best_of_the_window(rows, heads, n, heavy, ties):
    """The Triton top-k against the tie-robust contract (`check_top_k`) and the twin's set (ties at the k-th score
    to the earliest columns in both): random windows (one row's empty, one full), scores of both signs and -0.0 /
    +0.0, or few distinct values (ties at the k-th score, as Quest's page scores have)."""
    from property_support import check_top_k
    from hshare.kernels import select_heavy_torch
    from hshare.kernels.heavy_topk_triton import select_heavy_triton

    scores = torch.randn(rows, heads, n, device=DEVICE) * 10
    if ties:
        scores = scores.round() / 4
    scores[0, 0, ::5] = -0.0
    scores[-1, -1, 1::5] = 0.0
    selectable = torch.rand(rows, n, device=DEVICE) < 0.6
    selectable[0] = True
    if rows > 2:
        selectable[1] = False
    got = select_heavy_triton(scores, selectable, heavy)
    check_top_k(scores.cpu(), selectable[:, None].cpu(), heavy, got.cpu())
    picked = got[got >= 0].reshape(-1)
    for columns in got.reshape(-1, heavy).cpu():  # ascending columns, then -1
        valid = columns[columns >= 0]
        assert torch.equal(valid, valid.sort().values) and bool((columns[len(valid):] == -1).all())
    want = select_heavy_torch(scores, selectable[:, None], heavy)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert picked.numel() == 0 or int(picked.max()) < n


def test_heavy_topk_triton_takes_signed_zeros_as_equal():
    """-0.0 and +0.0 are one score (as in every kernel that ranks score keys): where the heavy-th best is a zero,
    the zeros taken are the first in column order, whatever their signs."""
    from hshare.kernels.heavy_topk_triton import select_heavy_triton

    n, heavy = 64, 20
    signs = torch.randint(0, 2, (2, 3, n), generator=torch.Generator().manual_seed(int(torch.randint(0, 999, ()))))
    scores = torch.where(signs.bool(), torch.tensor(0.0), torch.tensor(-0.0))
    scores[:, :, 40:45] = 1.0  # five above the zeros
    selectable = torch.ones(2, n, dtype=torch.bool)
    got = select_heavy_triton(scores.to(DEVICE), selectable.to(DEVICE), heavy).cpu()
    want = torch.cat((torch.arange(heavy - 5), torch.arange(40, 45)))  # the first 15 zeros, then the five ones
    assert torch.equal(got, want.expand(2, 3, heavy))


def test_heavy_topk_triton_skips_non_finite_scores_and_broadcasts_the_window():
    """-inf / +inf / NaN scores are never chosen (as the twin); one window ``[1, n]`` serves all rows."""
    from hshare.kernels import select_heavy_torch
    from hshare.kernels.heavy_topk_triton import select_heavy_triton

    scores = torch.randn(3, 2, 40, device=DEVICE)
    scores[:, 0, :30] = float("-inf")
    scores[1, 1, :10] = float("nan")
    scores[2, 1, :5] = float("inf")
    selectable = torch.rand(1, 40, device=DEVICE) < 0.7
    got = select_heavy_triton(scores, selectable.expand(3, -1), 12)
    want = select_heavy_torch(scores, selectable[:, None], 12)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_select_heavy_dispatch(monkeypatch):
    """`select_heavy` sends decode-step score rows ``[A, H, n]`` to the kernel (ascending columns) and
    prefill's 4-D scores to the twin; both keep the same set."""
    import hshare.kernels.heavy_topk_triton as module
    from hshare.kernels import select_heavy, select_heavy_torch

    calls = []
    original = module.select_heavy_triton
    monkeypatch.setattr(module, "select_heavy_triton", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("HSHARE_KERNELS", "triton")
    scores = torch.randn(2, 3, 64, device=DEVICE)
    selectable = torch.rand(2, 1, 64, device=DEVICE) < 0.5
    got = select_heavy(scores, selectable, 9)
    assert calls == [1]
    assert torch.equal(got.sort(-1).values, select_heavy_torch(scores, selectable, 9).sort(-1).values)
    select_heavy(scores[:, :, None], selectable[:, :, None], 9)  # 4-D: the twin
    assert calls == [1]


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("q_heads,sel_heads,per_row", [(4, 4, False), (6, 2, True), (8, 1, False)])
def test_decode_label_scores_gathers_query_labels_in_the_kernel(bits, q_heads, sel_heads, per_row):
    """The kernel's in-launch query labels (the group's heavy channels summed) give the twin's scores:
    GQA groups, per-row (dynamic) channels, chosen rows and heads."""
    from hshare.kernels import decode_label_scores, quantize_labels
    from hshare.kernels.labels_triton import score_heads_triton

    batch, n, r, dim = 3, 70, 8, 32
    codes, scale, zero = quantize_labels(torch.randn(batch, sel_heads, n, r, device=DEVICE), bits)
    query = torch.randn(batch, q_heads, dim, device=DEVICE)
    channels = torch.stack([torch.randperm(dim, device=DEVICE)[:r] for _ in range((batch if per_row else 1) * sel_heads)])
    channels = channels.reshape(-1, sel_heads, r)
    rows = torch.tensor([2, 0], device=DEVICE)
    heads = torch.randint(0, sel_heads, (2, 2), device=DEVICE)
    got = score_heads_triton(None, codes, scale, zero, bits, rows, heads, query=query, channels=channels)
    os.environ["HSHARE_KERNELS"] = "torch"
    try:
        want = decode_label_scores(query, channels, codes, scale, zero, bits, rows, heads)
    finally:
        del os.environ["HSHARE_KERNELS"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k,ties", [(1, False), (5, True), (9, False), (14, True), (19, False)])
def test_with_successors_triton_matches_twin(k, ties):
    from hshare.kernels import with_successors_torch
    from hshare.kernels.successors_triton import with_successors_triton

    generator = torch.Generator().manual_seed(k * 100 + ties)
    rows, heads, n = 3, 4, 60
    window = torch.rand(rows, n, generator=generator) < 0.7
    window[:, -1] = True  # the last column selectable: its successor is past the end
    columns = torch.stack([torch.randperm(n, generator=generator)[:k] for _ in range(rows * heads)]).view(rows, heads, k)
    columns[0, 0, : k // 2] = -1  # NO_TOKEN entries
    columns[1, 1, 0] = n - 1
    if k > 3:  # a run of adjacent columns (each successor but the last is given), the rest distinct from it
        run, rest = torch.arange(20, 24), torch.randperm(n, generator=generator)
        columns[2, 2] = torch.cat((run, rest[~torch.isin(rest, run)]))[:k]
    scores = (torch.randint(-2, 3, (rows, heads, k), generator=generator).float() if ties
              else torch.randn(rows, heads, k, generator=generator))
    scores[0, 1, 0] = -0.0
    columns, scores, window = columns.to(DEVICE), scores.to(DEVICE), window.to(DEVICE)
    top = (k + 1) // 2  # the best half as well
    got, want = with_successors_triton(columns, scores, window, top), with_successors_torch(columns, scores, window, top)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    heads_view, scores_view = columns[:, ::2], scores[:, ::2].to(torch.bfloat16)  # strided heads, bf16 scores
    got, want = with_successors_triton(heads_view, scores_view, window), with_successors_torch(heads_view, scores_view,
                                                                                             window)
    assert torch.equal(got[0], want[0]) and got[1].shape[-1] == 0
