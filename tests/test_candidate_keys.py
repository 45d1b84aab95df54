"""Candidate refinement by exact logits (`kernels.candidate_key_topk`, ``refine_by="keys"``): the twin against a
brute force in fp64, the Triton kernel (interpreted on CPU) against the twin, over GQA groups, head dims, dtypes,
rows and heads given by index, masks, short and multi-span candidate lists, ties, non-finite keys and the in-place
refinement of some heads."""

import pytest
import torch

from hshare.kernels import NO_TOKEN, candidate_key_topk, candidate_key_topk_torch

from test_label_topk import DEVICE, check_candidates, triton_or_skip, valid_candidates, window_case

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)


def key_case(dtype=torch.float32, group=2, dim=16, n=120, width=40, seed=3):
    """Keys ``[3, 2, n, dim]``, a decode query of `group` query heads a KV head, rows and heads by index, candidate
    lists of valid columns with no-candidate entries, one of 25 candidates and one of 5, and the rows' windows as a
    mask and as bounds (`test_label_topk.window_case`)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, n, dim, generator=generator).to(DEVICE, dtype)
    query = torch.randn(3, 2 * group, dim, generator=generator).to(DEVICE, dtype)
    rows = torch.tensor([2, 0, 1], device=DEVICE)
    heads = torch.tensor([[1, 0], [0, 0], [1, 1]], device=DEVICE)
    valid, window, selectable = window_case(3, n, generator)
    candidates = valid_candidates(valid, 2, width, generator)
    candidates[0, 1, 25:] = NO_TOKEN
    candidates[2, 0, :width - 5] = NO_TOKEN
    return query, keys, rows, heads, candidates.to(DEVICE), selectable.to(DEVICE), window.to(DEVICE)


def exact_scores(query, keys, rows, heads, candidates):
    """fp64 ``[A, H', C]``: the group-summed query of (row, head) against each candidate's key."""
    group = query.shape[1] // keys.shape[1]
    grouped = query.double().reshape(query.shape[0], keys.shape[1], group, -1).sum(2)  # [B, Hkv, d]
    row_index, head_index = rows[:, None], heads.expand(len(rows), -1)
    picked = keys.double()[row_index[..., None], head_index[..., None], candidates.clamp(min=0)]  # [A, H', C, d]
    return torch.einsum("ahcd,ahd->ahc", picked, grouped[row_index, head_index])


def allowed_of(candidates, selectable, rows):
    inside = selectable[:, None].expand(-1, candidates.shape[1], -1).gather(-1, candidates.clamp(min=0))
    return (candidates >= 0) & inside


@pytest.mark.parametrize("group,dim", [(1, 16), (2, 16), (3, 32)])
def test_twin_is_the_exact_top_k(group, dim):
    query, keys, rows, heads, candidates, selectable, window = key_case(group=group, dim=dim)
    for heavy, bounds in ((12, window), (40, None), (3, window)):
        got = candidate_key_topk_torch(query, keys, heavy, candidates, bounds, rows, heads)
        allowed = allowed_of(candidates, torch.ones_like(selectable) if bounds is None else selectable, rows)
        check_candidates(got, candidates, exact_scores(query, keys, rows, heads, candidates), allowed, heavy, 1e-5)
    assert int((got[2, 0] != NO_TOKEN).sum()) == min(3, int(allowed_of(candidates, selectable, rows)[2, 0].sum()))


@pytest.mark.parametrize("dtype,group,dim,width", [(torch.bfloat16, 2, 16, 40), (torch.float16, 3, 32, 40),
                                                   (torch.float32, 1, 16, 40), (torch.bfloat16, 4, 64, 700)])
def test_triton_matches_the_twin(dtype, group, dim, width):
    """700 candidates: two spans of a row-head, whose last program picks from both."""
    triton_or_skip()
    from hshare.kernels.candidate_keys_triton import candidate_key_topk_triton

    query, keys, rows, heads, candidates, selectable, window = key_case(dtype, group, dim, n=1000, width=width)
    scores = exact_scores(query.float(), keys.float(), rows, heads, candidates)
    for heavy, bounds in ((12, window), (width, None), (200, window)):
        got = candidate_key_topk_triton(query, keys, heavy, candidates, bounds, rows, heads)
        want = candidate_key_topk_torch(query, keys, heavy, candidates, bounds, rows, heads)
        allowed = allowed_of(candidates, torch.ones_like(selectable) if bounds is None else selectable, rows)
        check_candidates(got, candidates, scores, allowed, heavy, 1e-2)
        if DEVICE == "cpu":  # the interpreter's fp32 scores: the twin's very set
            assert torch.equal(got.sort(-1).values, want.sort(-1).values)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf x 0 of a non-finite key
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_ties_non_finite_and_every_row_and_head(monkeypatch, kernels):
    """Equal logits go to the earlier candidate; a key with a non-finite element is never chosen; rows and heads
    None take every row and head in order."""
    if kernels == "triton":
        triton_or_skip()
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    query, keys, _, _, candidates, _, _ = key_case(torch.bfloat16)
    keys = keys.clone()
    keys[0, 0] = keys[0, 0, :1]  # every column of (row 0, head 0) the same key: all tied
    keys[1, 1, candidates[1, 1, :4].clamp(min=0)] = float("inf")  # (row 1, head 1): its first four never chosen
    got = candidate_key_topk(query, keys, 6, candidates)
    assert torch.equal(got[0, 0], candidates[0, 0, :6])
    assert not set(candidates[1, 1, :4].tolist()) & set(got[1, 1].tolist())
    assert int((got[1, 1] != NO_TOKEN).sum()) == 6
    want = candidate_key_topk_torch(query, keys, 6, candidates)
    assert torch.equal(got[2].sort(-1).values, want[2].sort(-1).values)


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_some_heads_refine_in_place(monkeypatch, kernels):
    if kernels == "triton":
        triton_or_skip()
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    query, keys, rows, _, candidates, _, window = key_case(torch.bfloat16)
    some = torch.tensor([[1], [0], [1]], device=DEVICE)
    out = torch.full((3, 2, 7), 99, dtype=torch.long, device=DEVICE)
    assert candidate_key_topk(query, keys, 7, candidates, window, rows, some, out=out) is out
    own = candidates.gather(1, some[..., None].expand(-1, -1, candidates.shape[-1]))
    want = candidate_key_topk_torch(query, keys, 7, own, window, rows, some)
    mine = some[..., None].expand(-1, -1, 7)
    assert torch.equal(out.gather(1, mine).sort(-1).values, want.sort(-1).values)
    assert bool((out.gather(1, 1 - mine) == 99).all())
    with pytest.raises(ValueError, match="heads"):
        candidate_key_topk(query, keys, 7, candidates, window, rows, out=out)
