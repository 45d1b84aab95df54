"""The exact top-r search over score keys (`kernels.key_search_triton._exact_threshold`) with both pivot rules,
against brute force: the largest key whose keys at or above weigh at least r, and how many of its ties to take,
over fresh random keys shaped as the kernels meet them (a whole normal row; an upper tail, the top of a larger
set; integer scores full of ties), counted or weighed (the walk's slot costs), with empty slots."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

import triton.language as tl  # noqa: E402

from hshare.kernels.key_search_triton import (_exact_threshold, _exact_threshold_pair, _first_value,  # noqa: E402
                                              _key_stats)
from hshare.kernels.label_topk import score_keys_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NONE = -(2 ** 31)
INT32_MAX = 2 ** 31 - 1
SLOTS = 512


@triton.jit
def _search(key_ptr, weight_ptr, out_ptr, r, C_PAD: tl.constexpr, WEIGHED: tl.constexpr, TAIL: tl.constexpr):
    """Program pid: (threshold, ties, probes) of the search for weight r over its row of keys ``[P, C_PAD]``."""
    pid = tl.program_id(0)
    slots = pid.to(tl.int64) * C_PAD + tl.arange(0, C_PAD)
    key = tl.load(key_ptr + slots)
    ok = key != -2147483648
    _, smallest, largest, mean, std = _key_stats(key, ok)
    weight = tl.where(ok, tl.load(weight_ptr + slots), 0) if WEIGHED else ok.to(tl.int32)
    total = tl.sum(weight, 0)
    threshold, ties, probes = _exact_threshold(key, weight, out_ptr, 0, r, smallest, total, largest.to(tl.int64) + 1,
                                               _first_value(mean, std, tl.sum(ok.to(tl.int32), 0), r - 0.5),
                                               False, C_PAD, TAIL)
    tl.store(out_ptr + pid * 3, threshold)
    tl.store(out_ptr + pid * 3 + 1, ties)
    tl.store(out_ptr + pid * 3 + 2, probes)


@triton.jit
def _search_pair(key_ptr, weight_ptr, out_ptr, r, r_b, C_PAD: tl.constexpr):
    """Program pid: the pair search over its row of keys ``[P, C_PAD]``, weight r of the weights and the r_b-th
    largest key: (T, ties, T_b, ties_b, probes)."""
    pid = tl.program_id(0)
    slots = pid.to(tl.int64) * C_PAD + tl.arange(0, C_PAD)
    key = tl.load(key_ptr + slots)
    ok = key != -2147483648
    count, smallest, largest, mean, std = _key_stats(key, ok)
    weight = tl.where(ok, tl.load(weight_ptr + slots), 0)
    total = tl.sum(weight, 0)
    found = _exact_threshold_pair(key, weight, r, total, _first_value(mean, std, count, r - 0.5), r_b, count,
                                  _first_value(mean, std, count, r_b - 0.5), smallest, largest.to(tl.int64) + 1)
    for f in tl.static_range(5):
        tl.store(out_ptr + pid * 5 + f, found[f])


def search(keys: torch.Tensor, weights: torch.Tensor | None, r: int, tail: bool) -> torch.Tensor:
    """``[P, 3]`` int32: each row's (threshold, ties, probes)."""
    out = torch.empty(keys.shape[0], 3, dtype=torch.int32, device=DEVICE)
    weight = weights if weights is not None else keys
    _search[(keys.shape[0],)](keys.to(DEVICE), weight.to(DEVICE), out, r, C_PAD=SLOTS, WEIGHED=weights is not None,
                              TAIL=tail)
    return out.cpu()


def brute_force(keys: torch.Tensor, weights: torch.Tensor, r: int) -> tuple[int, int]:
    """The largest key T whose keys at or above weigh at least r (r at most the row's weight), and the ties the
    contract gives: INT32_MAX where the keys >= T weigh exactly r, else r less the weight above T."""
    valid = keys != NONE
    distinct, group = torch.unique(keys[valid], return_inverse=True)  # ascending
    weight = torch.zeros(len(distinct), dtype=torch.int64).index_add_(0, group, weights[valid].long())
    at_or_above = weight.flip(0).cumsum(0).flip(0)  # per distinct key: the weight at or above it
    index = int((at_or_above >= r).nonzero().max())
    above = int(at_or_above[index + 1]) if index + 1 < len(distinct) else 0
    return int(distinct[index]), INT32_MAX if int(at_or_above[index]) == r else r - above


def rows_of(kind: str, rows: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, SLOTS]`` int32 keys, the last slots of each row empty."""
    width = SLOTS - 60
    if kind == "normal":
        scores = torch.randn(rows, width, generator=generator)
    elif kind == "tail":  # the top `width` of 4 x width normal scores, in column order
        scores = torch.randn(rows, 4 * width, generator=generator).topk(width, dim=-1).values
        scores = scores.gather(-1, torch.rand(rows, width, generator=generator).argsort(-1))
    else:  # "ties": a few distinct values
        scores = torch.randint(-6, 7, (rows, width), generator=generator).float()
    keys = torch.full((rows, SLOTS), NONE, dtype=torch.int32)
    keys[:, :width] = score_keys_torch(scores)
    return keys


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("kind", ["normal", "tail", "ties"])
@pytest.mark.parametrize("weighed", [False, True])
def test_search_matches_brute_force(kind, weighed, tail):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))
    keys = rows_of(kind, 6, generator)
    weights = torch.randint(1, 3, keys.shape, generator=generator, dtype=torch.int32) if weighed else None
    counted = weights if weighed else torch.ones_like(keys)
    total = int(counted[0][keys[0] != NONE].sum())
    for r in (1, total // 4, total // 2 + 1, total - 1, total):
        got = search(keys, weights, r, tail)
        for row in range(keys.shape[0]):
            row_total = int(counted[row][keys[row] != NONE].sum())
            want = brute_force(keys[row], counted[row], min(r, row_total))
            if r <= row_total:
                assert tuple(got[row, :2].tolist()) == want, (kind, weighed, tail, r, row)


def test_tail_pivots_take_fewer_probes_on_an_upper_tail():
    """The reason TAIL exists: on the top of a larger set the normal model's probes are many; the tail's are
    fewer. On a whole normal row the normal pivots are kept."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))
    keys = rows_of("tail", 32, generator)
    heavy = (SLOTS - 60) // 4
    normal, tail = (search(keys, None, heavy, t)[:, 2].float().mean() for t in (False, True))
    assert tail < normal, (float(tail), float(normal))


@pytest.mark.parametrize("kind", ["normal", "tail", "ties"])
def test_pair_search_is_both_searches_in_the_longer_ones_steps(kind):
    """The walk's two searches in one loop (`_exact_threshold_pair`): a weighed target and a counted one over the
    same keys, each as the single tail search finds it, in as many steps as the longer one takes; the counted one as
    brute force has it, the weighed one (weights 0 to 2: the walk's costs) a key whose keys at or above weigh at least
    r and those above it less, unless it weighs nothing (the walk takes nothing at such a key)."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))
    keys = rows_of(kind, 6, generator)
    weights = torch.randint(0, 3, keys.shape, generator=generator, dtype=torch.int32)  # the walk's costs: 0, 1, 2
    valid = keys != NONE
    totals = (weights * valid).sum(-1)
    counts = valid.sum(-1)
    for r, r_b in ((1, 1), (int(totals.min()) // 2, int(counts.min()) // 4), (int(totals.min()), int(counts.min()))):
        out = torch.empty(keys.shape[0], 5, dtype=torch.int32, device=DEVICE)
        _search_pair[(keys.shape[0],)](keys.to(DEVICE), weights.to(DEVICE), out, r, r_b, C_PAD=SLOTS)
        out = out.cpu()
        single, single_b = search(keys, weights, r, True), search(keys, None, r_b, True)
        for row in range(keys.shape[0]):
            threshold = int(out[row, 0])
            weighed = weights[row] * valid[row]
            above, own = int(weighed[keys[row] > threshold].sum()), int(weighed[keys[row] == threshold].sum())
            assert above + own >= r and (above < r or own == 0), (kind, r, row)  # at T: r reached
            assert tuple(out[row, :2].tolist()) == tuple(single[row, :2].tolist()), (kind, r, row)
            assert tuple(out[row, 2:4].tolist()) == brute_force(keys[row], torch.ones_like(keys[row]), r_b)
            assert tuple(out[row, 2:4].tolist()) == tuple(single_b[row, :2].tolist())
            assert int(out[row, 4]) == max(int(single[row, 2]), int(single_b[row, 2]))
