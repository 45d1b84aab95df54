"""Algorithm 1 (HShare section 4.3) on hand-worked examples, and its similarity statistic."""

import torch

from hshare.planner import build_plan, greedy_sharing, head_similarity, layer_overlaps, sources_for_ratio


def lower(entries, size):
    s = torch.zeros(size, size)
    for (i, j), value in entries.items():
        s[i, j] = value
    return s


def test_hand_example_two_copies():
    # pick (1,0)=0.9: remove row/col 1 -> S[2,1], S[3,1] gone; then (3,2)=0.7
    s = lower({(1, 0): 0.9, (2, 0): 0.2, (2, 1): 0.8, (3, 0): 0.1, (3, 1): 0.3, (3, 2): 0.7}, 4)
    assert greedy_sharing(s, 2).tolist() == [0, 0, 2, 2]


def test_removed_node_is_never_a_source():
    # after (2,1)=0.9 node 2 copies; S[3,2]=0.8 must not make 3 copy 2 -> next best (3,0)=0.1
    s = lower({(2, 1): 0.9, (3, 2): 0.8, (3, 0): 0.1, (1, 0): 0.05}, 4)
    assert greedy_sharing(s, 2).tolist() == [0, 1, 1, 0]


def test_chain_is_resolved():
    # (2,1)=0.9 then (1,0)=0.5: 2 -> 1 -> 0 becomes 2 -> 0
    s = lower({(1, 0): 0.5, (2, 1): 0.9, (2, 0): 0.1}, 3)
    assert greedy_sharing(s, 2).tolist() == [0, 0, 0]


def test_long_chain_is_resolved():
    size = 9
    s = lower({(i, i - 1): 0.1 * i for i in range(1, size)}, size)  # later pairs stronger: 8->7 first
    assert greedy_sharing(s, size - 1).tolist() == [0] * size


def test_ties_take_first_pair_in_row_major_order():
    s = torch.full((3, 3), 0.5)
    assert greedy_sharing(s, 1).tolist() == [0, 0, 2]
    assert greedy_sharing(s, 2).tolist() == [0, 0, 0]


def test_zero_similarity_still_meets_the_ratio():
    assert greedy_sharing(torch.zeros(4, 4), 3).tolist() == [0, 0, 0, 0]
    assert greedy_sharing(torch.zeros(4, 4), 0).tolist() == [0, 1, 2, 3]


def test_batched_equals_one_by_one():
    s = torch.rand(5, 6, 7, 7)
    batched = greedy_sharing(s, 4)
    for a in range(5):
        for b in range(6):
            assert torch.equal(batched[a, b], greedy_sharing(s[a, b], 4))
    assert bool((batched <= torch.arange(7)).all())
    sources = batched == torch.arange(7)
    assert bool((sources.sum(-1) == 3).all())
    assert bool(sources.gather(-1, batched).all()), "every node copies a source"


def test_sources_for_ratio():
    assert [sources_for_ratio(r, 32) for r in (1, 7 / 8, 3 / 4, 1 / 2)] == [32, 28, 24, 16]
    assert sources_for_ratio(0.5, 3) == 2 and sources_for_ratio(0.01, 3) == 1


def test_head_similarity_is_normalised_overlap():
    keep = torch.tensor([[[[0, 1, 2, 3]], [[2, 3, 4, 5]], [[0, 1, 2, -1]]]])  # [B=1, H=3, W=1, k=4]
    sim = head_similarity(keep, 6)[0]
    assert sim[1, 0].item() == 0.5 and sim[2, 0].item() == 1.0 and abs(sim[2, 1].item() - 1 / 3) < 1e-6
    assert sim[0, 2].item() == 0.75


def test_layer_overlap_matches_head_wise_mean():
    def keep_sets():  # distinct columns per set (as top-k gives), some slots empty (-1)
        cols = torch.stack([torch.randperm(20)[:5] for _ in range(12)]).reshape(2, 3, 2, 5)
        return torch.where(torch.rand(cols.shape) < 0.2, torch.full_like(cols, -1), cols)

    keep_a, keep_b = keep_sets(), keep_sets()
    got = layer_overlaps(keep_b, [keep_a], 20)
    for b in range(2):
        values = []
        for h in range(3):
            for w in range(2):
                sb = {c for c in keep_b[b, h, w].tolist() if c >= 0}
                sa = {c for c in keep_a[b, h, w].tolist() if c >= 0}
                values.append(len(sb & sa) / max(len(sb), 1))
        assert abs(got[b, 0].item() - sum(values) / len(values)) < 1e-6


def test_build_plan_counts_and_order():
    layers, heads, batch = 6, 4, 3
    sparse = [0, 2, 3, 4, 5]  # layer 1 dense
    head_sim = {l: torch.rand(batch, heads, heads) for l in sparse}
    layer_sim = {l: torch.rand(batch, i) for i, l in enumerate(sparse)}
    for per_sample in (False, True):
        plan = build_plan(head_sim, layer_sim, sparse, layers, heads, 0.5, 0.5, per_sample, batch,
                          torch.device("cpu"))
        planes = batch if per_sample else 1
        assert plan.layer_source.shape == (planes, layers) and plan.head_source.shape == (layers, planes, heads)
        assert bool((plan.layer_source[:, 1] == 1).all())
        for p in range(planes):
            src = plan.layer_source[p]
            assert int((src[sparse] == torch.tensor(sparse)).sum()) == 3  # round(0.5 * 5)
            assert all(src[l] <= l and src[src[l]] == src[l] and int(src[l]) in sparse for l in sparse)
            for l in sparse:
                assert int((plan.head_source[l, p] == torch.arange(heads)).sum()) == 2


def test_random_planner_is_seeded_and_valid():
    plans = [build_plan({}, {}, [0, 1, 2, 3], 4, 4, 0.5, 0.5, False, 2, torch.device("cpu"),
                        torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(plans[0].layer_source, plans[1].layer_source)
    assert torch.equal(plans[0].head_source, plans[1].head_source)
