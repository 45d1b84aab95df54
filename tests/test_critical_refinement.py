"""A refinement that also writes the decode step's critical indices (`critical=`): on CUDA the refinement's own
programs write them (`critical_indices_triton._write_critical_row` in `label_topk_triton._label_candidates`), so a
refining layer runs no critical-indices launch of its own. Kernel (interpreted on CPU) and twin alike, the result
must be the refinement's columns, unchanged, and exactly `critical_indices_torch` of them, with the work counter
advanced by the same count; by labels and by keys, scored in the top-k's program or apart, in place (static shapes)
or not, and refused for a subset of rows or heads."""

import pytest
import torch

from hshare.kernels import NO_TOKEN, critical_indices_torch
from hshare.kernels.candidate_keys import candidate_key_topk
from hshare.kernels.label_topk import candidate_label_topk
from hshare.selection import RowWindows
from test_candidate_keys import key_case
from test_label_topk import DEVICE, candidate_case, triton_or_skip

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)

SINK, LOCAL = 3, 5


def windows_of(n: int, heavy: int, lookahead: int, generator: torch.Generator) -> tuple[RowWindows, torch.Tensor]:
    """Three rows of `n` keys: row 0 left padded by a random amount, row 1 short (all its tokens fit N_c), row 2
    with a hole (a user's mask); and the refinement's window: the middle, or (lookahead) the selectable window,
    which reaches into the local window (columns the critical indices must drop)."""
    valid = torch.ones(3, n, dtype=torch.bool)
    valid[0, :int(torch.randint(5, n // 3, (), generator=generator))] = False
    valid[1, :n - (SINK + heavy + LOCAL - 2)] = False
    start = int(torch.randint(10, n - 30, (), generator=generator))
    valid[2, start:start + 12] = False
    windows = RowWindows.build(valid.to(DEVICE), SINK, LOCAL, SINK + heavy + LOCAL, lookahead=lookahead)
    return windows, windows.selectable_bounds


def valid_only(candidates: torch.Tensor, windows: RowWindows) -> torch.Tensor:
    """The candidates ``[3, H, C]`` that are valid columns of their row (a selection's are), NO_TOKEN elsewhere."""
    valid = windows.valid[:, None].expand(-1, candidates.shape[1], -1).gather(-1, candidates.clamp(min=0))
    return torch.where(valid & (candidates >= 0), candidates, NO_TOKEN)


def refine_both_ways(refine, windows: RowWindows, heavy: int, **options):
    """The refinement without and with the step's windows (a fresh counter at a random start each): columns,
    indices, and what each counter gained."""
    start = int(torch.randint(0, 1000, ()))
    counter = torch.tensor([start], dtype=torch.int64, device=DEVICE)
    plain = refine(**options).clone()
    if "out" in options:  # a fresh buffer, poisoned: the refinement writes every entry of it in place
        options["out"] = torch.full_like(options["out"], 99)
    columns, indices = refine(**options, critical=windows.critical_windows(counter))
    assert "out" not in options or columns is options["out"]
    return plain, columns, indices, int(counter) - start


def check(plain, columns, indices, counted, windows):
    """The columns are the refinement's own; the indices exactly the twin's critical indices of them, the counter
    advanced by their valid entries."""
    assert torch.equal(columns, plain)
    operands = [t.cpu() for t in (windows.sink, windows.local, windows.dense, windows.middle_bounds, windows.short)]
    want = critical_indices_torch(columns.cpu(), *operands)
    assert torch.equal(indices.cpu().long(), want)
    # the reference: the columns in the middle window's mask (valid columns: as in its bounds)
    middle = windows.middle.cpu()[:, None].expand(-1, columns.shape[1], -1).gather(-1, columns.cpu().clamp(min=0))
    assert torch.equal(want, critical_indices_torch(torch.where(middle, columns.cpu(), NO_TOKEN), *operands))
    assert counted == int((want >= 0).sum())
    assert bool((want[1] == windows.dense[1].cpu()[None]).all())  # the short row: all its tokens, every head
    return want


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("lookahead", [0, 3])
@pytest.mark.parametrize("heavy,score_tile", [(12, None), (7, 16), (40, 0)])
def test_label_refinement_writes_the_critical_indices(monkeypatch, kernels, lookahead, heavy, score_tile):
    if kernels == "triton":
        triton_or_skip()
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**16, ())))
    query, channels, codes, scale, zero, _, _, candidates, _, _ = candidate_case(4, torch.bfloat16)
    windows, window = windows_of(codes.shape[2], heavy, lookahead, generator)
    candidates = valid_only(candidates, windows)

    def refine(**options):
        if kernels == "triton" and score_tile is not None:  # the scoring in a launch of its own, or not
            from hshare.kernels.label_topk_triton import candidate_label_topk_triton
            return candidate_label_topk_triton(query, channels, codes, scale, zero, 4, heavy, candidates, None,
                                               options.pop("heads", None), window, score_tile=score_tile, **options)
        return candidate_label_topk(query, channels, codes, scale, zero, 4, heavy, candidates, window, **options)

    got = refine_both_ways(refine, windows, heavy)
    want = check(*got, windows)
    if lookahead:  # the window reached into the local window: such picks are dropped, never attended twice
        local = windows.local.cpu()
        assert all(not set(want[b, h, SINK:SINK + heavy].tolist()) & set(local[b].tolist()) - {NO_TOKEN}
                   for b in (0, 2) for h in range(want.shape[1]))
    # static shapes: every selection head refines its own entries of the layer's buffer in place
    every_head = torch.arange(candidates.shape[1], device=DEVICE)[None]
    buffer = torch.empty(3, candidates.shape[1], heavy, dtype=torch.long, device=DEVICE)
    check(*refine_both_ways(refine, windows, heavy, heads=every_head, out=buffer), windows)


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_key_refinement_writes_the_critical_indices(monkeypatch, kernels):
    if kernels == "triton":
        triton_or_skip()
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**16, ())))
    query, keys, _, _, candidates, _, _ = key_case(torch.bfloat16, seed=int(torch.randint(0, 2**16, ())))
    heavy = 9
    windows, window = windows_of(keys.shape[2], heavy, 2, generator)
    candidates = valid_only(candidates, windows)
    check(*refine_both_ways(lambda **options: candidate_key_topk(query, keys, heavy, candidates, window, **options),
                            windows, heavy), windows)


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_critical_indices_refused_for_some_rows_or_heads(monkeypatch, kernels):
    """A critical row is a batch row's, whole: a refinement of some rows, or in place for some heads, cannot write
    them (a clear error, not rows of the wrong heads)."""
    if kernels == "triton":
        triton_or_skip()
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    query, channels, codes, scale, zero, rows, _, candidates, _, _ = candidate_case(4, torch.bfloat16)
    windows, window = windows_of(codes.shape[2], 7, 0, torch.Generator().manual_seed(0))
    critical = windows.critical_windows()
    with pytest.raises(ValueError, match="every row and every selection head"):
        candidate_label_topk(query, channels, codes, scale, zero, 4, 7, candidates, window, rows, critical=critical)
    some = torch.tensor([[1], [0], [1]], device=DEVICE)
    out = torch.zeros(3, 2, 7, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="1 of 2 selection heads"):
        candidate_label_topk(query, channels, codes, scale, zero, 4, 7, candidates, window, heads=some, out=out,
                             critical=critical)
