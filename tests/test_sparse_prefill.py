"""Sparse prefill (HShare Appendix A.1): each prefill query row attends to its own critical tokens."""

import pytest
import torch

import hshare
import hshare.sparse_prefill as sparse_prefill
from hshare.config import ConfigError, HShareConfig
from hshare.labels import LabelCache
from hshare.quest import QuestPageCache
from hshare.selection import valid_columns_from_mask

from conftest import WIDE, assert_generates_as_dense, cache_kwarg, generate_with_logits, greedy, left_padded, tiny_llama

SMALL = dict(sink=2, local=4, heavy=6)  # N_c = 12


@pytest.mark.parametrize("preset", ["ds", "hshare-1_2-1_2-1_2", "quest"])
def test_budget_covering_the_prompt_equals_dense(llama, preset):
    ids, mask = left_padded([37, 20, 29])
    assert_generates_as_dense(llama, ids, mask, preset, new_tokens=6, sparse_prefill=True, **WIDE)


def brute_sparse_attention(query, key, value, keep, scale):
    """Loop over rows and query heads: softmax over the kept keys of the head's selection head."""
    batch, q_heads, steps, _ = query.shape
    kv_heads, sel_heads = key.shape[1], keep.shape[1]
    out = torch.zeros_like(query)
    for b in range(batch):
        for h in range(q_heads):
            kv, sel = h // (q_heads // kv_heads), h // (q_heads // sel_heads)
            for t in range(steps):
                columns = keep[b, sel, t].nonzero().flatten()
                if len(columns):
                    weights = torch.softmax(query[b, h, t] @ key[b, kv, columns].T * scale, -1)
                    out[b, h, t] = weights @ value[b, kv, columns]
    return out.transpose(1, 2)


def padded_causal_mask(lengths, width):
    valid = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, length in enumerate(lengths):
        valid[row, width - length:] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (valid[:, None, :] & causal[None])[:, None]  # [B, 1, T, n], pad query rows see nothing


@pytest.mark.parametrize("policy", ["labels", "quest"])
@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
def test_masks_and_attention_against_brute_force(monkeypatch, policy, selection):
    """Each query row: exactly min(N_c, its valid causal keys) keys per selection head, all valid, sink
    and local included; the attention (GQA folded, several chunks) equals a loop over the masks."""
    gen = torch.Generator().manual_seed(0)
    lengths, width, kv_heads, q_heads, dim = [30, 17, 25], 30, 2, 4, 8
    query = torch.randn(3, q_heads, width, dim, generator=gen, dtype=torch.float64)
    key = torch.randn(3, kv_heads, width, dim, generator=gen, dtype=torch.float64)
    value = torch.randn(3, kv_heads, width, dim, generator=gen, dtype=torch.float64)
    attention_mask = padded_causal_mask(lengths, width)
    last_valid = attention_mask[:, 0, -1]
    sel_heads = kv_heads if selection == "kv_head" else q_heads
    if policy == "labels":
        channels = torch.stack([torch.randperm(dim, generator=gen)[:4] for _ in range(sel_heads)])[None]
        store = LabelCache(channels, 16, kv_heads)
    else:
        store = QuestPageCache(sel_heads, kv_heads, 4)
    store.append(key, last_valid)

    masks = []
    original = sparse_prefill.prefill_critical_mask

    def capture(scores, valid, sink, local, heavy):
        keep = original(scores, valid, sink, local, heavy)
        masks.append((keep, valid))
        return keep

    monkeypatch.setattr(sparse_prefill, "prefill_critical_mask", capture)
    monkeypatch.setattr(sparse_prefill, "CHUNK_ELEMENTS", 3 * sel_heads * width * 7)  # chunks of 7 rows
    out = sparse_prefill.sparse_prefill_attention(query, key, value, attention_mask, 0.3, store, 2, 3, 5)
    assert len(masks) == 5
    keep = torch.cat([k for k, _ in masks], dim=2)  # [B, H_sel, T, n]
    valid = torch.cat([v for _, v in masks], dim=1)  # [B, T, n]
    assert keep.shape == (3, sel_heads, width, width)
    n_valid = valid.sum(-1)  # [B, T]
    assert torch.equal(keep.sum(-1), n_valid.clamp(max=10)[:, None].expand(-1, sel_heads, -1))
    assert not bool((keep & ~valid[:, None]).any()), "a kept column is not a valid causal key"
    rank = valid.long().cumsum(-1) - 1
    windows = valid & ((rank < 2) | (rank >= n_valid[..., None] - 3))
    assert bool((keep | ~windows[:, None]).all()), "sink or local missing"
    assert not torch.equal(keep, valid[:, None].expand_as(keep)), "the budget should cut the long rows"
    reference = brute_sparse_attention(query, key, value, keep, 0.3)
    rows_with_keys = n_valid > 0  # pad query rows: no key, output unused
    torch.testing.assert_close(out[rows_with_keys], reference[rows_with_keys])  # [B, T, Hq, d]


def test_generate_masks_have_the_budget_and_logits_differ(monkeypatch):
    model = tiny_llama()
    ids, mask = left_padded([40, 23, 31])
    counts = []
    original = sparse_prefill.prefill_critical_mask

    def capture(scores, valid, sink, local, heavy):
        keep = original(scores, valid, sink, local, heavy)
        counts.append(bool(torch.equal(keep.sum(-1), valid.sum(-1).clamp(max=12)[:, None].expand_as(keep[..., 0])))
                      and not bool((keep & ~valid[:, None]).any()))
        return keep

    monkeypatch.setattr(sparse_prefill, "prefill_critical_mask", capture)
    _, dense_logits = generate_with_logits(model, ids, mask, new_tokens=3)
    with hshare.patched(model, "ds", **SMALL):
        _, decode_only = generate_with_logits(model, ids, mask, new_tokens=3)
    assert not counts
    with hshare.patched(model, "ds", sparse_prefill=True, **SMALL):
        _, both = generate_with_logits(model, ids, mask, new_tokens=3)
    assert len(counts) == 4 and all(counts)  # one chunk per layer, every row at the budget
    assert torch.equal(decode_only[:, 0], dense_logits[:, 0])  # the first token comes from the prefill
    assert not torch.allclose(both[:, 0], dense_logits[:, 0], atol=1e-4)


def test_streaming_prefill_keeps_sink_and_local_only(monkeypatch):
    model = tiny_llama()
    ids, mask = left_padded([30, 18])
    kept = []
    original = sparse_prefill.prefill_critical_mask
    monkeypatch.setattr(sparse_prefill, "prefill_critical_mask",
                        lambda *args: kept.append(original(*args)) or kept[-1])
    with hshare.patched(model, "streaming", sink=2, local=5, sparse_prefill=True):
        greedy(model, ids, mask, new_tokens=2)
    valid = valid_columns_from_mask(None, 1, 30, 30, torch.device("cpu"))[0]  # row 0: no padding
    assert torch.equal(kept[0][0, 0].sum(-1), valid.sum(-1).clamp(max=7))


def test_dense_layers_stay_dense_at_prefill(monkeypatch):
    model = tiny_llama()
    ids, mask = left_padded([40, 23])
    calls = []
    original = sparse_prefill.sparse_prefill_attention
    monkeypatch.setattr("hshare.attention.sparse_prefill_attention",
                        lambda *args: calls.append(1) or original(*args))
    with hshare.patched(model, "ds", sparse_prefill=True, dense_layers=[0, 2], **SMALL):
        greedy(model, ids, mask, new_tokens=2)
    assert len(calls) == 2


def test_shared_prefix_and_sparse_prefill():
    with pytest.raises(ConfigError, match="sparse_prefill.*prefix.*accepted"):
        HShareConfig(sparse_prefill=True, prefix="on")
    assert not HShareConfig(sparse_prefill=True).shares_prefix and HShareConfig().shares_prefix
    with pytest.raises(ConfigError, match="sparse_prefill.*accepted: true or false"):
        HShareConfig(sparse_prefill="yes")
    model = tiny_llama()
    common = torch.randint(3, 160, (30,), generator=torch.Generator().manual_seed(0))
    ids = torch.stack([torch.cat((common, torch.tensor([5 + r, 9]))) for r in range(3)])
    mask = torch.ones_like(ids)
    with hshare.patched(model, "ds", sparse_prefill=True, prefix="auto", prefix_min_tokens=1, prefix_min_batch=1,
                        prefix_min_saved_tokens=0, **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=3, **cache_kwarg(cache))
    assert cache.prefix is None  # auto does not share with sparse prefill
    with hshare.patched(model, "ds", prefix="auto", prefix_min_tokens=1, prefix_min_batch=1,
                        prefix_min_saved_tokens=0, **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=3, **cache_kwarg(cache))
    assert cache.prefix is not None  # the same prompts share without it
