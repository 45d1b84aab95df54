"""Selection against brute force: score every valid token, sort, keep sink + top heavy + local."""

import pytest
import torch

from hshare.kernels import dequantize_labels, label_scores, quantize_labels
from hshare.selection import NO_TOKEN, RowWindows, nth_valid_columns, select_heavy, valid_columns_from_mask, valid_counts


def brute_force_critical(valid_row, scores_row, sink, local, heavy):
    """Python reference for one (row, head): the set of critical columns."""
    cols = [c for c, ok in enumerate(valid_row.tolist()) if ok]
    if len(cols) <= sink + local + heavy:
        return set(cols)
    middle = cols[sink:len(cols) - local]
    ranked = sorted(middle, key=lambda c: (-scores_row[c].item(), c))
    return set(cols[:sink]) | set(ranked[:heavy]) | set(cols[len(cols) - local:])


def random_valid(batch, n, generator):
    """Left padding, a prefix gap, a short row and a full row."""
    valid = torch.ones(batch, n, dtype=torch.bool)
    for b in range(batch):
        kind = b % 4
        if kind == 0:
            valid[b, : int(torch.randint(0, n // 2, (1,), generator=generator))] = False
        elif kind == 1:  # [prefix | gap | suffix]
            start = int(torch.randint(5, n // 2, (1,), generator=generator))
            valid[b, start : start + int(torch.randint(1, n // 4, (1,), generator=generator))] = False
        elif kind == 2:  # within the budget
            valid[b, : n - 9] = False
    return valid


@pytest.mark.parametrize("sink,local,heavy", [(2, 3, 7), (0, 1, 12), (4, 8, 0)])
@pytest.mark.parametrize("bits", [4, 16])
def test_selection_equals_brute_force(sink, local, heavy, bits):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    batch, heads, n, r = 8, 3, 70, 8
    valid = random_valid(batch, n, generator)
    keys = torch.randn(batch, heads, n, r, dtype=torch.float64, generator=generator)
    q = torch.randn(batch, heads, 1, r, dtype=torch.float64, generator=generator)
    codes, scale, zero = quantize_labels(keys, bits)
    scores = label_scores(q, codes, scale, zero, bits)[:, :, 0]
    windows = RowWindows.build(valid, sink, local, sink + local + heavy)
    chosen = windows.critical_indices(select_heavy(scores, windows.middle[:, None], heavy))
    reference_scores = torch.einsum("bhr,bhnr->bhn", q[:, :, 0], dequantize_labels(codes, scale, zero, bits,
                                                                                   torch.float64))
    for b in range(batch):
        for h in range(heads):
            got = [c for c in chosen[b, h].tolist() if c != NO_TOKEN]
            assert len(got) == len(set(got)), "a column is selected twice"
            assert all(valid[b, c] for c in got), "an invalid (pad) column is selected"
            assert set(got) == brute_force_critical(valid[b], reference_scores[b, h], sink, local, heavy)


def test_row_windows_hand_example():
    # row 0: 3 pads then 9 tokens; row 1: prefix of 4, gap of 2, suffix of 6; sink 2, local 3, budget 7
    valid = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                          [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    w = RowWindows.build(valid, sink=2, local=3, budget=7)
    assert w.n_valid.tolist() == [9, 10] and w.short.tolist() == [False, False]
    assert w.sink.tolist() == [[3, 4], [0, 1]]
    assert w.local.tolist() == [[9, 10, 11], [9, 10, 11]]
    assert w.middle[0].nonzero().flatten().tolist() == [5, 6, 7, 8]
    assert w.middle[1].nonzero().flatten().tolist() == [2, 3, 6, 7, 8]
    heavy = torch.tensor([[[7, 5]], [[6, NO_TOKEN]]])
    assert w.critical_indices(heavy).tolist() == [[[3, 4, 7, 5, 9, 10, 11]], [[0, 1, 6, NO_TOKEN, 9, 10, 11]]]


def test_lookahead_widens_the_selectable_window_into_the_leaving_local_tokens():
    valid = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                          [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    w = RowWindows.build(valid, sink=2, local=3, budget=7, lookahead=1)  # a query group of 2 steps
    assert w.middle[0].nonzero().flatten().tolist() == [5, 6, 7, 8]  # attention windows unchanged
    assert w.selectable[0].nonzero().flatten().tolist() == [5, 6, 7, 8, 9]  # + the token leaving local next
    assert w.selectable[1].nonzero().flatten().tolist() == [2, 3, 6, 7, 8, 9]
    wide = RowWindows.build(valid, sink=2, local=3, budget=7, lookahead=5)  # never the current token
    assert wide.selectable[0].nonzero().flatten().tolist() == [5, 6, 7, 8, 9, 10]
    assert torch.equal(RowWindows.build(valid, 2, 3, 7).selectable, w.middle)
    # at the next (reuse) step the token picked from the old local window is in the middle: kept
    step2 = torch.cat((valid, torch.ones(2, 1, dtype=torch.bool)), dim=1)
    w2 = RowWindows.build(step2, sink=2, local=3, budget=7)
    assert w2.critical_indices(torch.tensor([[[9, 5]], [[9, 6]]])).tolist() == [[[3, 4, 9, 5, 10, 11, 12]],
                                                                             [[0, 1, 9, 6, 10, 11, 12]]]


def test_short_rows_attend_to_every_valid_token():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    w = RowWindows.build(valid, sink=1, local=1, budget=6)
    assert w.all_short
    got = w.critical_indices(torch.full((2, 1, 4), NO_TOKEN))
    assert got.tolist() == [[[2, 3, 4, -1, -1, -1]], [[0, 1, 2, 3, 4, -1]]]


def test_stale_heavy_columns_outside_the_window_are_dropped():
    # a sliding window moved: column 1 was heavy, now it is outside the valid keys
    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    w = RowWindows.build(valid, sink=1, local=2, budget=5)
    got = w.critical_indices(torch.tensor([[[1, 5]]]))
    assert got.tolist() == [[[2, NO_TOKEN, 5, 8, 9]]]


def test_nth_valid_columns():
    valid = torch.tensor([[0, 1, 0, 1, 1]], dtype=torch.bool)
    assert nth_valid_columns(valid, torch.tensor([[0, 1, 2, 3, -1]])).tolist() == [[1, 3, 4, -1, -1]]


@pytest.mark.parametrize("shape", [(1, 1), (4, 37), (2, 3, 50), (5, 0)])
def test_valid_counts_is_each_rows_running_count(shape):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    valid = torch.rand(shape, generator=generator) < 0.6
    if shape[-1]:
        valid[0] = False  # a row with no valid column
    rows = valid.reshape(valid[..., 0:1].numel(), shape[-1]).tolist()
    want = torch.tensor([[sum(row[:i + 1]) for i in range(len(row))] for row in rows],
                        dtype=torch.long).reshape(shape)  # by hand, row by row
    assert torch.equal(valid_counts(valid), want)
    wide = torch.ones(*shape[:-1], shape[-1] + 3, dtype=torch.bool)
    wide[..., :shape[-1]] = valid
    assert torch.equal(valid_counts(wide[..., :shape[-1]]), want)  # a view of a wider buffer


def test_select_heavy_pads_when_window_is_small():
    scores = torch.tensor([[[0.5, 0.1, 0.9]]])
    middle = torch.tensor([[[True, False, True]]])
    assert select_heavy(scores, middle, 4).tolist() == [[[2, 0, -1, -1]]]


def test_select_heavy_breaks_ties_by_column_whatever_the_width():
    """Equal scores at the heavy-th go to the earliest columns, so that scoring more (reserved, unselectable)
    columns, as a static-shape step does, never changes the choice; -0.0 equals 0.0."""
    scores = torch.tensor([[[0.0, 2.0, 0.0, -0.0, 0.0, 1.0]]])
    middle = torch.tensor([[[True, True, True, True, True, False]]])
    assert sorted(select_heavy(scores, middle, 3).flatten().tolist()) == [0, 1, 2]
    wide = torch.cat((scores, torch.zeros(1, 1, 5)), -1)
    wide_middle = torch.cat((middle, torch.zeros(1, 1, 5, dtype=torch.bool)), -1)
    for heavy in range(1, 6):
        narrow_set = sorted(select_heavy(scores, middle, heavy).flatten().tolist())
        assert sorted(select_heavy(wide, wide_middle, heavy).flatten().tolist()) == narrow_set
    assert sorted(select_heavy(torch.zeros(1, 1, 7), torch.ones(1, 1, 7, dtype=torch.bool), 4).flatten().tolist()) \
        == [0, 1, 2, 3]


def test_valid_columns_from_masks():
    assert valid_columns_from_mask(None, 2, 4, 1, torch.device("cpu")).all()
    causal = valid_columns_from_mask(None, 1, 4, 2, torch.device("cpu"))
    assert causal[0].tolist() == [[True, True, True, False], [True, True, True, True]]
    additive = torch.zeros(1, 1, 1, 3)
    additive[..., 0] = torch.finfo(torch.float32).min
    assert valid_columns_from_mask(additive, 1, 3, 1, torch.device("cpu")).tolist() == [[[False, True, True]]]
