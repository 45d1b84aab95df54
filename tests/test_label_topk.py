"""Fused label scoring + heavy top-k (`kernels.label_topk`): the twin against brute force (dequantized
labels, fp64 scores, a masked top-k), the Triton kernels against the twin (CPU: TRITON_INTERPRET=1,
small shapes; one-chunk and two-launch paths)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from hshare.kernels import NO_TOKEN, dequantize_labels, label_scores, quantize_labels, query_labels
from hshare.kernels.label_topk import (candidate_label_topk, candidate_label_topk_torch, decode_label_topk,
                                       decode_label_topk_torch, label_topk, label_topk_torch, select_heavy_columns_torch,
                                       window_columns)

pytestmark = pytest.mark.kernels  # no transformers model in them (pyproject.toml's markers)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_or_skip() -> None:
    """The Triton kernels run on the GPU, or on CPU under TRITON_INTERPRET=1; otherwise the test is skipped."""
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")


def label_cache(batch, sel_heads, n, r, bits, dtype=torch.float32, seed=0):
    """A random label cache ``[B, H_sel, n, .]`` (quantized as the cache stores it)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, sel_heads, n, r, generator=generator).to(DEVICE, dtype)
    return quantize_labels(keys, bits)


def brute_force_scores(labels, codes, scale, zero, bits, rows, heads):
    """fp64 ``[A, H', n]`` scores of the query labels ``[A, H', r]`` on the dequantized labels."""
    keys = dequantize_labels(codes, scale, zero, bits, torch.float64)
    picked = keys[rows[:, None], heads.expand(len(rows), -1)]  # [A, H', n, r]
    return torch.einsum("ahr,ahnr->ahn", labels.double(), picked)


def check_selection(got, scores, selectable, heavy, tol):
    """The module contract, tie-robust: ascending distinct selectable columns with finite scores, then
    NO_TOKEN; min(heavy, |window|) of them; none scored below an unchosen selectable column (by
    more than `tol`)."""
    got, scores, selectable = got.cpu(), scores.cpu().double(), selectable.cpu()
    rows, heads, n = scores.shape
    assert got.dtype == torch.int64 and got.shape == (rows, heads, heavy)
    ok = selectable[:, None] & torch.isfinite(scores)
    for a in range(rows):
        for h in range(heads):
            columns = got[a, h]
            chosen = columns[columns != NO_TOKEN]
            assert bool((columns[len(chosen):] == NO_TOKEN).all()), "NO_TOKEN only at the end"
            assert bool((chosen[1:] > chosen[:-1]).all()), "columns ascending and distinct"
            assert len(chosen) == min(heavy, int(ok[a, h].sum())), "heavy count != min(heavy, |window|)"
            assert bool(ok[a, h, chosen].all()), "a chosen column outside the window or non-finite"
            left = ok[a, h].clone()
            left[chosen] = False
            if len(chosen) and bool(left.any()):
                assert float(scores[a, h, chosen].min()) >= float(scores[a, h][left].max()) - tol


def run_triton(*args, **kwargs):
    """The Triton entry point (interpreted on CPU); skipped where triton cannot run."""
    triton_or_skip()
    from hshare.kernels.label_topk_triton import label_topk_triton

    return label_topk_triton(*args, **kwargs)


# --- the twin --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("q_heads,sel_heads,per_row", [(4, 4, False), (6, 2, True), (8, 1, False)])
def test_twin_matches_brute_force(bits, q_heads, sel_heads, per_row):
    """Decode query (GQA groups summed, per-row channels), chosen rows and heads, per-row bounds and a
    mask: the twin keeps the brute-force top-k, and exactly its set on the twin's own scores."""
    torch.manual_seed(0)
    batch, n, r, dim, heavy = 3, 150, 8, 32, 20
    codes, scale, zero = label_cache(batch, sel_heads, n, r, bits)
    query = torch.randn(batch, q_heads, dim, device=DEVICE)
    picks = (batch if per_row else 1) * sel_heads
    channels = torch.stack([torch.randperm(dim, device=DEVICE)[:r] for _ in range(picks)])
    channels = channels.reshape(-1, sel_heads, r)
    rows = torch.tensor([2, 0], device=DEVICE)
    heads = torch.randint(0, sel_heads, (2, 3), device=DEVICE)
    window = torch.tensor([[10, 140], [0, 150]], device=DEVICE)
    selectable = torch.rand(2, n, device=DEVICE) < 0.7
    got = decode_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, window, selectable, rows, heads)
    labels = query_labels(query[:, :, None], channels)[:, :, 0][rows[:, None], heads]  # [A, H', r]
    scores = brute_force_scores(labels, codes, scale, zero, bits, rows, heads)
    ok = window_columns(window, selectable, 2, n, DEVICE)
    check_selection(got, scores, ok, heavy, tol=1e-4)
    picks = (rows[:, None], heads.expand(len(rows), -1))
    own = label_scores(labels[:, :, None], codes[picks], None if scale is None else scale[picks],
                       None if zero is None else zero[picks], bits)[:, :, 0]  # the twin's fp32 scores
    masked = own.masked_fill(~ok[:, None], float("-inf"))  # distinct scores: one top-k set
    assert torch.equal(got, masked.topk(heavy, dim=-1).indices.sort(-1).values)


def test_twin_short_windows_ties_and_non_finite():
    """Fewer selectable columns than heavy (NO_TOKEN fill, an empty window), a tie across the heavy-th
    score (the smaller columns win, -0.0 equals +0.0), non-finite scores never chosen."""
    scores = torch.randn(3, 2, 40, dtype=torch.float64)
    scores[0, 0, 10:20] = 5.0  # 10 tied best, heavy 6: columns 10..15
    scores[0, 1, :] = -0.0
    scores[0, 1, 3::4] = 0.0  # all tied at zero: the first columns
    scores[1, :, :5] = float("inf")
    scores[1, 0, 5:9] = float("nan")
    selectable = torch.ones(3, 40, dtype=torch.bool)
    selectable[2] = False
    selectable[2, 30:33] = True  # three selectable columns
    for dtype in (torch.float32, torch.float64):
        got = select_heavy_columns_torch(scores.to(dtype), selectable, 6)
        assert got[0, 0].tolist() == list(range(10, 16))
        assert got[0, 1].tolist() == list(range(6))
        assert bool((got[1, 0] >= 9).all()) and bool((got[1, 1] >= 5).all())  # never inf / NaN
        assert got[2, 0].tolist() == [30, 31, 32, NO_TOKEN, NO_TOKEN, NO_TOKEN]
        check_selection(got, scores, selectable, 6, tol=0.0)
    empty = select_heavy_columns_torch(scores, torch.zeros(3, 40, dtype=torch.bool), 4)
    assert bool((empty == NO_TOKEN).all())


def test_dispatch_sends_cuda_or_forced_calls_to_the_kernel(monkeypatch):
    """`label_topk` runs the kernel under HSHARE_KERNELS=triton (interpreted on CPU) and the twin for
    fp64 labels; both keep the twin's set."""
    import hshare.kernels.label_topk_triton as module

    triton_or_skip()
    calls = []
    original = module.label_topk_triton
    monkeypatch.setattr(module, "label_topk_triton", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setenv("HSHARE_KERNELS", "triton")
    torch.manual_seed(4)
    codes, scale, zero = label_cache(2, 2, 60, 8, 4)
    labels = torch.randn(2, 2, 8, device=DEVICE)
    got = label_topk(labels, codes, scale, zero, 4, 9)
    assert calls == [1]
    assert torch.equal(got, label_topk_torch(labels, codes, scale, zero, 4, 9))
    label_topk(labels.double(), codes, scale, zero, 4, 9)  # fp64: the twin
    assert calls == [1]


# --- the Triton kernels against the twin ----------------------------------------------------------


@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (8, torch.float16), (16, torch.bfloat16)])
@pytest.mark.parametrize("chunk", [None, 64])  # None: the row in one program; 64: five chunks, two launches
def test_triton_matches_twin(bits, dtype, chunk):
    """Decode query with GQA and per-row channels, chosen rows and heads, per-row bounds and a mask:
    the kernel's columns are the twin's (scores agree up to rounding: the tie-robust contract, and
    the twin's very set)."""
    torch.manual_seed(1)
    batch, sel_heads, q_heads, n, r, dim, heavy = 3, 2, 4, 300, 8, 16, 37
    codes, scale, zero = label_cache(batch, sel_heads, n, r, bits, dtype, seed=1)
    query = torch.randn(batch, q_heads, dim, device=DEVICE)
    channels = torch.stack([torch.randperm(dim, device=DEVICE)[:r] for _ in range(batch * sel_heads)])
    channels = channels.reshape(batch, sel_heads, r)
    rows = torch.tensor([2, 0], device=DEVICE)
    heads = torch.tensor([[1, 0], [1, 1]], device=DEVICE)
    window = torch.tensor([[40, 270], [0, 300]], device=DEVICE)
    selectable = torch.rand(2, n, device=DEVICE) < 0.8
    got = run_triton(None, codes, scale, zero, bits, heavy, rows, heads, window, selectable,
                     query=query, channels=channels, chunk=chunk, tile=32)
    want = decode_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, window, selectable, rows, heads)
    labels = query_labels(query[:, :, None], channels)[:, :, 0][rows[:, None], heads]
    scores = brute_force_scores(labels, codes, scale, zero, bits, rows, heads)
    check_selection(got, scores, window_columns(window, selectable, 2, n, DEVICE), heavy, tol=1e-4)
    if DEVICE == "cpu":  # the interpreter's scores: deterministic, the same set as the twin's here
        assert torch.equal(got, want)
    if bits == 16:  # the same codes stored channel-major (Loki's projected keys): read per channel, same columns
        channel_major = codes.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert channel_major.stride(-2) == 1 and torch.equal(channel_major, codes)
        assert torch.equal(run_triton(None, channel_major, scale, zero, bits, heavy, rows, heads, window, selectable,
                                      query=query, channels=channels, chunk=chunk, tile=32), got)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_selection_writes_into_a_buffer_that_fits(monkeypatch, kernels):
    """`out` (a layer's kept buffer): the columns are written into it where it is a contiguous int64 tensor of
    their shape (whatever it held before), else into a new tensor, `out` untouched; the columns are a call's
    without it."""
    if kernels == "triton":
        triton_or_skip()
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    torch.manual_seed(3)
    batch, sel_heads, q_heads, n, r, dim, heavy = 2, 2, 4, 120, 8, 16, 11
    codes, scale, zero = label_cache(batch, sel_heads, n, r, 4, seed=3)
    query = torch.randn(batch, q_heads, dim, device=DEVICE)
    channels = torch.stack([torch.randperm(dim, device=DEVICE)[:r] for _ in range(sel_heads)])[None]
    selectable = torch.rand(batch, n, device=DEVICE) < 0.7

    def select(out=None):
        return decode_label_topk(query, channels, codes, scale, zero, 4, heavy, selectable=selectable, out=out)

    want = select()
    buffer = torch.randint(-5, n, (batch, sel_heads, heavy), device=DEVICE)
    got = select(buffer)
    assert got is buffer and torch.equal(got, want)
    wider = torch.zeros(batch, sel_heads, heavy + 1, dtype=torch.long, device=DEVICE)
    strided = torch.zeros(batch, heavy, sel_heads, dtype=torch.long, device=DEVICE).transpose(1, 2)
    for other in (wider, strided, buffer.int()):
        before = other.clone()
        got = select(other)
        assert got is not other and torch.equal(got, want) and torch.equal(other, before)


def test_triton_short_windows_ties_and_non_finite():
    """Two launches (chunks of 32; the candidates in tiles of 16, or in one tile held in registers)
    and one: rows whose window holds fewer than heavy tokens or none, a tie group of identical labels
    across the heavy-th score (the twin's columns exactly: the smaller win), non-finite scores
    (infinite zero points, NaN scales) never chosen."""
    torch.manual_seed(2)
    batch, sel_heads, n, r, bits, heavy = 2, 2, 200, 8, 4, 24
    codes, scale, zero = label_cache(batch, sel_heads, n, r, bits, torch.bfloat16, seed=2)
    labels = torch.randn(3, 2, r, device=DEVICE)
    labels[1, 1] = 0.0  # a head whose every score is zero: one tie over the whole window
    codes[0, 1, 60:140] = codes[0, 1, 60:61]  # 80 identical labels: tied scores
    scale[0, 1, 60:140] = scale[0, 1, 60]
    zero[0, 1, 60:140] = zero[0, 1, 60]
    zero[1, 0, 10:30] = float("inf")
    scale[1, 0, 150:170] = float("nan")
    rows = torch.tensor([0, 1, 1], device=DEVICE)
    heads = torch.tensor([[1, 0], [0, 1], [1, 0]], device=DEVICE)
    window = torch.tensor([[0, 200], [5, 200], [33, 50]], device=DEVICE)  # the last: 17 tokens < heavy
    selectable = torch.ones(3, n, dtype=torch.bool, device=DEVICE)
    selectable[2, 40:45] = False
    for chunk, tile in ((32, 16), (32, 4096), (None, 4096)):
        got = run_triton(labels, codes, scale, zero, bits, heavy, rows, heads, window, selectable,
                         chunk=chunk, tile=tile)
        want = label_topk_torch(labels, codes, scale, zero, bits, heavy, window, selectable, rows, heads)
        assert torch.equal(got, want), chunk
        assert int((got[2] != NO_TOKEN).sum(-1).max()) == 12
    empty = run_triton(labels, codes, scale, zero, bits, heavy, rows, heads,
                       torch.tensor([[7, 7], [0, 0], [300, 400]], device=DEVICE), None, chunk=64)
    assert bool((empty == NO_TOKEN).all())


def test_triton_random_chunked_rows_match_the_twin():
    """Fresh random rows over many chunks (up to 44: the bound L over every chunk's sketch, each chunk's list of
    keys at or above its heavy-level key): 4/8/16-bit labels (16-bit also channel-major), few distinct scores
    (ties at every level), random windows and masks, candidates in registers or in tiles of 16. The kernel's
    columns are the twin's exactly (interpreted on CPU: the same scores)."""
    if DEVICE != "cpu":
        pytest.skip("exact equality needs the interpreter's scores")
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=generator))]

    for case in range(3):
        bits, r, batch, sel_heads = pick([4, 8, 16]), pick([2, 4, 6, 8, 12]), pick([1, 2, 3]), pick([1, 2])
        n, chunk, heavy = pick([300, 700]), pick([16, 32, 64]), pick([1, 7, 40, 150])
        codes, scale, zero = label_cache(batch, sel_heads, n, r, bits, torch.bfloat16, seed=seed + case)
        if pick([False, True]):  # few distinct labels: ties everywhere
            codes = codes & 0x11 if bits != 16 else (codes.float() * 2).round().div(2).to(codes.dtype)
        if bits == 16 and pick([False, True]):
            codes = codes.transpose(-1, -2).contiguous().transpose(-1, -2)
        query = torch.randn(batch, sel_heads * 2, 16, generator=generator)
        channels = torch.stack([torch.randperm(16, generator=generator)[:r] for _ in range(batch * sel_heads)])
        channels = channels.reshape(batch, sel_heads, r)
        start = torch.randint(0, n, (batch,), generator=generator)
        window = torch.stack((start, (start + torch.randint(0, n, (batch,), generator=generator)).clamp(max=n)), 1)
        selectable = torch.rand(batch, n, generator=generator) < pick([0.3, 0.9, 1.0])
        got = run_triton(None, codes, scale, zero, bits, heavy, None, None, window, selectable, query=query,
                         channels=channels, chunk=chunk, tile=pick([16, 4096]))
        want = decode_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, window, selectable)
        assert torch.equal(got, want), f"seed {seed}, case {case}: {bits}-bit, n {n}, chunk {chunk}, heavy {heavy}"


def test_triton_heavy_beyond_chunks_and_row():
    """heavy above a chunk (every chunk's candidates may fill its range) and above the row (all
    selectable columns, then NO_TOKEN), 8-bit labels read byte by byte (3 channels: an odd row)."""
    torch.manual_seed(3)
    codes, scale, zero = label_cache(2, 1, 130, 3, 8, seed=3)
    labels = torch.randn(2, 1, 3, device=DEVICE)
    for heavy, chunk in ((50, 32), (200, 32), (200, None)):
        got = run_triton(labels, codes, scale, zero, 8, heavy, torch.arange(2, device=DEVICE),
                         torch.zeros(1, 1, dtype=torch.long, device=DEVICE), chunk=chunk, tile=64)
        assert torch.equal(got, label_topk_torch(labels, codes, scale, zero, 8, heavy)), (heavy, chunk)


def test_sketch_levels_by_hand():
    """A chunk's target ranks: its share s of heavy by columns, then 2 s and 8 s below heavy; where 8 s would reach
    heavy (8 chunks' worth of columns or fewer), 1.25 s and 2 s instead, so that no level repeats heavy's. A last
    chunk of a few columns takes no share."""
    triton_or_skip()
    from hshare.kernels.label_topk_triton import sketch_levels

    assert sketch_levels(944, 131072, 4096) == [30, 60, 240, 944]  # 32 chunks of 4,096
    assert sketch_levels(944, 32768, 4096) == [118, 147, 236, 944]  # 8 chunks
    assert sketch_levels(3776, 32768, 4096) == [472, 590, 944, 3776]
    # a 32k prompt and 64 new tokens: 9 chunks, the last of 64 columns; the levels stay the 8 chunks' (by chunks,
    # a share of 420 and the coarse levels 420, 840, 3,360)
    assert sketch_levels(3776, 32832, 4096) == [472, 590, 944, 3776]
    assert sketch_levels(944, 32832, 4096) == [118, 147, 236, 944]
    assert sketch_levels(944, 36864, 4096) == [105, 210, 840, 944]  # 9 full chunks
    assert sketch_levels(3, 32768, 4096) == [1, 1, 2, 3]
    assert sketch_levels(10, 8192, 4096) == [5, 6, 10, 10]  # capped at heavy


def test_candidate_register_cap_by_hand():
    """The candidate kernels' register cap on 132 SMs (an H100): only where the grid exceeds the programs an SM
    holds uncapped (top-k at 2,048 slots: 3; top-k and walk at 4,096: 1), over 4-bit labels."""
    triton_or_skip()
    from hshare.kernels.label_topk_triton import TOPK_REGISTER_CAP, candidate_register_cap

    cap = TOPK_REGISTER_CAP
    assert candidate_register_cap(False, 2048, 4, 512, 132) == cap  # B16 x 32 heads
    assert candidate_register_cap(False, 2048, 4, 396, 132) is None  # 3 an SM: one wave already
    assert candidate_register_cap(False, 2048, 4, 397, 132) == cap
    assert candidate_register_cap(False, 4096, 4, 256, 132) == cap  # B16 x 16 heads
    assert candidate_register_cap(True, 4096, 4, 133, 132) == cap
    assert candidate_register_cap(True, 4096, 4, 32, 132) is None  # B4 x 8 heads: the cap only spills
    assert candidate_register_cap(False, 4096, 4, 132, 132) is None
    assert candidate_register_cap(True, 2048, 4, 512, 132) is None  # the walk at 2,048: no gain measured
    assert candidate_register_cap(False, 8192, 4, 4096, 132) is None
    assert candidate_register_cap(False, 2048, 16, 512, 132) is None  # 16-bit labels spill
    assert candidate_register_cap(False, 2048, 8, 512, 132) is None


def test_chunk_size_by_hand():
    """A row is one program up to 4,096 columns, over 4- and 8-bit labels up to 8,192 (a 4k prompt's cache one
    launch); 16-bit labels and longer rows take chunks of 4,096, more where they would take over 64."""
    pytest.importorskip("triton")
    from hshare.kernels.label_topk_triton import chunk_size

    assert [chunk_size(n, 4) for n in (5, 300, 4096, 4097, 4352, 8192)] == [16, 512, 4096, 8192, 8192, 8192]
    assert [chunk_size(n, 8) for n in (4097, 8192)] == [8192] * 2
    assert [chunk_size(n, 16) for n in (4097, 8192)] == [4096] * 2
    assert [chunk_size(n, 4) for n in (8193, 8256, 32768, 262144, 262145)] == [4096, 4096, 4096, 4096, 8192]


@pytest.mark.parametrize("bits, n, programs", [
    (4, 4160, 1), (8, 4160, 1),  # a 4k prompt's cache: one program
    (4, 8256, 3),  # an 8k prompt's: chunks of 4,096 and the select's launch
    (16, 4160, 2),
])
def test_a_4k_prompts_cache_is_one_program(monkeypatch, bits, n, programs):
    """A row a little past 4,096 columns of 4- or 8-bit labels (a 4k prompt and its new tokens) is selected by one
    program, no select launch; 16-bit labels and an 8k prompt's cache take chunks and the select. The columns are
    the twin's (and valid against brute force)."""
    triton_or_skip()
    from hshare.kernels import label_topk_triton

    chunks, select = [], label_topk_triton._label_topk_select

    class Recorder:
        def __getitem__(self, grid):
            chunks.append(grid[1])
            return select[grid]

    monkeypatch.setattr(label_topk_triton, "_label_topk_select", Recorder())
    heavy = 300
    query, channels, codes, scale, zero, rows, heads, selectable = walk_selection_case(bits, torch.float32, n, 12)
    rows, heads, selectable = rows[:1], heads[:1, :1], selectable[:1]  # one row-head
    got = run_triton(None, codes, scale, zero, bits, heavy, rows, heads, None, selectable, query=query,
                     channels=channels)
    assert chunks == ([] if programs == 1 else [programs])
    want = decode_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, None, selectable, rows, heads)
    labels = query_labels(query[:, :, None], channels)[:, :, 0][rows[:, None], heads]
    check_selection(got, brute_force_scores(labels, codes, scale, zero, bits, rows, heads), selectable, heavy,
                    tol=1e-4)
    if DEVICE == "cpu":
        assert torch.equal(got, want)


def test_tail_tile_by_hand():
    """A label top-k's last program holds twice heavy candidates a tile, 4,096 to 8,192: the presets' heavy up to
    N_c 1024 in one tile of 4,096, the 3,776 candidates of `candidates=4` at N_c 1024 in one of 8,192; over more
    than 16 chunks (a 128k row) heavy above 2,048 in one of 16,384, on 16 warps."""
    triton_or_skip()
    from hshare.kernels.label_topk_triton import select_warps, tail_tile

    assert [tail_tile(h, 9) for h in (1, 88, 432, 944, 1728, 2048)] == [4096] * 6
    assert [tail_tile(h, 9) for h in (2049, 3776, 7872, 16000)] == [8192] * 4
    assert [tail_tile(h, 16) for h in (2048, 3776)] == [4096, 8192]
    assert [tail_tile(h, 33) for h in (944, 2048, 2049, 3776)] == [4096, 4096, 16384, 16384]
    assert [select_warps(t) for t in (4096, 8192, 16384)] == [None, None, 16]


def test_a_wide_selection_over_many_chunks_takes_the_wide_tile(monkeypatch):
    """Heavy above 2,048 over more than 16 chunks: the select launch holds its last program's candidates in a tile of
    16,384 on 16 warps; the columns are the twin's (and valid against brute force), and the default tile's."""
    triton_or_skip()
    from hshare.kernels import label_topk_triton

    monkeypatch.setattr(label_topk_triton, "CHUNK", 128)
    monkeypatch.setattr(label_topk_triton, "SINGLE_CHUNK", 128)
    launches, select = [], label_topk_triton._label_topk_select

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid[1], kwargs["TILE"], kwargs["num_warps"]))
                return select[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(label_topk_triton, "_label_topk_select", Recorder())
    heavy, n = 2100, 2560  # 20 chunks of 128
    query, channels, codes, scale, zero, rows, heads, selectable = walk_selection_case(4, torch.float32, n, 12)
    rows, heads, selectable = rows[:1], heads[:1, :1], selectable[:1]
    got = run_triton(None, codes, scale, zero, 4, heavy, rows, heads, None, selectable, query=query, channels=channels)
    assert launches == [(20, 16384, 16)]
    narrow = run_triton(None, codes, scale, zero, 4, heavy, rows, heads, None, selectable, query=query,
                        channels=channels, tile=8192)
    assert torch.equal(got, narrow)
    labels = query_labels(query[:, :, None], channels)[:, :, 0][rows[:, None], heads]
    check_selection(got, brute_force_scores(labels, codes, scale, zero, 4, rows, heads), selectable, heavy, tol=1e-4)
    if DEVICE == "cpu":
        want = decode_label_topk_torch(query, channels, codes, scale, zero, 4, heavy, None, selectable, rows, heads)
        assert torch.equal(got, want)


def test_split_scoring_by_hand():
    """The candidate top-k scores in a launch of its own where a program a row-head leaves half the SMs idle
    (132 SMs: B4 x 8 KV heads, B1 x 8), not at B16 x 16 or B8 x 32; the walk where it uses an eighth of them (B4 x
    4 selecting heads, not B4 x 8); a score tile is a power of two."""
    triton_or_skip()
    from hshare.kernels.label_topk_triton import candidate_label_topk_triton, split_scoring

    assert split_scoring(32, 132) and split_scoring(8, 132) and split_scoring(66, 132)
    assert not split_scoring(67, 132) and not split_scoring(256, 132)
    assert split_scoring(16, 132, walk=True) and split_scoring(8, 132, walk=True)
    assert not split_scoring(17, 132, walk=True) and not split_scoring(32, 132, walk=True)
    query, channels, codes, scale, zero, rows, heads, candidates, _, window = candidate_case(4, torch.bfloat16)
    with pytest.raises(ValueError, match="score_tile 24"):
        candidate_label_topk_triton(query, channels, codes, scale, zero, 4, 7, candidates, rows, heads, window,
                                    score_tile=24)


# --- candidate-set refinement: the top heavy of given candidate columns ----------------------------


def window_case(count, n, generator):
    """Row windows as a selection sees them: valid columns with holes (padding), column bounds ``[A, 2]`` and the
    window's mask ``[A, n]`` (the valid columns within the bounds: the reference a refinement is checked against),
    from `generator`. A row's bounds may start before its first valid column or end past its last."""
    valid = torch.rand(count, n, generator=generator) < 0.85
    start = torch.randint(0, n // 6, (count,), generator=generator)
    end = torch.randint(n - n // 3, n + 1, (count,), generator=generator)
    window = torch.stack((start, end), -1)
    column = torch.arange(n)
    selectable = valid & (column >= start[:, None]) & (column < end[:, None])
    return valid, window, selectable


def valid_candidates(valid, heads, width, generator):
    """``[A, heads, width]`` candidate lists: distinct valid columns of each row (a selection's), in random order."""
    lists = [row.nonzero().flatten()[torch.randperm(int(row.sum()), generator=generator)[:width]]
             for row in valid for _ in range(heads)]
    return torch.stack(lists).reshape(valid.shape[0], heads, width)


def candidate_case(bits, dtype=torch.float32, seed=5, r=8):
    """A label cache of `r` channels, a GQA decode query with per-row channels, chosen rows / heads, candidate
    lists of valid columns with repeats of no candidate (NO_TOKEN), columns outside the window, and a short list;
    the rows' windows as bounds `window` ``[3, 2]`` and as the mask `selectable` ``[3, n]`` (`window_case`)."""
    generator = torch.Generator().manual_seed(seed)
    batch, sel_heads, q_heads, n, dim = 3, 2, 4, 120, max(16, 2 * r)
    codes, scale, zero = label_cache(batch, sel_heads, n, r, bits, dtype, seed=seed)
    query = torch.randn(batch, q_heads, dim, generator=generator).to(DEVICE)
    channels = torch.stack([torch.randperm(dim, generator=generator)[:r] for _ in range(batch * sel_heads)])
    channels = channels.reshape(batch, sel_heads, r).to(DEVICE)
    rows = torch.tensor([2, 0, 1], device=DEVICE)
    heads = torch.tensor([[1, 0], [0, 0], [1, 1]], device=DEVICE)
    valid, window, selectable = window_case(3, n, generator)
    candidates = valid_candidates(valid, 2, 40, generator)
    candidates[0, 1, 25:] = NO_TOKEN  # 25 candidates
    candidates[2, 0, :35] = NO_TOKEN  # 5 candidates: fewer than heavy
    return (query, channels, codes, scale, zero, rows, heads, candidates.to(DEVICE), selectable.to(DEVICE),
            window.to(DEVICE))


def check_candidates(got, candidates, scores, allowed, heavy, tol):
    """Chosen = allowed candidates in candidate order, min(heavy, allowed) of them, none scored below an
    unchosen allowed candidate (by more than `tol`), then NO_TOKEN."""
    got, candidates, scores, allowed = got.cpu(), candidates.cpu(), scores.cpu().double(), allowed.cpu()
    for a in range(got.shape[0]):
        for h in range(got.shape[1]):
            chosen = got[a, h][got[a, h] != NO_TOKEN].tolist()
            assert bool((got[a, h, len(chosen):] == NO_TOKEN).all())
            order = candidates[a, h].tolist()
            slots = [order.index(c) for c in chosen]
            assert slots == sorted(slots), "not in candidate order"
            assert all(bool(allowed[a, h, s]) for s in slots)
            assert len(chosen) == min(heavy, int(allowed[a, h].sum()))
            rest = allowed[a, h].clone()
            rest[slots] = False
            if chosen and bool(rest.any()):
                assert float(scores[a, h, slots].min()) >= float(scores[a, h][rest].max()) - tol


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_candidate_twin_matches_brute_force(bits):
    query, channels, codes, scale, zero, rows, heads, candidates, selectable, window = candidate_case(bits)
    heavy = 12
    got = candidate_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, candidates, window,
                                     rows, heads)
    labels = query_labels(query[:, :, None], channels)[:, :, 0][rows[:, None], heads]
    scores = brute_force_scores(labels, codes, scale, zero, bits, rows, heads).gather(-1, candidates.clamp(min=0))
    allowed = (candidates >= 0) & selectable[:, None].expand(-1, 2, -1).gather(-1, candidates.clamp(min=0))
    check_candidates(got, candidates, scores, allowed, heavy, tol=1e-4)
    assert int((got[2, 0] != NO_TOKEN).sum()) == int(allowed[2, 0].sum()) <= 5
    # without a mask, every candidate is allowed; ties (one repeated label) go to the earlier candidate
    codes[:, :, :] = codes[:, :, :1]
    if scale is not None:
        scale[:], zero[:] = scale[:, :, :1], zero[:, :, :1]
    tied = candidate_label_topk_torch(query, channels, codes, scale, zero, bits, 6, candidates, None, rows, heads)
    assert torch.equal(tied[1], candidates[1, :, :6])


# r = 6 and 12: channel counts that are no power of two (the gathered query labels padded to R_PAD lanes); 32: a
# 4-bit label row of four words
@pytest.mark.parametrize("bits,dtype,r", [(4, torch.bfloat16, 8), (4, torch.bfloat16, 6), (4, torch.bfloat16, 32),
                                          (8, torch.float16, 8), (8, torch.float16, 12), (16, torch.bfloat16, 8)])
def test_candidate_triton_matches_twin(bits, dtype, r):
    triton_or_skip()
    from hshare.kernels.label_topk_triton import candidate_label_topk_triton

    query, channels, codes, scale, zero, rows, heads, candidates, selectable, window = candidate_case(bits, dtype,
                                                                                                      r=r)
    # a cap (CUDA only) and the scoring in a launch of its own: tiles of 16 and 32 of the 40 candidates (a partial
    # last tile; 0: scored in the top-k's program)
    for heavy, bounds, cap, score_tile in ((12, window, None, 0), (30, None, 0, 16), (64, window, 128, 32),
                                           (12, window, None, 16)):
        got = candidate_label_topk_triton(query, channels, codes, scale, zero, bits, heavy, candidates, rows, heads,
                                          bounds, tile=16, max_registers=cap, score_tile=score_tile)
        want = candidate_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, candidates, bounds,
                                          rows, heads)
        labels = query_labels(query[:, :, None], channels)[:, :, 0][rows[:, None], heads]
        scores = brute_force_scores(labels, codes, scale, zero, bits, rows, heads).gather(-1, candidates.clamp(min=0))
        allowed = candidates >= 0
        if bounds is not None:  # the window's mask: the reference
            allowed &= selectable[:, None].expand(-1, 2, -1).gather(-1, candidates.clamp(min=0))
        check_candidates(got, candidates, scores, allowed, heavy, tol=1e-3)
        if DEVICE == "cpu":  # the interpreter's scores: the twin's very set
            assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_kernels_take_every_row_and_head_without_index_tensors(monkeypatch):
    """Without `rows` / `heads` (every row and every head, in order) the kernels read no index tensors and keep
    the sets of the twins given those rows and heads explicitly: the decode label top-k, the candidate top-k and
    the candidate walk."""
    triton_or_skip()
    from hshare.kernels.label_topk import candidate_label_walk, candidate_label_walk_torch

    monkeypatch.setenv("HSHARE_KERNELS", "triton")
    query, channels, codes, scale, zero, _, _, candidates, selectable, window = walk_case(4, torch.bfloat16)
    rows = torch.arange(3, device=DEVICE)
    heads = torch.arange(2, device=DEVICE)[None]
    got = decode_label_topk(query, channels, codes, scale, zero, 4, 9, None, selectable)
    assert torch.equal(got, decode_label_topk_torch(query, channels, codes, scale, zero, 4, 9, None, selectable,
                                                    rows, heads))
    got = candidate_label_topk(query, channels, codes, scale, zero, 4, 7, candidates, window)
    want = candidate_label_topk_torch(query, channels, codes, scale, zero, 4, 7, candidates, window, rows, heads)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    got = candidate_label_walk(query, channels, codes, scale, zero, 4, candidates, selectable, top=6)
    want = candidate_label_walk_torch(query, channels, codes, scale, zero, 4, candidates, selectable, rows, heads, 6)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_candidate_topk_refines_some_heads_in_place(monkeypatch, kernels):
    """With `out`, the heads given take their own entries of every selection head's candidates and write their
    own entries of `out` (a copying head refining its source's candidates); the other entries stay as they were.
    Kernel (interpreted on CPU) and twin alike."""
    if kernels == "triton":
        triton_or_skip()
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    query, channels, codes, scale, zero, rows, _, candidates, _, window = candidate_case(4, torch.bfloat16)
    some = torch.tensor([[1], [0], [1]], device=DEVICE)  # per row: one head of two refines
    out = torch.full((3, 2, 7), 99, dtype=torch.long, device=DEVICE)
    got = candidate_label_topk(query, channels, codes, scale, zero, 4, 7, candidates, window, rows, some, out=out)
    assert got is out
    own = candidates.gather(1, some[..., None].expand(-1, -1, candidates.shape[-1]))
    want = candidate_label_topk_torch(query, channels, codes, scale, zero, 4, 7, own, window, rows, some)
    mine = some[..., None].expand(-1, -1, 7)
    assert torch.equal(got.gather(1, mine).sort(-1).values, want.sort(-1).values)
    assert bool((got.gather(1, 1 - mine) == 99).all())
    if kernels == "triton":  # scored in a launch of its own: the same entries
        from hshare.kernels.label_topk_triton import candidate_label_topk_triton
        split = torch.full_like(out, 99)
        candidate_label_topk_triton(query, channels, codes, scale, zero, 4, 7, candidates, rows, some, window,
                                    out=split, score_tile=16)
        assert torch.equal(split, got)
    with pytest.raises(ValueError, match="heads"):
        candidate_label_topk(query, channels, codes, scale, zero, 4, 7, candidates, window, rows, out=out)


# --- successors: a selection's top columns walked with their successors ----------------------------


def walk_case(bits, dtype=torch.float32):
    """`candidate_case` with every candidate list inside the window (a selection's top columns are) and runs of
    adjacent columns, so that successors are taken, given and refused."""
    query, channels, codes, scale, zero, rows, heads, candidates, selectable, window = candidate_case(bits, dtype,
                                                                                                      seed=7)
    selectable = selectable.clone()
    candidates = candidates.clone()
    candidates[1, 0, :6] = torch.arange(30, 36, device=DEVICE)  # a run
    candidates[1, 0, 6:] = torch.where(candidates[1, 0, 6:].ge(29) & candidates[1, 0, 6:].le(36), NO_TOKEN,
                                       candidates[1, 0, 6:])
    selectable[1, 30:37] = True
    selectable[0, 119] = True
    candidates[0, 0, 0] = 119  # the last column: no successor
    candidates = torch.where(candidates >= 0, candidates, NO_TOKEN)
    inside = selectable[:, None].expand(-1, 2, -1).gather(-1, candidates.clamp(min=0))
    candidates = torch.where(inside, candidates, NO_TOKEN)
    return query, channels, codes, scale, zero, rows, heads, candidates, selectable, window


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_candidate_walk_twin_is_the_brute_force_walk(bits):
    from property_support import check_successor_walk

    from hshare.kernels.label_topk import candidate_label_walk_torch

    query, channels, codes, scale, zero, rows, heads, candidates, selectable, _ = walk_case(bits)
    got = candidate_label_walk_torch(query, channels, codes, scale, zero, bits, candidates, selectable, rows, heads,
                                     top=5)
    labels = query_labels(query[:, :, None], channels)[:, :, 0][rows[:, None], heads]
    scores = brute_force_scores(labels, codes, scale, zero, bits, rows, heads).gather(-1, candidates.clamp(min=0))
    check_successor_walk(candidates.cpu(), scores.cpu(), selectable.cpu(), (got[0].cpu(), got[1].cpu()))
    assert 35 in got[0][1, 0].tolist() and 36 in got[0][1, 0].tolist()  # the run's last successor


@pytest.mark.parametrize("bits,dtype,ascending", [(4, torch.bfloat16, False), (8, torch.float16, False),
                                                  (16, torch.bfloat16, False), (4, torch.bfloat16, True),
                                                  (8, torch.float32, True)])
def test_candidate_walk_triton_matches_twin(bits, dtype, ascending):
    triton_or_skip()
    from hshare.kernels.label_topk import candidate_label_walk_torch
    from hshare.kernels.label_topk_triton import candidate_label_walk_triton

    query, channels, codes, scale, zero, rows, heads, candidates, selectable, _ = walk_case(bits, dtype)
    if ascending:  # as the label top-k writes them: ascending, NO_TOKEN after (the kernel then sorts nothing)
        last = codes.shape[2]
        candidates = torch.where(candidates >= 0, candidates, last).sort(-1).values
        candidates = torch.where(candidates < last, candidates, NO_TOKEN)
        assert bool((candidates[..., :-1] == NO_TOKEN).any())  # some lists end early
    got = candidate_label_walk_triton(query, channels, codes, scale, zero, bits, candidates, rows, heads, selectable,
                                      7, ascending=ascending, score_tile=0)
    want = candidate_label_walk_torch(query, channels, codes, scale, zero, bits, candidates, selectable, rows, heads,
                                      7)
    for got_part, want_part in zip(got, want):  # the scores' rounding differs, their order here does not
        assert torch.equal(got_part, want_part)
    shared = heads[:1, :1]  # one head list for every row (stride 0), and a candidate list of another width
    got = candidate_label_walk_triton(query, channels, codes, scale, zero, bits, candidates[:, :1, :23], rows, shared,
                                      selectable, score_tile=8)  # scored in a launch of its own
    want = candidate_label_walk_torch(query, channels, codes, scale, zero, bits, candidates[:, :1, :23], selectable,
                                      rows, shared)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_wide_candidate_sets_go_to_the_twin_with_a_warning(monkeypatch):
    """Candidate sets wider than the Triton kernels' register tiles are scored by the twin, never silently: the
    walk's limit first (the top-k still takes that width), then the top-k's (both limits lowered here, so
    that the sets stay small on CPU)."""
    pytest.importorskip("triton")
    import importlib

    from hshare.kernels import label_topk_triton
    from hshare.kernels.label_topk import candidate_label_walk, candidate_label_walk_torch

    monkeypatch.setattr(label_topk_triton, "MAX_WALK_CANDIDATES", 64)
    monkeypatch.setattr(label_topk_triton, "MAX_CANDIDATES", 128)
    generator = torch.Generator().manual_seed(3)
    n = 160
    codes, scale, zero = label_cache(1, 1, n, 8, 8)
    query = torch.randn(1, 1, 16, generator=generator).to(DEVICE)
    channels = torch.randperm(16, generator=generator)[:8].view(1, 1, 8).to(DEVICE)
    selectable = torch.ones(1, n, dtype=torch.bool, device=DEVICE)
    window = torch.tensor([[0, n]], device=DEVICE)  # the same window's bounds
    module = importlib.import_module("hshare.kernels.label_topk")
    monkeypatch.setattr(module, "use_triton", lambda tensor: True)  # as on CUDA
    launched = []
    monkeypatch.setattr(label_topk_triton, "_candidates",  # the launch, recorded and not run
                        lambda *args, **kwargs: (launched.append(args[7].shape[-1]), None, None))
    candidates = torch.randperm(n, generator=generator)[:68].view(1, 1, 68).to(DEVICE)
    with pytest.warns(RuntimeWarning, match="68 candidates .* exceed the 64 the Triton candidate walk"):
        got = candidate_label_walk(query, channels, codes, scale, zero, 8, candidates, selectable)
    want = candidate_label_walk_torch(query, channels, codes, scale, zero, 8, candidates, selectable)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 68 <= 128: the Triton top-k, no warning
        module.candidate_label_topk(query, channels, codes, scale, zero, 8, 5, candidates, window)
    assert launched == [68]
    candidates = torch.randperm(n, generator=generator)[:132].view(1, 1, 132).to(DEVICE)
    with pytest.warns(RuntimeWarning, match="132 candidates .* exceed the 128 the Triton candidate top-k"):
        got = module.candidate_label_topk(query, channels, codes, scale, zero, 8, 5, candidates, window)
    assert torch.equal(got, module.candidate_label_topk_torch(query, channels, codes, scale, zero, 8, 5, candidates,
                                                              window))
    assert launched == [68]


# --- a selection with successors, scored once (`decode_label_topk_walk`) ------------------------------------


def walk_selection_case(bits, dtype, n, seed):
    """GQA decode query with per-row channels, chosen rows and heads and a window with runs of adjacent columns (so
    that the walk takes, gives and refuses successors)."""
    generator = torch.Generator().manual_seed(seed)
    batch, sel_heads, q_heads, r, dim = 3, 2, 4, 8, 16
    codes, scale, zero = label_cache(batch, sel_heads, n, r, bits, dtype, seed=seed)
    query = torch.randn(batch, q_heads, dim, generator=generator).to(DEVICE)
    channels = torch.stack([torch.randperm(dim, generator=generator)[:r] for _ in range(batch * sel_heads)])
    channels = channels.reshape(batch, sel_heads, r).to(DEVICE)
    rows = torch.tensor([2, 0], device=DEVICE)
    heads = torch.tensor([[1, 0], [0, 1]], device=DEVICE)
    selectable = torch.rand(2, n, generator=generator).to(DEVICE) < 0.7
    selectable[0, n // 3:n // 3 + 9] = True
    selectable[1, :5] = False  # a sink-like gap
    return query, channels, codes, scale, zero, rows, heads, selectable


def test_selection_walk_twin_is_the_top_k_then_its_walk():
    """The twin of `decode_label_topk_walk` is `decode_label_topk_torch` of C columns, then
    `candidate_label_walk_torch` of them (which scores them again): the same columns, the best `top` too."""
    from hshare.kernels.label_topk import candidate_label_walk_torch, decode_label_topk_walk_torch

    for bits, count, top in ((4, 24, 6), (8, 40, 0), (16, 7, 3)):
        query, channels, codes, scale, zero, rows, heads, selectable = walk_selection_case(bits, torch.float32, 90, 4)
        got = decode_label_topk_walk_torch(query, channels, codes, scale, zero, bits, count, selectable, rows, heads,
                                           top)
        columns = decode_label_topk_torch(query, channels, codes, scale, zero, bits, count, None, selectable, rows,
                                          heads)
        want = candidate_label_walk_torch(query, channels, codes, scale, zero, bits, columns, selectable, rows, heads,
                                          top)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("n,chunk,tile", [(120, None, None), (300, 64, 16), (300, 64, None)])
def test_label_topk_writes_its_columns_keys(n, chunk, tile):
    """With `keys`, the label top-k (one chunk; several, its last program's candidates in registers or in tiles
    read again) writes each chosen column's order-preserving score key at the column's slot, INT32_MIN after
    them; the columns are those it writes without."""
    triton_or_skip()
    from hshare.kernels.label_topk import score_keys_torch

    bits, heavy = 4, 33
    query, channels, codes, scale, zero, rows, heads, selectable = walk_selection_case(bits, torch.float32, n, 6)
    selectable[1, 40:] = False  # a short window: fewer than heavy columns
    keys = torch.full((4, 48), 7, dtype=torch.int32, device=DEVICE)  # wider than heavy: the rest untouched
    got = run_triton(None, codes, scale, zero, bits, heavy, rows, heads, None, selectable, query=query,
                     channels=channels, chunk=chunk, tile=tile, keys=keys)
    assert torch.equal(got, run_triton(None, codes, scale, zero, bits, heavy, rows, heads, None, selectable,
                                       query=query, channels=channels, chunk=chunk, tile=tile))
    labels = query_labels(query[:, :, None], channels)[:, :, 0][rows[:, None], heads]
    scores = brute_force_scores(labels, codes, scale, zero, bits, rows, heads).gather(-1, got.clamp(min=0))
    chosen = (got >= 0).reshape(4, heavy)
    assert bool((got[1, 0] == NO_TOKEN).any())  # the short window's fill
    written = keys[:, :heavy]
    assert torch.equal(written == -2**31, ~chosen)  # a key at every chosen column's slot, none after
    values = torch.where(written >= 0, written, written ^ 0x7FFFFFFF).view(torch.float32)  # the keys' scores
    torch.testing.assert_close(values[chosen].double(), scores.reshape(4, heavy)[chosen], rtol=1e-5, atol=1e-5)
    assert torch.equal(keys[:, :heavy][chosen], score_keys_torch(values)[chosen])
    assert bool((keys[:, heavy:] == 7).all())
    with pytest.raises(ValueError, match="keys"):
        run_triton(None, codes, scale, zero, bits, heavy, rows, heads, None, selectable, query=query,
                   channels=channels, keys=keys[:, :heavy - 1])


@pytest.mark.parametrize("bits,dtype,n", [(4, torch.bfloat16, 100), (8, torch.float16, 300), (16, torch.float32, 100)])
def test_selection_walk_triton_matches_twin(monkeypatch, bits, dtype, n):
    """`decode_label_topk_walk` on the kernels (the walk reading the top-k's keys, nothing scored twice) against
    its twin, one chunk and several (chunks of 64 at 300 columns)."""
    triton_or_skip()
    import importlib

    from hshare.kernels import label_topk_triton
    from hshare.kernels.label_topk import decode_label_topk_walk_torch

    module = importlib.import_module("hshare.kernels.label_topk")
    monkeypatch.setattr(module, "use_triton", lambda tensor: True)  # as on CUDA
    if n > 100:
        monkeypatch.setattr(label_topk_triton, "CHUNK", 64)
        monkeypatch.setattr(label_topk_triton, "SINGLE_CHUNK", 64)
    walks = []  # each walk launch's SCORED: it reads keys, it does not score
    kernel = label_topk_triton._label_candidates

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                walks.append(kwargs["SCORED"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(label_topk_triton, "_label_candidates", Recorder())
    monkeypatch.setattr(label_topk_triton, "_label_candidate_scores", None)  # no scoring launch either
    query, channels, codes, scale, zero, rows, heads, selectable = walk_selection_case(bits, dtype, n, 8)
    for count, top in ((24, 6), (40, 0)):
        got = module.decode_label_topk_walk(query, channels, codes, scale, zero, bits, count, selectable, rows, heads,
                                            top=top)
        want = decode_label_topk_walk_torch(query, channels, codes, scale, zero, bits, count, selectable, rows, heads,
                                            top)
        assert got[0].shape == (2, 2, count) and got[1].shape == (2, 2, top)
        if DEVICE == "cpu":
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        else:  # scores round differently: the contract (a walk of a top-C set)
            assert torch.equal((got[0] >= 0).sum(-1), (want[0] >= 0).sum(-1))
    assert walks == [True, True]  # the walks read the top-k's keys: no column scored twice


@pytest.mark.parametrize("plan", ["per row", "one plan"])
def test_selection_walk_writes_every_heads_entries(monkeypatch, plan):
    """With head sharing (`head_slot`), the walk's programs write every selection head's walk and best (a copying
    head's: its source's), equal to the walk of the source heads then `per_head`; into the given buffers where they
    fit (in place), else new ones; one chunk and several. The twin path (a count past the kernels') spreads too."""
    triton_or_skip()
    import importlib

    from hshare.kernels import label_topk_triton
    from hshare.kernels.label_topk import decode_label_topk_walk_torch
    from hshare.kernels.selection_heads import per_head

    module = importlib.import_module("hshare.kernels.label_topk")
    monkeypatch.setattr(module, "use_triton", lambda tensor: True)  # as on CUDA
    monkeypatch.setattr(label_topk_triton, "CHUNK", 64)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    batch, sel_heads, q_heads, r, dim, bits = 3, 4, 8, 8, 16, 4
    monkeypatch.setattr(label_topk_triton, "SINGLE_CHUNK", 64)
    for n in (60, 150):
        seed = int(torch.randint(1000, (1,), generator=generator))
        codes, scale, zero = label_cache(batch, sel_heads, n, r, bits, seed=seed)
        query = torch.randn(batch, q_heads, dim, generator=generator).to(DEVICE)
        channels = torch.stack([torch.randperm(dim, generator=generator)[:r] for _ in range(sel_heads)])[None]
        channels = channels.to(DEVICE)
        rows = torch.tensor([2, 0], device=DEVICE)
        selectable = torch.rand(2, n, generator=generator).to(DEVICE) < 0.8
        selectable[1, :4] = False
        if plan == "per row":  # each row its own source heads; a source head is its own slot
            heads = torch.tensor([[0, 2], [1, 3]], device=DEVICE)
            head_slot = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]], device=DEVICE)
        else:
            heads = torch.tensor([[1, 2]], device=DEVICE)
            head_slot = torch.tensor([[0, 0, 1, 0]], device=DEVICE)
        for count, top in ((24, 6), (40, 0)):
            want = [per_head(tensor, head_slot) for tensor in
                    decode_label_topk_walk_torch(query, channels, codes, scale, zero, bits, count, selectable, rows,
                                                 heads, top)]
            buffers = (torch.full((2, sel_heads, count), 7, dtype=torch.int64, device=DEVICE),
                       torch.full((2, sel_heads, top), 7, dtype=torch.int64, device=DEVICE))
            for out in (buffers, (None, None), (buffers[0][:, :, :-1], None)):
                got = module.decode_label_topk_walk(query, channels, codes, scale, zero, bits, count, selectable,
                                                    rows, heads, top=top, head_slot=head_slot, out=out)
                assert all(torch.equal(g, w) for g, w in zip(got, want))
                assert all((g is o) == (o is not None and o.shape == g.shape) for g, o in zip(got, out))
    monkeypatch.setattr(label_topk_triton, "MAX_WALK_CANDIDATES", 16)  # past the kernels: the twin, then per_head
    with pytest.warns(RuntimeWarning, match="24 candidates"):
        got = module.decode_label_topk_walk(query, channels, codes, scale, zero, bits, 24, selectable, rows, heads,
                                            top=6, head_slot=head_slot)
    want = decode_label_topk_walk_torch(query, channels, codes, scale, zero, bits, 24, selectable, rows, heads, 6)
    assert all(torch.equal(g, per_head(w, head_slot)) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="head_slot"):
        label_topk_triton.candidate_label_walk_triton(query, channels, codes, scale, zero, bits, want[0], rows, None,
                                                      selectable, head_slot=head_slot)
