"""The Quest selection policy: page bounds, page scores, whole-page selection, generate, sharing."""

import pytest
import torch

import hshare
from hshare.config import ConfigError, HShareConfig
from hshare.policy import SelectionPolicy
from hshare.quest import QuestPageCache, page_bounds_reference, pages_for
from hshare.selection import NO_TOKEN, select_heavy

from conftest import (WIDE, assert_generates_as_dense, assert_rows_equal_alone, cache_kwarg, greedy, left_padded,
                      tiny_llama)

SMALL = dict(sink=2, local=4, heavy=8, page_size=4)  # N_c = 14: two whole pages of heavy tokens


def random_keys(lengths, decoded=0, kv_heads=2, dim=8, dtype=torch.float64, seed=0):
    """Left-padded random keys ``[B, Hkv, n, d]`` (pads hold garbage) of prompts of `lengths`, then
    `decoded` valid columns, and their validity ``[B, n]``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    keys = torch.randn(len(lengths), kv_heads, width + decoded, dim, generator=gen, dtype=dtype) * 3
    valid = torch.ones(len(lengths), width + decoded, dtype=torch.bool)
    for row, length in enumerate(lengths):
        valid[row, :width - length] = False
    return keys, valid


def filled_cache(keys, valid, sel_heads, page_size, prompt=None, chunk=1):
    """A `QuestPageCache` fed a prefill of the first `prompt` columns (None = all, with validity),
    then the rest `chunk` columns at a time without validity (decode appends: all valid)."""
    cache = QuestPageCache(sel_heads, keys.shape[1], page_size)
    prompt = keys.shape[2] if prompt is None else prompt
    cache.append(keys[:, :, :prompt], valid[:, :prompt])
    for column in range(prompt, keys.shape[2], chunk):
        cache.append(keys[:, :, column:column + chunk])
    return cache


def brute_page_scores(query, keys, valid, page_size, sel_heads):
    """``[B, H_sel, Q, P]`` sum over the selection head's query heads and channels of
    max(q_c min_c, q_c max_c); pages without keys get None-like NaN."""
    low, high, has = page_bounds_reference(keys, valid, page_size)
    batch, q_heads, steps, _ = query.shape
    kv_heads = keys.shape[1]
    per_sel = q_heads // sel_heads
    out = torch.full((batch, sel_heads, steps, low.shape[2]), float("nan"), dtype=torch.float64)
    for b in range(batch):
        for s in range(sel_heads):
            kv = s * kv_heads // sel_heads
            for p in range(low.shape[2]):
                if not has[b, p]:
                    continue
                for t in range(steps):
                    total = 0.0
                    for h in range(s * per_sel, (s + 1) * per_sel):
                        q = query[b, h, t]
                        total += torch.maximum(q * low[b, kv, p], q * high[b, kv, p]).sum().item()
                    out[b, s, t, p] = total
    return out, has


@pytest.mark.parametrize("page_size", [4, 5, 1])
@pytest.mark.parametrize("decoded,chunk", [(0, 1), (9, 1), (9, 4)])
def test_page_bounds_match_brute_force(page_size, decoded, chunk):
    """Left padding, GQA, a partial last page, and pages completed by decode appends."""
    keys, valid = random_keys([23, 11, 17, 1], decoded)
    cache = filled_cache(keys, valid, 2, page_size, prompt=23, chunk=chunk)
    low, high, has = page_bounds_reference(keys, valid, page_size)
    n = 23 + decoded
    assert cache.pages == low.shape[2] == pages_for(n, page_size) and cache.length == n
    has = has[:, None, :, None].expand_as(low)
    assert torch.equal(cache.low.view()[has], low[has]) and torch.equal(cache.high.view()[has], high[has])
    big = torch.finfo(keys.dtype).max  # pages of padding only: sentinels
    assert bool((cache.low.view()[~has] == big).all()) and bool((cache.high.view()[~has] == -big).all())


@pytest.mark.parametrize("page_size", [4, 5, 1])
@pytest.mark.parametrize("spare", [0, 6])  # a generation that fills its reserve, and one that stops short
def test_static_writes_match_brute_force(page_size, spare):
    """Static shapes: pages reserved once (sentinels), the prompt appended, then each decode key
    written at a column held in a device tensor; the bounds are the brute-force ones, the pages not
    reached keep the sentinels, and every reserved slot / column is scored."""
    decoded = 9
    keys, valid = random_keys([23, 11, 17, 1], decoded)
    reserve = 23 + decoded + spare
    cache = QuestPageCache(2, keys.shape[1], page_size, reserve=reserve)
    cache.append(keys[:, :, :23], valid[:, :23])
    cache.freeze(reserve)
    assert cache.pages == pages_for(reserve, page_size) and cache.length == reserve
    whole = torch.cat((keys, torch.randn_like(keys[:, :, :spare])), dim=2)  # the layer's reserved key buffer
    for column in range(23, 23 + decoded):
        cache.write(torch.tensor([column]), whole)
    low, high, has = page_bounds_reference(keys, valid, page_size)
    reached = low.shape[2]
    has = has[:, None, :, None].expand_as(low)
    view_low, view_high = cache.low.view()[:, :, :reached], cache.high.view()[:, :, :reached]
    assert torch.equal(view_low[has], low[has]) and torch.equal(view_high[has], high[has])
    big = torch.finfo(keys.dtype).max
    assert bool((view_low[~has] == big).all()) and bool((cache.low.view()[:, :, reached:] == big).all())
    assert bool((cache.high.view()[:, :, reached:] == -big).all())
    cache.thaw(23 + decoded)  # back to growing pages where the static steps left them
    assert cache.length == 23 + decoded and cache.pages == reached


def test_padded_row_is_paged_as_the_row_alone():
    keys, valid = random_keys([19, 6], decoded=5, seed=3)
    cache = filled_cache(keys, valid, 2, 4, prompt=19)
    alone = filled_cache(keys[1:, :, 13:], valid[1:, 13:], 2, 4, prompt=6)
    assert cache.shift.tolist() == [0, 3] and alone.shift.tolist() == [0]  # row 1 starts at column 13
    for bounds, alone_bounds in ((cache.low, alone.low), (cache.high, alone.high)):  # 11 tokens: 3 pages
        assert torch.equal(bounds.view()[1, :, 4:7], alone_bounds.view()[0, :, :3])


def check_page_scores(cache, query, keys, valid, sel_heads):
    """The cache's page scores, all rows and heads and chosen subsets, against brute force."""
    expected, has = brute_page_scores(query, keys, valid, cache.page_size, sel_heads)
    got = cache.page_scores(query)
    mask = has[:, None, None, :].expand_as(got)
    if not torch.allclose(got[mask], expected[mask], rtol=1e-9, atol=1e-9):
        return False
    rows, heads = torch.tensor([2, 0]), torch.tensor([[sel_heads - 1, 0]])
    subset = cache.page_scores(query[:, :, :1], rows=rows, heads=heads)  # [2, 2, 1, P]
    reference = got[:, :, :1][rows[:, None], heads.expand(2, -1)]
    return torch.allclose(subset, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
@pytest.mark.parametrize("kv_heads,q_heads", [(2, 4), (4, 4)])
def test_page_scores_match_brute_force(selection, kv_heads, q_heads):
    keys, valid = random_keys([21, 9, 14], decoded=6, kv_heads=kv_heads)
    sel_heads = kv_heads if selection == "kv_head" else q_heads
    cache = filled_cache(keys, valid, sel_heads, 4, prompt=21)
    query = torch.randn(3, q_heads, 2, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert check_page_scores(cache, query, keys, valid, sel_heads)


def test_swapping_min_and_max_is_caught():
    """Mutation check: a cache whose min and max are swapped fails the page-score check."""
    keys, valid = random_keys([21, 9, 14])
    cache = filled_cache(keys, valid, 2, 4)
    query = torch.randn(3, 4, 2, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert check_page_scores(cache, query, keys, valid, 2)
    cache.low, cache.high = cache.high, cache.low
    assert not check_page_scores(cache, query, keys, valid, 2)


def test_the_heavy_budget_takes_whole_best_pages():
    """Top-`heavy` of the middle window by the policy's token scores = the middle tokens of the
    best pages (by brute-force page score), page after page, the last one cut."""
    page_size, heavy = 4, 10
    keys, valid = random_keys([30, 22], seed=5)
    cache = filled_cache(keys, valid, 2, page_size)
    query = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    scores, has = brute_page_scores(query[:, :, None], keys, valid, page_size, 2)
    # a middle window that cuts pages: sink of 3 tokens, local of 5
    rank = valid.long().cumsum(-1) - 1
    middle = valid & (rank >= 3) & (rank < valid.sum(-1, keepdim=True) - 5)
    chosen = select_heavy(cache.decode_scores(query), middle[:, None], heavy)  # [B, H, heavy]
    for b in range(2):
        column_page = (torch.arange(30) + cache.shift[b]) // page_size
        for h in range(2):
            got = sorted(chosen[b, h].tolist())
            assert NO_TOKEN not in got and all(bool(middle[b, c]) for c in got)
            page_score = scores[b, h, 0]
            pages = sorted((p for p in range(len(page_score)) if bool(middle[b][column_page == p].any())),
                           key=lambda p: (-page_score[p].item(), p))
            expected = []
            for p in pages:
                expected += [c for c in range(30) if column_page[c] == p and bool(middle[b, c])]
            assert got == sorted(expected[:heavy]), (b, h)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_decode_heavy_takes_the_set_of_the_ranking_keys(seed, page_size):
    """`decode_heavy` (page scores sorted, slots found by searches) = the top-`heavy` of the per-column
    ranking keys over any selectable mask (holes, short windows, empty rows), for rows and heads subsets,
    with tied pages (repeated keys) and a budget larger than the window."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(5, 40, (3,), generator=gen)]
    keys, valid = random_keys(lengths, decoded=3, kv_heads=2, dtype=torch.float32, seed=seed)
    keys[:, :, 10:20] = keys[:, :, :1]  # equal pages: ties broken toward the earlier page
    cache = filled_cache(keys, valid, 4 if seed % 2 else 2, page_size, prompt=max(lengths))
    query = torch.randn(3, 4, 8, generator=gen)
    n = keys.shape[2]
    selectable = valid & (torch.rand(3, n, generator=gen) < (0.5 if seed % 3 else 1.0))
    selectable[2, :] = selectable[2, :] & (seed != 4)  # an empty window
    for heavy in (1, 7, n + 3):
        for rows, heads in ((None, None), (torch.tensor([2, 0]), torch.tensor([[1, 0]])),
                            (torch.tensor([1]), torch.tensor([[cache.sel_heads - 1]]))):
            window = selectable if rows is None else selectable.index_select(0, rows)
            got = cache.decode_heavy(query, window, heavy, rows, heads)
            expected = select_heavy(cache.decode_scores(query, rows, heads), window[:, None], heavy)
            assert got.shape == expected.shape
            assert torch.equal(got.sort(-1).values, expected.sort(-1).values), (heavy, rows)


def test_decode_heavy_with_static_pages():
    """Frozen (static-shape) pages: every reserved page slot is ranked, unreached slots hold nothing."""
    keys, valid = random_keys([12, 7], decoded=0, seed=9)
    cache = QuestPageCache(2, 2, 4, reserve=30)
    cache.append(keys, valid)
    cache.freeze(30)
    query = torch.randn(2, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    selectable = torch.zeros(2, 30, dtype=torch.bool)
    selectable[:, :12] = valid
    got = cache.decode_heavy(query, selectable, 6)
    expected = select_heavy(cache.decode_scores(query), selectable[:, None], 6)
    assert torch.equal(got.sort(-1).values, expected.sort(-1).values)


def test_quest_is_a_selection_policy():
    assert isinstance(QuestPageCache(2, 2, 16), SelectionPolicy)
    assert HShareConfig.from_preset("quest").policy.name == "quest"
    big, shared = HShareConfig.from_preset("quest@512"), HShareConfig.from_preset("quest-1_2-1_2-1_2")
    assert (big.budget.sink, big.budget.local, big.budget.heavy, big.policy.page_size) == (16, 64, 432, 16)
    assert (shared.sharing.layer, shared.sharing.head, shared.sharing.query_group, shared.budget.total) == (0.5, 0.5, 2, 128)
    with pytest.raises(ConfigError, match="policy.*accepted: 'labels', 'loki', 'quest'"):
        HShareConfig(policy="h2o")
    with pytest.raises(ConfigError, match="page_size.*accepted"):
        HShareConfig(policy="quest", page_size=0)


@pytest.mark.parametrize("preset", ["quest", "quest-1_2-1_2-1_2"])
@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
def test_budget_covering_context_equals_dense(llama, preset, selection):
    ids, mask = left_padded([37, 20, 29])
    assert_generates_as_dense(llama, ids, mask, preset, selection=selection, **WIDE)


@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
def test_selected_columns_are_whole_pages_in_the_middle_never_padding(selection):
    model = tiny_llama()
    ids, mask = left_padded([45, 30, 52], torch.Generator().manual_seed(4))
    dense = greedy(model, ids, mask, new_tokens=8)
    with hshare.patched(model, "quest", selection=selection, **SMALL):
        cache = hshare.new_cache(model)
        sparse = greedy(model, ids, mask, new_tokens=8, **cache_kwarg(cache))
    windows = cache.planner.current.windows  # the last step selected (query groups of 1): its middle window
    for layer in cache.layers:
        heavy, shift = layer.heavy, layer.policy.shift
        assert heavy.shape == (3, cache.sel_heads, 8) and bool((heavy >= 0).all())
        for b in range(3):
            middle = windows.middle[b]
            page_of = (torch.arange(middle.shape[0]) + shift[b]) // 4
            for h in range(cache.sel_heads):
                picked = heavy[b, h]
                assert bool(windows.valid[b, picked].all()) and bool(middle[picked].all())
                partial = 0
                for page in page_of[picked].unique():
                    in_middle = int((middle & (page_of == page)).sum())
                    taken = int((page_of[picked] == page).sum())
                    partial += taken < in_middle
                assert partial <= 1, "more than one page taken in part"
    assert cache.stats.sparse_steps == 7 and cache.stats.scored_pages > 0
    assert not torch.equal(sparse, dense), "14 of ~50 tokens should change the greedy output"


@pytest.mark.parametrize("preset,overrides", [
    ("quest-1_2-1_2-1_2", {"plan_scope": "sample"}),  # a per-batch plan depends on the batch by design
    ("quest-1_2-1_2-1_2", {"plan_scope": "sample", "selection": "query_head"}),
    ("quest", {"page_size": 3}),
])
def test_padded_rows_equal_rows_alone(preset, overrides):
    """Pages start at each row's first valid token: a row's tokens never depend on its batch mates."""
    model = tiny_llama(dtype=torch.float64)
    lengths = [30, 45, 11, 38]
    ids, mask = left_padded(lengths)
    with hshare.patched(model, preset, **{**SMALL, **overrides}):
        assert_rows_equal_alone(model, ids, mask, lengths, new_tokens=12)


@pytest.mark.parametrize("selection,heads_scored", [("kv_head", 1), ("query_head", 2)])
def test_sharing_plans_work_with_quest(selection, heads_scored):
    model = tiny_llama()  # 4 layers, 4 query heads, 2 KV heads
    ids, mask = left_padded([40, 33, 50])
    with hshare.patched(model, "quest-1_2-1_2-1_2", selection=selection, **SMALL):
        cache = hshare.new_cache(model)
        out = greedy(model, ids, mask, new_tokens=10, **cache_kwarg(cache))
    stats = cache.stats
    assert stats.plans == 1 and stats.selection_steps == 5
    assert stats.score_computations == 5 * 2 * heads_scored * 3  # half the layers, half the heads
    copies = [layer for layer in cache.sparse_layers if int(cache.planner.sharing.layer_source[0, layer]) != layer]
    assert len(copies) == 2
    for layer in copies:  # a copying layer attends its source's pages
        source = int(cache.planner.sharing.layer_source[0, layer])
        assert torch.equal(cache.layers[layer].heavy, cache.layers[source].heavy)
    assert out.shape == (3, ids.shape[1] + 10)


def test_beam_search_and_label_bytes():
    model = tiny_llama()
    ids, mask = left_padded([36, 24])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kwargs)
    with hshare.patched(model, "quest", **WIDE):
        assert torch.equal(model.generate(ids, **kwargs), ref)
    with hshare.patched(model, "quest", **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=5, **cache_kwarg(cache))
    tokens = 36 + 4
    pages = pages_for(tokens, 4)
    assert cache.label_bytes() == 4 * 2 * (2 * 2 * pages * 16 * 4)  # layers x (min, max) x rows x Hkv x P x d x fp32


def test_quest_under_triton_dispatch(monkeypatch):
    """With the Triton kernels (CUDA, or the interpreter on CPU), Quest runs its page-score kernel beside
    the critical-indices and gather kernels and gives the twins' tokens; the label kernels are never called."""
    import hshare.labels

    def refuse(*args, **kwargs):
        raise AssertionError("a label kernel was called for Quest")

    monkeypatch.setattr(hshare.labels, "decode_label_scores", refuse)
    monkeypatch.setattr(hshare.labels, "append_labels", refuse)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama().to(device)
    ids, mask = (t.to(device) for t in left_padded([30, 21]))
    with hshare.patched(model, "quest", dense_fallback_mib=0, **SMALL):
        monkeypatch.setenv("HSHARE_KERNELS", "torch")
        reference = greedy(model, ids, mask, new_tokens=4)
        monkeypatch.setenv("HSHARE_KERNELS", "triton")
        assert torch.equal(greedy(model, ids, mask, new_tokens=4), reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,sel_heads,dim", [(4, 2, 2, 8), (4, 2, 4, 16), (6, 3, 3, 24)])
def test_page_score_kernel_matches_the_twin_and_brute_force(dtype, q_heads, kv_heads, sel_heads, dim):
    """The Triton page scores of a decode query (interpreted on CPU) against the twin and the brute force:
    GQA groups summed, a head dim that is not a power of two, empty pages (sentinel bounds), chosen rows
    and heads, bounds viewed out of a larger reserve."""
    pytest.importorskip("triton")
    import os
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from hshare.kernels import page_scores_torch
    from hshare.kernels.page_scores_triton import page_scores_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys, valid = random_keys([61, 40, 75], decoded=4, kv_heads=kv_heads, dim=dim, dtype=torch.float32, seed=7)
    cache = QuestPageCache(sel_heads, kv_heads, 4, reserve=keys.shape[2] + 12)
    cache.append(keys.to(dtype), valid)
    low, high = (bounds.view().to(device) for bounds in (cache.low, cache.high))
    query = torch.randn(3, q_heads, dim, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    brute, has = brute_page_scores(query[:, :, None].double().cpu(), keys.to(dtype).double(), valid, 4, sel_heads)
    for rows, heads in ((None, None), (torch.tensor([2, 0]), torch.tensor([[sel_heads - 1, 0]]))):
        count = 3 if rows is None else 2
        index_rows = torch.arange(3) if rows is None else rows
        index_heads = torch.arange(sel_heads)[None] if heads is None else heads
        got = page_scores_triton(query, low, high, sel_heads, index_rows.to(device), index_heads.to(device), block=8)
        twin = page_scores_torch(query[:, :, None], low, high, sel_heads, None if rows is None else rows.to(device),
                                 None if heads is None else heads.to(device))[:, :, 0]
        assert got.shape == twin.shape == (count, index_heads.shape[-1], low.shape[2])
        finite = torch.isfinite(twin)
        assert torch.equal(finite, torch.isfinite(got)) and bool((got[~finite] < 0).all())
        torch.testing.assert_close(got[finite], twin[finite], rtol=1e-5, atol=1e-4)
        reference = brute[index_rows[:, None], index_heads.expand(count, -1), 0]
        mask = has[index_rows][:, None].expand_as(reference)
        torch.testing.assert_close(got.cpu().double()[mask], reference[mask], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("seed,page_size", [(0, 1), (1, 3), (2, 16), (3, 4)])
def test_page_heavy_kernel_matches_the_twin_and_the_ranking_keys(seed, page_size):
    """The Triton heavy columns from page scores (interpreted on CPU) equal the twin's, slot for slot, and
    take the set of the top-`heavy` per-column ranking keys: tied scores (to the earlier page), ``-0.0``
    beside ``0.0``, ``-inf`` scores of pages without keys, windows with holes, an empty window, pages past
    the window (a static reserve), more pages than one block, budgets past the window's size."""
    pytest.importorskip("triton")
    import os
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from hshare.kernels import page_heavy_torch
    from hshare.kernels.page_topk_triton import page_heavy_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    rows, heads = 3, 1 + seed % 2
    n = int(torch.randint(200, 300, (1,), generator=gen))
    shift = torch.randint(0, page_size, (rows,), generator=gen)
    pages = (n + page_size - 1) // page_size + 1 + seed  # a reserve of unreached pages
    scores = torch.randn(rows, heads, pages, generator=gen)
    scores[:, :, ::3] = scores[:, :, ::3].round()  # ties
    scores[:, 0, ::7] = 0.0
    scores[:, 0, 3::7] = -0.0
    scores[:, -1, -3:] = float("-inf")
    selectable = torch.rand(rows, n, generator=gen) < 0.7
    selectable[:, :3] = False  # a sink
    selectable[1, n // 2:] = False  # a short window
    selectable[2] = selectable[2] & (seed != 2)  # an empty window
    args = (scores.to(device), selectable.to(device), shift.to(device), page_size)
    for heavy in (1, 37, n + 5) if seed == 0 else (37, n + 5):
        got = page_heavy_triton(*args, heavy)
        assert torch.equal(got, page_heavy_torch(*args, heavy)), heavy
        virtual = torch.arange(n)[None, :] + shift[:, None]
        rank = scores.sort(dim=-1, descending=True, stable=True).indices.argsort(-1)  # each page's rank
        keys = (pages - rank.gather(-1, (virtual // page_size)[:, None].expand(rows, heads, n))) * page_size \
            - (virtual % page_size)[:, None]
        expected = select_heavy(keys.double(), selectable[:, None], heavy)
        assert torch.equal(got.cpu().sort(-1).values, expected.sort(-1).values), heavy
