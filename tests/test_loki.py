"""The Loki selection policy: principal components, scores, full-rank exactness, static writes, and
generate under sharing, static decode and a shared prefix."""

import os

import pytest
import torch

import hshare
from hshare import static_decode
from hshare.config import ConfigError, HShareConfig
from hshare.loki import LokiKeyCache, principal_components

from conftest import VOCAB, WIDE, assert_rows_equal_alone, cache_kwarg, greedy, left_pad, left_padded, tiny_llama

SMALL = dict(sink=2, local=4, heavy=8)
SHARING = dict(layer_sharing="1/2", head_sharing="1/2", query_sharing="1/2")  # hshare-style ratios


def padded_keys(lengths, decoded=0, kv_heads=2, dim=8, seed=0):
    """Left-padded float64 keys ``[B, Hkv, n, d]`` whose channels have distinct spreads (distinct
    principal directions) and a common offset, pads holding garbage; and their validity ``[B, n]``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    spread = torch.linspace(4.0, 0.5, dim, dtype=torch.float64)
    rotation = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))[0]
    keys = (torch.randn(len(lengths), kv_heads, width + decoded, dim, generator=gen, dtype=torch.float64) * spread
            ) @ rotation + 2.0
    valid = torch.ones(len(lengths), width + decoded, dtype=torch.bool)
    for row, length in enumerate(lengths):
        valid[row, :width - length] = False
        keys[row, :, :width - length] = 1e6  # garbage that must not reach the statistics
    return keys, valid


def hand_components(keys, valid, rank):
    """The top-`rank` principal directions of each row's and KV head's valid keys, one matrix at a time."""
    batch, kv_heads, _, dim = keys.shape
    out = torch.zeros(batch, kv_heads, dim, rank, dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            rows = [keys[b, h, j] for j in range(keys.shape[2]) if valid[b, j]]
            mean = sum(rows) / len(rows)
            covariance = sum(torch.outer(k - mean, k - mean) for k in rows) / len(rows)
            values, vectors = torch.linalg.eigh(covariance)
            out[b, h] = vectors[:, values.argsort(descending=True)[:rank]]
    return out


def loki_cache(keys, valid, prompt, q_heads, selection="kv_head", rank=None, reserve=0, query=None):
    """A `LokiKeyCache` made from the first `prompt` columns (with validity), then fed the rest one
    column at a time (decode appends)."""
    kv_heads = keys.shape[1]
    config = HShareConfig(policy="loki", loki_rank=rank, selection=selection)
    if query is None:
        query = torch.zeros(keys.shape[0], q_heads, prompt, keys.shape[-1], dtype=keys.dtype)
    cache = LokiKeyCache.from_prefill(config, None, 0, query, keys[:, :, :prompt], valid[:, :prompt], kv_heads,
                                      reserve)
    cache.append(keys[:, :, :prompt], valid[:, :prompt])
    for column in range(prompt, keys.shape[2]):
        cache.append(keys[:, :, column:column + 1])
    return cache


def brute_scores(query, keys, components, sel_heads):
    """``[B, H_sel, Q, n]``: sum over the selection head's query heads h of (q_h P) . (k P)."""
    batch, q_heads, steps, _ = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    group = q_heads // sel_heads
    out = torch.zeros(batch, sel_heads, steps, n, dtype=torch.float64)
    for b in range(batch):
        for s in range(sel_heads):
            kv = s * kv_heads // sel_heads
            projection = components[b, kv]
            for t in range(steps):
                for h in range(s * group, (s + 1) * group):
                    out[b, s, t] += (keys[b, kv] @ projection) @ (query[b, h, t] @ projection)
    return out


def test_principal_components_match_hand_computed_pca():
    keys, valid = padded_keys([23, 11, 17], kv_heads=2)
    got = principal_components(keys, valid, 3)
    expected = hand_components(keys, valid, 3)
    assert got.shape == (3, 2, 8, 3)
    torch.testing.assert_close(got.transpose(-1, -2) @ got, torch.eye(3, dtype=torch.float64).expand(3, 2, 3, 3))
    # eigenvectors are defined up to sign: compare the projections onto the subspaces
    torch.testing.assert_close(got @ got.transpose(-1, -2), expected @ expected.transpose(-1, -2),
                               rtol=1e-9, atol=1e-9)


def test_a_short_prompt_keeps_only_its_directions_of_variance():
    """3 valid keys span 2 directions around their mean: the other components are zero, not null-space
    vectors chosen by rounding, so the padded row projects as the row alone."""
    keys, valid = padded_keys([3, 20], kv_heads=2, seed=7)
    got = principal_components(keys, valid, 4)
    alone = principal_components(keys[:1, :, -3:], valid[:1, -3:], 4)
    assert bool((got[0, :, :, 2:] == 0).all()) and bool((got[1] != 0).any(-2).all())
    expected = hand_components(keys[:1], valid[:1], 2)
    for components in (got[:1], alone):
        torch.testing.assert_close(components @ components.transpose(-1, -2), expected @ expected.transpose(-1, -2),
                                   rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
@pytest.mark.parametrize("kv_heads,q_heads", [(2, 4), (4, 4)])
def test_scores_match_brute_force(selection, kv_heads, q_heads):
    """Padding, GQA, decode appends; decode scores of row and head subsets; prefill scores."""
    keys, valid = padded_keys([21, 9, 14], decoded=6, kv_heads=kv_heads, seed=1)
    cache = loki_cache(keys, valid, 21, q_heads, selection, rank=3)
    sel_heads = kv_heads if selection == "kv_head" else q_heads
    assert cache.sel_heads == sel_heads and cache.length == 27 and cache.scored_units() == 27
    query = torch.randn(3, q_heads, 2, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected = brute_scores(query, keys, hand_components(keys[:, :, :21], valid[:, :21], 3), sel_heads)
    torch.testing.assert_close(cache.prefill_scores(cache.score_query(query)), expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(cache.decode_scores(query[:, :, 0]), expected[:, :, 0], rtol=1e-9, atol=1e-9)
    rows, heads = torch.tensor([2, 0]), torch.tensor([[sel_heads - 1, 0]])
    subset = cache.decode_scores(query[:, :, 0], rows=rows, heads=heads)
    torch.testing.assert_close(subset, expected[:, :, 0][rows[:, None], heads.expand(2, -1)], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
def test_full_rank_top_k_is_the_exact_logits_top_k(selection):
    keys, valid = padded_keys([40, 25, 33], decoded=3, kv_heads=2, seed=3)
    cache = loki_cache(keys, valid, 40, 4, selection, rank=8)
    query = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    sel_heads = cache.sel_heads
    grouped = query.reshape(3, sel_heads, 4 // sel_heads, 8).sum(2)  # [B, H_sel, d]
    kv_of_sel = torch.arange(sel_heads) * 2 // sel_heads
    exact = torch.einsum("bsd,bsnd->bsn", grouped, keys[:, kv_of_sel])
    scores = cache.decode_scores(query)
    middle = valid[:, None].expand_as(exact)
    torch.testing.assert_close(scores[middle], exact[middle], rtol=1e-9, atol=1e-6)
    minus = torch.tensor(float("-inf"), dtype=torch.float64)
    top = torch.where(middle, scores, minus).topk(12, dim=-1).indices.sort(-1).values
    reference = torch.where(middle, exact, minus).topk(12, dim=-1).indices.sort(-1).values
    assert torch.equal(top, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("selection,kv_heads", [("kv_head", 2), ("query_head", 2), ("kv_head", 4)])
def test_16_bit_decode_selection_is_the_fused_label_top_k(monkeypatch, dtype, selection, kv_heads):
    """16-bit projected keys: `decode_heavy` is the label top-k with the keys as 16-bit labels, each selection
    head reading its KV head. Against the brute force: the chosen columns are the selectable columns of the best
    `decode_scores` (a set; ties within rounding either way), short windows hold NO_TOKEN; rows and heads
    subsets; the Triton kernel (interpreted on CPU) equals the twin column for column."""
    keys, valid = padded_keys([37, 20, 29], decoded=4, kv_heads=kv_heads, dim=16, seed=5)
    cache = loki_cache(keys.to(dtype), valid, 37, 4, selection, rank=int(torch.randint(2, 7, ())) * 2)
    assert cache.projected.view().dtype == dtype and cache.projected.view().stride(-2) == 1  # channel-major
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
    query = torch.randn(3, 4, 16, generator=gen).to(dtype)
    selectable = valid & (torch.rand(valid.shape, generator=gen) < 0.8)
    selectable[1, :] = selectable[1, :] & (torch.arange(valid.shape[1]) > 30)  # a short window
    for heavy in (5, 12):
        for rows, heads in ((None, None), (torch.tensor([2, 1]), torch.tensor([[cache.sel_heads - 1, 0]]))):
            window = selectable if rows is None else selectable.index_select(0, rows)
            monkeypatch.setenv("HSHARE_KERNELS", "torch")
            got = cache.decode_heavy(query, window, heavy, rows, heads)
            scores = cache.decode_scores(query, rows, heads)  # fp32 of the same 16-bit keys
            minus = torch.tensor(float("-inf"))
            ranked = torch.where(window[:, None], scores, minus)
            for a in range(got.shape[0]):
                for h in range(got.shape[1]):
                    chosen = got[a, h][got[a, h] >= 0]
                    assert len(chosen) == min(heavy, int(window[a].sum())) and bool(window[a, chosen].all())
                    assert len(set(chosen.tolist())) == len(chosen)
                    if len(chosen) < int(window[a].sum()):  # nothing left out scores above what was taken
                        left = ranked[a, h].clone()
                        left[chosen] = minus
                        taken = float(ranked[a, h, chosen].min())
                        assert float(left.max()) <= taken + 1e-5 * abs(taken) + 1e-4  # rounding of the sums
            if os.environ.get("TRITON_INTERPRET") == "1":
                monkeypatch.setenv("HSHARE_KERNELS", "triton")
                assert torch.equal(cache.decode_heavy(query, window, heavy, rows, heads), got)


def test_static_writes_equal_appends():
    """Static shapes: the prompt appended, the layer's reserved key buffer written one device-tensor
    column at a time; the projections and scores of the written columns are the appended ones, the
    unwritten columns score 0, every reserved column is scored, and thaw returns to the written ones."""
    keys, valid = padded_keys([23, 11, 17], decoded=9, seed=5)
    reserve = 23 + 9 + 4
    eager = loki_cache(keys, valid, 23, 4, rank=3)
    static = loki_cache(keys[:, :, :23], valid[:, :23], 23, 4, rank=3, reserve=reserve)
    static.freeze(reserve)
    whole = torch.cat((keys, torch.randn_like(keys[:, :, :4])), dim=2)  # the layer's reserved key buffer
    for column in range(23, 32):
        static.write(torch.tensor([column]), whole)
    assert static.length == reserve and static.scored_units() == reserve
    assert torch.equal(static.projected.view()[:, :, :32], eager.projected.view())
    query = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    scores = static.decode_scores(query)
    assert scores.shape == (3, 2, reserve) and bool((scores[..., 32:] == 0).all())
    torch.testing.assert_close(scores[..., :32], eager.decode_scores(query), rtol=0, atol=0)
    static.thaw(32)
    assert static.length == 32 and static.scored_units() == 32


def test_rank_is_validated():
    assert HShareConfig(policy="loki").policy.rank_at(64) == 16 and HShareConfig(policy="loki").policy.rank_at(2) == 1
    assert HShareConfig(policy="loki", loki_rank=5).policy.rank_at(64) == 5
    for bad in (0, 2000, 2.5, True, "8"):
        with pytest.raises(ConfigError, match="policy.rank.*accepted: an integer in \\[1, 1024\\]"):
            HShareConfig(policy="loki", loki_rank=bad)
    with pytest.raises(ConfigError, match="policy.rank = 32 exceeds the model's head_dim 16"):
        HShareConfig(policy="loki", loki_rank=32).validate_for_model(4, 16)
    with pytest.raises(ConfigError, match="policy.rank = 32 exceeds the model's head_dim 16"):
        HShareConfig(policy="loki", loki_rank=32).policy.rank_at(16)


def test_preset_and_budget_names():
    loki = HShareConfig.from_preset("loki")
    assert (loki.policy.name, loki.policy.rank, loki.budget.total) == ("loki", None, 128)
    assert (loki.sharing.layer, loki.sharing.head, loki.sharing.query_group) == (1.0, 1.0, 1)
    big = HShareConfig.from_preset("loki@512")
    assert (big.budget.sink, big.budget.local, big.budget.heavy, big.policy.name, big.name) == (16, 64, 432, "loki", "loki@512")
    assert "loki@2048" in hshare.preset_names()


# ---- generate ---------------------------------------------------------------------------------

def greedy_with_logits(model, ids, mask, new_tokens=10, **kwargs):
    """`greedy`'s tokens and the logits of every step ``[B, new_tokens, vocab]``."""
    out = greedy(model, ids, mask, new_tokens, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("preset,overrides", [("loki", {}), ("hshare-1_2-1_2-1_2", {"policy": "loki"})])
@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
def test_budget_covering_context_equals_dense(llama, preset, overrides, selection):
    ids, mask = left_padded([37, 20, 29], torch.Generator().manual_seed(7))
    ref_tokens, ref_logits = greedy_with_logits(llama, ids, mask)
    with hshare.patched(llama, preset, selection=selection, **overrides, **WIDE):
        tokens, logits = greedy_with_logits(llama, ids, mask)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selection,heads_scored", [("kv_head", 1), ("query_head", 2)])
def test_sharing_plans_work_with_loki(selection, heads_scored):
    model = tiny_llama()  # 4 layers, 4 query heads, 2 KV heads, head_dim 16: rank 4
    ids, mask = left_padded([40, 33, 50], torch.Generator().manual_seed(8))
    dense = greedy(model, ids, mask, new_tokens=10)
    with hshare.patched(model, "hshare-1_2-1_2-1_2", policy="loki", selection=selection, **SMALL):
        cache = hshare.new_cache(model)
        out = greedy(model, ids, mask, new_tokens=10, **cache_kwarg(cache))
    stats = cache.stats
    assert stats.plans == 1 and stats.selection_steps == 5
    assert stats.score_computations == 5 * 2 * heads_scored * 3  # half the layers, half the heads
    width = ids.shape[1]
    columns = sum(width + step for step in range(1, 10, 2))  # cached columns at each selection step
    assert stats.scored_tokens == 2 * heads_scored * 3 * columns and stats.scored_pages == 0
    assert out.shape == (3, width + 10) and not torch.equal(out, dense)
    rank, head_dim = 4, 16
    assert all(cache.layers[i].policy.components.shape == (3, 2, head_dim, rank) for i in cache.sparse_layers)
    projected = 4 * 3 * 2 * (width + 9) * rank * 4  # layers x rows x KV heads x columns x r x float32
    assert cache.label_bytes() == projected


@pytest.mark.parametrize("preset,overrides", [
    ("loki", {}),
    ("hshare-1_2-1_2-1_2", {"policy": "loki", "plan_scope": "sample"}),  # a per-batch plan depends on the batch
    ("hshare-1_2-1_2-1_2", {"policy": "loki", "plan_scope": "sample", "selection": "query_head"}),
])
def test_padded_rows_equal_rows_alone(preset, overrides):
    """Each row's principal directions come from its own valid prompt keys: a row's tokens never
    depend on its batch mates or their padding."""
    model = tiny_llama(dtype=torch.float64)
    lengths = [30, 45, 11, 38]
    ids, mask = left_padded(lengths, torch.Generator().manual_seed(9))
    with hshare.patched(model, preset, **{**SMALL, **overrides}):
        assert_rows_equal_alone(model, ids, mask, lengths, new_tokens=12)


def test_beam_search_equals_unpatched_within_the_budget():
    model = tiny_llama()
    ids, mask = left_padded([36, 24], torch.Generator().manual_seed(10))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kwargs)
    with hshare.patched(model, "loki", **WIDE):
        assert torch.equal(model.generate(ids, **kwargs), reference)


@pytest.mark.parametrize("preset,overrides", [
    ("loki", SMALL),
    ("hshare-1_2-1_2-1_2", dict(SMALL, policy="loki")),
    ("hshare-7_8-3_4-1_2", dict(SMALL, policy="loki", selection="query_head", plan_scope="sample")),
])
def test_static_decode_equals_eager(monkeypatch, preset, overrides):
    """Static shapes on the CPU (the step a CUDA graph captures, run eagerly): the projected keys are
    written at a device-tensor column; tokens and work equal eager decode's, every reserved column scored."""
    monkeypatch.setattr(static_decode, "STATIC_ON_CPU", True)
    model = tiny_llama(kv_heads=2, layers=4)
    ids, mask = left_padded([31, 18, 26, 9], torch.Generator().manual_seed(11))
    runs = {}
    for static in (False, True):
        with hshare.patched(model, preset, cuda_graphs=static, **overrides):
            cache = hshare.new_cache(model)
            runs[static] = greedy(model, ids, mask, new_tokens=8, **cache_kwarg(cache)), cache
    (eager, eager_cache), (tokens, cache) = runs[False], runs[True]
    assert cache.static_decode.reason == "" and eager_cache.static_decode.reason == "cuda_graphs=False"
    assert torch.equal(tokens, eager)
    for name in ("decode_steps", "sparse_steps", "selection_steps", "score_computations", "plans", "kv_rows_read"):
        assert getattr(cache.stats, name) == getattr(eager_cache.stats, name), name
    assert cache.stats.score_computations > 0
    assert cache.stats.scored_tokens == cache.stats.score_computations * cache.reserve


def test_shared_prefix_budget_covering_own_part_equals_unpatched():
    model = tiny_llama()
    generator = torch.Generator().manual_seed(12)
    prefix = torch.randint(3, VOCAB, (50,), generator=generator)
    ids, mask = left_pad([torch.cat((prefix, torch.randint(3, VOCAB, (n,), generator=generator))) for n in (6, 11)])
    ref_tokens, ref_logits = greedy_with_logits(model, ids, mask, new_tokens=8)
    with hshare.patched(model, "loki", prefix="on"):
        cache = hshare.new_cache(model)
        tokens, logits = greedy_with_logits(model, ids, mask, new_tokens=8, **cache_kwarg(cache))
    assert cache.prefix is not None and cache.prefix.width == 50
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides", [{}, dict(SHARING, plan_scope="sample")])
def test_shared_prefix_own_part_selection_independent_of_sharing(monkeypatch, overrides):
    """Rows decoded together with their prefix held once give the tokens of each row decoded alone
    with the prefix split at the same point: the own part's principal directions, scores and
    selection are the row's own."""
    model = tiny_llama(dtype=torch.float64)
    generator = torch.Generator().manual_seed(13)
    prefix = torch.randint(3, VOCAB, (30,), generator=generator)
    prompts = [torch.cat((prefix, torch.randint(3, VOCAB, (n,), generator=generator))) for n in (26, 40, 33)]
    ids, mask = left_pad(prompts)
    with hshare.patched(model, "loki", prefix="on", **SMALL, **overrides):
        cache = hshare.new_cache(model)
        batch = greedy(model, ids, mask, new_tokens=9, **cache_kwarg(cache))
        assert cache.prefix.width == 30 and cache.stats.sparse_steps > 0

        import hshare.shared_generate as shared_generate
        detect = shared_generate.detect_shared_prefix
        monkeypatch.setattr(shared_generate, "detect_shared_prefix", lambda p, *a: detect(p, *a).__class__(30, []))
        for row, prompt in enumerate(prompts):
            alone = greedy(model, prompt[None], torch.ones(1, len(prompt), dtype=torch.long), new_tokens=9)
            assert torch.equal(alone[0, len(prompt):], batch[row, ids.shape[1]:]), f"row {row} differs"
