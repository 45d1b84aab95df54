"""Differential property tests (hypothesis): hshare against oracles it does not share code with.

Oracles:
* the unpatched model, wherever the result must be exact: the ``dense`` preset (with or without a
  shared prefix held once), and every preset when every row's context (its own part, next to a
  shared prefix) fits the budget N_c. Compared in float32 / float64 only: bfloat16 may round
  differently when only the order of a reduction changes, so bf16 is checked for invariants;
* pure-Python brute force for the selection (`RowWindows`, `select_heavy`, `critical_indices`),
  for gather attention (softmax over the selected rows), for labels and for prefix detection;
* the plain-PyTorch twins for the Triton kernels (interpreter mode on CPU: few, small cases);
* the same rows decoded alone (float64), for the sparse presets whose selection is per row.

Invariants checked in every model-level example, at every decode step (`SelectionSpy`): logits
finite; critical indices only on valid columns of their row, no duplicates, exactly N_c slots,
equal to sink + (heavy still in the middle window) + local; heavy top-k tie-robust; the work
counters (`cache.stats`) equal to what the schedule, the sharing ratios and the row lengths give.

Profiles (tests/property_support.py): ``ci`` (default, derandomized) and ``local``
(``HYPOTHESIS_PROFILE=local``, ~10x the examples).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

import property_support as ps  # registers and loads the hypothesis profile first

import hshare
from hshare.policy import policy_class
from hshare.kernels import dequantize_labels, gather_attention_torch, label_scores, quantize_labels
from hshare.prefix import build_layout, detect_shared_prefix
from hshare.quest import pages_for
from hshare.selection import NO_TOKEN, RowWindows, nth_valid_columns, select_heavy

PRESETS = [name for name in hshare.preset_names() if not name.endswith(("@1024", "@2048", "@4096"))]  # tiny contexts
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: the GPU, else the interpreter


# =============================================================================================
# function level: selection against a pure-Python brute force
# =============================================================================================
@st.composite
def valid_matrices(draw, max_batch=6, max_n=60):
    batch = draw(st.integers(1, max_batch))
    n = draw(st.integers(1, max_n))
    rows = []
    for _ in range(batch):
        kind = draw(st.sampled_from(["full", "left", "gap", "window", "random"]))
        row = [True] * n
        if kind == "left":
            pads = draw(st.integers(0, n - 1))
            row[:pads] = [False] * pads
        elif kind == "gap" and n >= 3:
            start = draw(st.integers(1, n - 2))
            size = draw(st.integers(1, n - 1 - start))
            row[start:start + size] = [False] * size
        elif kind == "window":  # a sliding window: only the last w columns (after left padding)
            w = draw(st.integers(1, n))
            row[:n - w] = [False] * (n - w)
        elif kind == "random":
            row = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


@st.composite
def window_cases(draw):
    valid = draw(valid_matrices())
    batch, n = valid.shape
    heads = draw(st.integers(1, 4))
    sink, local, heavy = draw(st.integers(0, 6)), draw(st.integers(1, 8)), draw(st.integers(0, 12))
    lookahead = draw(st.integers(0, 4))
    ties = draw(st.booleans())
    seed = draw(st.integers(0, 2**20))
    generator = torch.Generator().manual_seed(seed)
    if ties:
        scores = torch.randint(0, 4, (batch, heads, n), generator=generator).double()
    else:
        scores = torch.stack([torch.randperm(n, generator=generator) for _ in range(batch * heads)])
        scores = scores.reshape(batch, heads, n).double() / n
    # heavy columns from an earlier step, -1 padded: a selection's, so valid then: valid columns now, or columns a
    # sliding window has left since (before the row's first valid column); never a hole between valid columns
    stale = draw(st.booleans())
    stale_heavy = torch.full((batch, heads, heavy), NO_TOKEN, dtype=torch.long)
    if stale and heavy:
        for b in range(batch):
            first = int(valid[b].long().argmax()) if bool(valid[b].any()) else n
            pool = (valid[b] | (torch.arange(n) < first)).nonzero().flatten()
            for h in range(heads):
                count = draw(st.integers(0, min(heavy, len(pool))))
                picks = pool[torch.randperm(len(pool), generator=generator)[:count]]
                slots = torch.randperm(heavy, generator=generator)[:len(picks)]
                stale_heavy[b, h, slots] = picks
    return dict(valid=valid, heads=heads, sink=sink, local=local, heavy=heavy, lookahead=lookahead, ties=ties,
                scores=scores, stale=stale, stale_heavy=stale_heavy)


@settings(max_examples=ps.examples("windows"))
@given(case=window_cases())
def test_windows_top_k_and_critical_indices_equal_brute_force(case):
    valid, sink, local, heavy = case["valid"], case["sink"], case["local"], case["heavy"]
    budget = sink + local + heavy
    scores = case["scores"]
    batch, heads, n = scores.shape
    windows = RowWindows.build(valid, sink, local, budget, case["lookahead"])
    brute = [ps.brute_windows(valid[b].tolist(), sink, local, budget, case["lookahead"]) for b in range(batch)]

    assert windows.n_valid.tolist() == [w["n_valid"] for w in brute]
    assert windows.short.tolist() == [w["short"] for w in brute]
    assert windows.all_short == all(w["short"] for w in brute)
    assert windows.sink.tolist() == [w["sink"] for w in brute]
    assert windows.local.tolist() == [w["local"] for w in brute]
    assert windows.dense.tolist() == [w["dense"] for w in brute]
    for b in range(batch):
        assert set(windows.middle[b].nonzero().flatten().tolist()) == brute[b]["middle"]
        assert set(windows.selectable[b].nonzero().flatten().tolist()) == brute[b]["selectable"]

    chosen = select_heavy(scores, windows.selectable[:, None], heavy)
    assert chosen.shape == (batch, heads, heavy)
    ps.check_top_k(scores, windows.selectable[:, None], heavy, chosen)
    if not case["ties"]:
        for b in range(batch):
            for h in range(heads):
                got = sorted(c for c in chosen[b, h].tolist() if c != NO_TOKEN)
                assert got == sorted(ps.brute_top_k(scores[b, h].tolist(), brute[b]["selectable"], heavy))

    heavy_input = case["stale_heavy"] if case["stale"] else chosen
    critical = windows.critical_indices(heavy_input)
    assert critical.shape == (batch, heads, budget)
    for b in range(batch):
        for h in range(heads):
            got = [c for c in critical[b, h].tolist() if c != NO_TOKEN]
            assert len(got) == len(set(got)), "a column is selected twice"
            assert all(valid[b, c] for c in got), "an invalid column is selected"
            assert len(got) <= budget
            assert set(got) == ps.brute_critical(brute[b], heavy_input[b, h].tolist())

    ranks = torch.randint(-2, n + 2, (batch, 5), generator=torch.Generator().manual_seed(n))
    want = [[brute[b]["cols"][r] if 0 <= r < brute[b]["n_valid"] else NO_TOKEN for r in ranks[b].tolist()]
            for b in range(batch)]
    assert nth_valid_columns(valid, ranks).tolist() == want


# =============================================================================================
# function level: gather attention twin against softmax over the selected rows
# =============================================================================================
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


@st.composite
def gather_cases(draw, dtypes=(torch.float32, torch.float64, torch.bfloat16), max_n=40, max_budget=16):
    kv_heads = draw(st.sampled_from([1, 2]))
    q_heads = kv_heads * draw(st.sampled_from([1, 2, 4, 8]))
    sel_heads = draw(st.sampled_from(sorted({kv_heads, q_heads})))
    batch, n = draw(st.integers(1, 3)), draw(st.integers(1, max_n))
    budget = draw(st.integers(1, max_budget))
    dim = draw(st.sampled_from([32, 64, 128]))
    dtype = draw(st.sampled_from(dtypes))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**20)))
    storage_k = torch.randn(batch, kv_heads, n + 3, dim, generator=generator, dtype=torch.float64)
    storage_v = torch.randn(batch, kv_heads, n + 3, dim, generator=generator, dtype=torch.float64)
    query = torch.randn(batch, q_heads, dim, generator=generator, dtype=torch.float64)
    indices = torch.full((batch, sel_heads, budget), NO_TOKEN, dtype=torch.long)
    for b in range(batch):
        for s in range(sel_heads):
            count = draw(st.integers(0, min(budget, n)))  # 0: a head with nothing to read
            slots = torch.randperm(budget, generator=generator)[:count]
            indices[b, s, slots] = torch.randperm(n, generator=generator)[:count]
    return dict(query=query.to(dtype), keys=storage_k[:, :, :n].to(dtype), values=storage_v[:, :, :n].to(dtype),
                indices=indices, scale=draw(st.sampled_from([dim ** -0.5, 0.3])), dtype=dtype,
                split=draw(st.integers(0, budget)))


def brute_gather(query, keys, values, indices, scale):
    """Per (row, query head): softmax over the selected key rows of its KV head, in float64."""
    batch, q_heads, dim = query.shape
    kv_heads, sel_heads = keys.shape[1], indices.shape[1]
    out = torch.zeros(batch, q_heads, dim, dtype=torch.float64)
    lse = torch.full((batch, q_heads), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for hq in range(q_heads):
            sel = hq // (q_heads // sel_heads)
            kv = sel * kv_heads // sel_heads
            cols = [c for c in indices[b, sel].tolist() if c >= 0]
            if not cols:
                continue
            k, v = keys[b, kv, cols].double(), values[b, kv, cols].double()
            logits = (k @ query[b, hq].double()) * scale
            lse[b, hq] = torch.logsumexp(logits, 0)
            out[b, hq] = torch.softmax(logits, 0) @ v
    return out, lse


@settings(max_examples=ps.examples("gather_twin"))
@given(case=gather_cases())
def test_gather_attention_twin_equals_softmax_over_selected_rows(case):
    q, k, v, idx, scale, dtype = (case[key] for key in ("query", "keys", "values", "indices", "scale", "dtype"))
    out, lse = gather_attention_torch(q, k, v, idx, scale)
    ref_out, ref_lse = brute_gather(q, k, v, idx, scale)
    assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "a head with no index must get lse = -inf, and only those"
    assert bool((out[empty] == 0).all()), "a head with no index must get out = 0"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], rtol=tol, atol=tol)

    # merged with a partial state over the other columns (LSE merge): the same attention
    split = case["split"]
    first = idx.clone()
    first[..., split:] = NO_TOKEN
    second = idx.clone()
    second[..., :split] = NO_TOKEN
    part = gather_attention_torch(q, k, v, first, scale)
    merged, merged_lse = gather_attention_torch(q, k, v, second, scale, partial=(part[0][:, :, None],
                                                                                  part[1][:, :, None]))
    assert not merged.isnan().any()
    assert torch.equal(torch.isneginf(merged_lse), empty)
    torch.testing.assert_close(merged.double(), ref_out, rtol=2 * tol, atol=2 * tol)


# =============================================================================================
# function level: labels (quantization and approximate scores)
# =============================================================================================
@st.composite
def label_cases(draw):
    bits = draw(st.sampled_from([4, 8, 16]))
    r = draw(st.sampled_from([2, 4, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 20)), r)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**20)))
    labels = (torch.randn(shape, generator=generator, dtype=torch.float64) * draw(st.sampled_from([0.01, 1, 30])))
    if draw(st.booleans()):  # constant vectors: zero range
        labels[..., 0, :] = labels[..., 0, :1]
    query = torch.randn(shape[0], shape[1], 2, r, generator=generator, dtype=torch.float64)
    return dict(bits=bits, labels=labels.to(dtype), query=query)


def brute_unpack(codes, bits):
    if bits != 4:
        return codes.long()
    out = torch.zeros(*codes.shape[:-1], codes.shape[-1] * 2, dtype=torch.long)
    out[..., 0::2] = codes.long() & 0x0F  # low nibble: even channel
    out[..., 1::2] = codes.long() >> 4
    return out


@settings(max_examples=ps.examples("labels"))
@given(case=label_cases())
def test_label_quantization_error_and_scores(case):
    bits, labels, query = case["bits"], case["labels"], case["query"]
    codes, scale, zero = quantize_labels(labels, bits)
    x = labels.double()
    if bits == 16:
        deq = dequantize_labels(codes, scale, zero, bits, torch.float64)
        torch.testing.assert_close(deq, x, rtol=1e-2, atol=1e-6)  # a 16-bit float copy
    else:
        levels = (1 << bits) - 1
        unpacked = brute_unpack(codes, bits)
        assert int(unpacked.min()) >= 0 and int(unpacked.max()) <= levels
        deq = unpacked.double() * scale.double()[..., None] + zero.double()[..., None]
        torch.testing.assert_close(dequantize_labels(codes, scale, zero, bits, torch.float64), deq)
        eps, tiny = torch.finfo(scale.dtype).eps, torch.finfo(scale.dtype).smallest_normal
        spread = (x.amax(-1) - x.amin(-1))[..., None]
        # a subnormal scale (fp16 labels of a tiny spread) rounds to an absolute spacing, tiny x eps, x the codes
        bound = spread / levels * (0.5 + levels * eps) + x.abs().amax(-1, keepdim=True) * 2 * eps + 1e-12 \
            + levels * tiny * eps
        assert bool(((deq - x).abs() <= bound).all()), "dequantized label off by more than half a step"
    scores = label_scores(query, codes, scale, zero, bits)
    torch.testing.assert_close(scores.double(), query @ deq.transpose(-1, -2), rtol=1e-5, atol=1e-5)


# =============================================================================================
# function level: shared-prefix detection and layout against brute force
# =============================================================================================
@settings(max_examples=ps.examples("prefix_detection"))
@given(batch=ps.batches(st.integers(1, 12), max_batch=6, paddings=("left",)), levels=st.sampled_from([1, 2]))
def test_prefix_detection_and_layout_equal_brute_force(batch, levels):
    prompts = [torch.tensor(p) for p in batch.prompts]
    shared = detect_shared_prefix(prompts, 1, 1, levels)
    want = ps.brute_force_prefix(batch.prompts, levels, generate_rule=False)
    assert shared.common == (0 if want is None else want.common)
    assert sorted((sorted(rows), ext) for rows, ext in shared.groups) == ([] if want is None else sorted(want.groups))
    if shared.empty:
        return
    layout = build_layout(prompts, shared, pad_token_id=0)
    assert layout.widths == want.widths
    positions = layout.attention_mask.cumsum(-1) - 1
    for row, prompt in enumerate(prompts):
        kept = layout.attention_mask[row].bool()
        assert torch.equal(layout.input_ids[row, kept], prompt), "tokens changed by the layout"
        assert torch.equal(positions[row, kept], torch.arange(len(prompt))), "RoPE positions changed by the layout"
        assert int(layout.attention_mask[row, -1]) == 1, "every row keeps an own token"


# =============================================================================================
# kernels: Triton (interpreter on CPU) against the PyTorch twins: few, small cases
# =============================================================================================
@settings(max_examples=ps.examples("triton_gather"))
@given(case=gather_cases(dtypes=(torch.float32, torch.bfloat16), max_n=24, max_budget=10))
def test_triton_gather_attention_equals_twin(case):
    pytest.importorskip("triton")
    from hshare.kernels.gather_attention_triton import gather_attention_triton

    q, k, v, idx, scale, dtype = (case[key] for key in ("query", "keys", "values", "indices", "scale", "dtype"))
    on = lambda t: t.to(DEVICE)
    out, lse = gather_attention_triton(on(q), on(k), on(v), on(idx.to(torch.int32)), scale)
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = gather_attention_torch(q.double(), k.double(), v.double(), idx, scale)
    empty = torch.isneginf(ref_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), empty)
    assert bool((out[empty] == 0).all())
    tol = 2e-2 if dtype == torch.bfloat16 else (5e-3 if DEVICE == "cuda" else 1e-5)  # tf32 dot on the GPU
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], rtol=tol, atol=tol)


@settings(max_examples=ps.examples("triton_critical"))
@given(case=window_cases())
def test_triton_critical_indices_equal_twin(case):
    pytest.importorskip("triton")
    from hshare.kernels import critical_indices_torch
    from hshare.kernels.critical_indices_triton import critical_indices_triton

    sink, local, heavy = case["sink"], case["local"], case["heavy"]
    windows = RowWindows.build(case["valid"], sink, local, sink + local + heavy)
    args = (case["stale_heavy"], windows.sink, windows.local, windows.dense, windows.middle_bounds, windows.short)
    got = critical_indices_triton(*(t.to(DEVICE) for t in args)).cpu().long()
    assert torch.equal(got, critical_indices_torch(*args))


@settings(max_examples=ps.examples("triton_candidates"))
@given(bits=st.sampled_from([4, 8]), r=st.sampled_from([2, 8]), group=st.sampled_from([1, 2]),
       rows=st.integers(1, 3), n=st.integers(4, 48), width=st.integers(1, 40), extra=st.integers(-3, 6),
       score_tile=st.sampled_from([8, 16, 64]), masked=st.booleans(), tied=st.booleans(), seed=st.integers(0, 2**16))
def test_triton_candidate_kernels_split_or_not_equal_twin(bits, r, group, rows, n, width, extra, score_tile, masked,
                                                           tied, seed):
    """The candidate top-k and walk give the same columns whether the candidates are scored in their program or
    in a launch of their own (any score tile, a partial last tile), and (interpreter: the twin's scores) the
    twin's: random candidate lists with NO_TOKEN gaps, heavy from 0 to beyond the candidates, windows (the top-k's
    bounds, the walk's mask), tied labels."""
    pytest.importorskip("triton")
    from hshare.kernels import quantize_labels
    from hshare.kernels.label_topk import candidate_label_topk_torch, candidate_label_walk_torch
    from hshare.kernels.label_topk_triton import candidate_label_topk_triton, candidate_label_walk_triton

    generator = torch.Generator().manual_seed(seed)
    sel, dim = 2, 16
    keys = torch.randn(rows, sel, n, r, generator=generator)
    if tied:  # a few distinct label rows: many equal scores
        keys = keys[:, :, torch.randint(0, 3, (n,), generator=generator)]
    codes, scale, zero = quantize_labels(keys.to(DEVICE), bits)
    query = torch.randn(rows, sel * group, dim, generator=generator).to(DEVICE)
    channels = torch.stack([torch.randperm(dim, generator=generator)[:r] for _ in range(sel)])[None].to(DEVICE)
    width = min(width, n)
    candidates = torch.stack([torch.randperm(n, generator=generator)[:width] for _ in range(rows * sel)])
    candidates = candidates.view(rows, sel, width)
    candidates[torch.rand(candidates.shape, generator=generator) < 0.2] = NO_TOKEN
    selectable = torch.rand(rows, n, generator=generator) < 0.8 if masked else torch.ones(rows, n, dtype=torch.bool)
    selectable = selectable.to(DEVICE)
    heavy = max(0, width + extra) if extra > 0 else max(0, width // 2 + extra)
    candidates = candidates.to(DEVICE)
    bounds = torch.stack((torch.randint(0, n // 2 + 1, (rows,), generator=generator),
                          torch.randint(n // 2, n + 1, (rows,), generator=generator)), -1)
    window = bounds.to(DEVICE) if masked else None  # the top-k's window: column bounds
    topk = [candidate_label_topk_triton(query, channels, codes, scale, zero, bits, heavy, candidates, None, None,
                                        window, score_tile=tile) for tile in (0, score_tile)]
    assert torch.equal(topk[0], topk[1])
    # the walk takes the candidates in the window (a selection's top columns are)
    inside = selectable[:, None].expand(-1, sel, -1).gather(-1, candidates.clamp(min=0))
    walk_candidates = torch.where(inside & (candidates >= 0), candidates, NO_TOKEN)
    top = min(heavy, width)
    walks = [candidate_label_walk_triton(query, channels, codes, scale, zero, bits, walk_candidates, None, None,
                                         selectable, top, score_tile=tile) for tile in (0, score_tile)]
    assert all(torch.equal(a, b) for a, b in zip(*walks))
    if DEVICE == "cpu":  # the interpreter scores as the twin does
        want = candidate_label_topk_torch(query, channels, codes, scale, zero, bits, heavy, candidates, window)
        assert torch.equal(topk[0].sort(-1).values, want.sort(-1).values)
        want = candidate_label_walk_torch(query, channels, codes, scale, zero, bits, walk_candidates, selectable,
                                          top=top)
        assert all(torch.equal(a, b) for a, b in zip(walks[0], want))


@settings(max_examples=ps.examples("triton_labels"))
@given(bits=st.sampled_from([4, 8]), r=st.sampled_from([2, 8, 16]), tokens=st.integers(1, 12),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), sel_per_query=st.booleans(),
       seed=st.integers(0, 2**16))
def test_triton_labels_equal_twin(bits, r, tokens, dtype, sel_per_query, seed):
    pytest.importorskip("triton")
    from hshare.kernels import append_labels, label_storage_dtype, score_heads
    from hshare.kernels.labels_triton import append_labels_triton, score_heads_triton

    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, q_heads, dim = 2, 2, 4, 32
    sel = q_heads if sel_per_query else kv_heads
    keys = torch.randn(batch, kv_heads, tokens, dim, generator=generator).to(dtype)
    channels = torch.stack([torch.randperm(dim, generator=generator)[:r] for _ in range(sel)])[None]
    store = label_storage_dtype(dtype)
    width = r * bits // 8

    def empty():
        return (torch.zeros(batch, sel, tokens, width, dtype=torch.uint8), torch.zeros(batch, sel, tokens, dtype=store),
                torch.zeros(batch, sel, tokens, dtype=store))

    twin, kernel = empty(), tuple(t.to(DEVICE) for t in empty())
    append_labels(keys, channels, bits, *twin)
    append_labels_triton(keys.to(DEVICE), channels.to(DEVICE), bits, *kernel)
    for a, b in zip(twin, kernel):
        assert torch.equal(a, b.cpu()), "the label kernel must write exactly the twin's codes, scales and zeros"
    query = torch.randn(batch, sel, r, generator=generator)
    rows, heads = torch.arange(batch), torch.arange(sel)[None]
    got = score_heads_triton(query.to(DEVICE), *kernel, bits, rows.to(DEVICE), heads.to(DEVICE)).cpu()
    want = score_heads(query, *twin, bits)
    tol = 5e-3 if DEVICE == "cuda" else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# =============================================================================================
# model level
# =============================================================================================
def _expected_valid(ids_mask: torch.Tensor, window: int | None):
    """Key validity of decode step with kv_len columns: the prompt's mask, then generated tokens,
    inside the sliding window (the last `window` columns)."""

    def expected(kv_len: int) -> torch.Tensor:
        steps = kv_len - ids_mask.shape[1]
        valid = torch.cat((ids_mask.bool(), torch.ones(ids_mask.shape[0], steps, dtype=torch.bool)), 1)
        if window is not None and kv_len > window:
            valid[:, :kv_len - window] = False
        return valid

    return expected


def _own_valid_oracle(own: list[int]):
    width = max(own)

    def expected(kv_len: int) -> torch.Tensor:
        steps = kv_len - width
        rows = [[False] * (width - n) + [True] * (n + steps) for n in own]
        return torch.tensor(rows, dtype=torch.bool)

    return expected


@st.composite
def exact_scenarios(draw):
    """A model (fp32 / fp64), a preset, a batch, and a budget N_c that covers the own context of every
    row, or of some rows only (the others decode sparsely next to them)."""
    spec = draw(ps.model_specs(dtypes=("float32", "float64")))
    preset = draw(st.one_of(st.just("dense"), st.sampled_from(PRESETS)))
    batch = draw(ps.batches(st.one_of(st.integers(1, 4), st.integers(5, 40))))
    new_tokens = draw(st.integers(1, 6))
    share = batch.structure != "none"
    levels = 2 if batch.structure == "two" else draw(st.sampled_from([1, 2]))
    expected = ps.brute_force_prefix(batch.prompts, levels) if share else None
    own = expected.own if expected else [len(p) for p in batch.prompts]
    needed = max(own) + new_tokens - 1  # the longest own context at the last decode step
    if draw(st.booleans()):
        budget = needed + draw(st.integers(0, 3))  # every row fits
    else:
        budget = draw(st.sampled_from(sorted({n + new_tokens - 1 for n in own})))  # the shorter rows fit
    overrides = draw(ps.config_overrides(preset, spec, budget=max(budget, 1)))
    overrides["prefix"] = "on" if share else "off"
    overrides["prefix_levels"] = levels
    return spec, preset, overrides, batch, new_tokens


@settings(max_examples=ps.examples("model_exact"))
@given(scenario=exact_scenarios())
def test_exact_where_the_result_must_be_exact(scenario):
    """``dense`` with any shared-prefix structure is the unpatched model (fp32 / fp64 rounding only);
    so is, under any preset, every row whose own context (next to a shared prefix) stays within
    N_c at every step, whatever its batch mates do; the counters agree (no sparse step when every
    row fits)."""
    spec, preset, overrides, batch, new_tokens = scenario
    model = ps.build_model(spec)
    ids, mask = batch.tensors()
    ref_seq, ref_logits = ps.generate(model, ids, mask, new_tokens)
    config = hshare.HShareConfig.from_preset(preset).replace(**overrides)
    expected_prefix = ps.stored_prefix(batch, config, spec.window, new_tokens)
    own = expected_prefix.own if expected_prefix else [len(p) for p in batch.prompts]
    if spec.window is not None:
        own = [min(n, spec.window) for n in own]  # keys outside the window are never valid
    with hshare.patched(model, config):
        cache = hshare.new_cache(model)
        with ps.SelectionSpy(config.budget.sink, config.budget.local, config.budget.total, config.budget.heavy,
                             candidates=config.candidate_count,
                             successors=config.sharing.successors):
            seq, logits = ps.generate(model, ids, mask, new_tokens, cache=cache)
    assert torch.isfinite(logits).all()
    atol = 1e-8 if spec.dtype == "float64" else 2e-5
    fits = [row for row, n in enumerate(own) if not config.sparse or n + new_tokens - 1 <= config.budget.total]
    event(f"rows compared: {'all' if len(fits) == len(own) else 'some'}")
    ps.assert_same_generation(ref_seq[fits], ref_logits[fits], seq[fits], logits[fits], ids.shape[1], atol)
    if expected_prefix is None:
        assert cache.prefix is None or not cache.prefix.levels
    else:
        assert [level.width for level in cache.prefix.levels] == expected_prefix.widths
    stats = cache.stats
    event(f"prefix levels: {len(expected_prefix.widths) if expected_prefix else 0}")
    event(f"preset {'dense' if not config.sparse else 'sparse'}")
    assert stats.decode_steps == new_tokens - 1 and stats.dense_fallback_steps == 0
    if len(fits) == len(own):
        assert stats.sparse_steps == 0
        assert stats.kv_rows_read <= stats.dense_kv_rows or config.planner.selection == "query_head"


@st.composite
def invariant_scenarios(draw, presets=tuple(PRESETS), dtypes=("float32", "float64", "float32", "float64", "bfloat16")):
    """Any model (fp32 / fp64 / bf16), any preset with a small budget, prompts around N_c. bf16 is
    drawn less often: its matrix products are slow on CPUs without bf16 units."""
    spec = draw(ps.model_specs(dtypes=dtypes))
    preset = draw(st.sampled_from(presets))
    overrides = draw(ps.config_overrides(preset, spec))
    config = hshare.HShareConfig.from_preset(preset).replace(**overrides)
    batch = draw(ps.batches(ps.length_classes(max(config.budget.total, 1))))
    share = batch.structure != "none"
    overrides["prefix"] = "on" if share else "off"
    overrides["prefix_levels"] = 2 if batch.structure == "two" else draw(st.sampled_from([1, 2]))
    return spec, preset, overrides, batch, draw(st.one_of(st.integers(2, 8), st.integers(1, 12)))


@settings(max_examples=ps.examples("model_invariants"))
@given(scenario=invariant_scenarios())
def test_sparse_decode_invariants_and_counters(scenario):
    """Small budgets, every preset and dtype: finite logits; at every step the critical indices and
    the heavy top-k equal their brute force on the validity the step was given, and that validity
    is the prompt's mask (or own part next to a shared prefix) inside the sliding window; the
    stored prefix is the brute-force one; every `cache.stats` counter equals `expected_stats`."""
    spec, preset, overrides, batch, new_tokens = scenario
    model = ps.build_model(spec)
    ids, mask = batch.tensors()
    config = hshare.HShareConfig.from_preset(preset).replace(**overrides)
    steps = new_tokens - 1
    expected_prefix = ps.stored_prefix(batch, config, spec.window, new_tokens)
    lengths = [len(p) for p in batch.prompts]
    if expected_prefix is None:
        expected_valid = _expected_valid(mask, spec.window)
        own_width = ids.shape[1]
        own_valid = lambda s: expected_valid(own_width + s).sum(-1).tolist()
        full_valid = own_valid
    else:
        expected_valid = _own_valid_oracle(expected_prefix.own)
        own_width = expected_prefix.own_width
        own_valid = lambda s: [n + s for n in expected_prefix.own]
        full_valid = lambda s: [n + s for n in lengths]
    window_clips = spec.window is not None and ids.shape[1] + steps > spec.window
    note(f"config: {config}")
    with hshare.patched(model, config):
        cache = hshare.new_cache(model)
        with ps.SelectionSpy(config.budget.sink, config.budget.local, config.budget.total, config.budget.heavy, expected_valid,
                             candidates=config.candidate_count,
                             successors=config.sharing.successors) as spy:
            seq, logits = ps.generate(model, ids, mask, new_tokens, cache=cache)
    assert torch.isfinite(logits).all(), "NaN / inf in the logits"
    assert seq.shape == (len(lengths), ids.shape[1] + new_tokens)
    if expected_prefix is None:
        assert cache.prefix is None or not cache.prefix.levels
    else:
        assert [level.width for level in cache.prefix.levels] == expected_prefix.widths
    expected = ps.expected_stats(config, spec, len(lengths), steps, own_valid, full_valid, own_width,
                                 expected_prefix, window_clips)
    stats = cache.stats
    event(f"sparse steps: {'some' if stats.sparse_steps else 'none'}")
    event(f"prefix levels: {len(expected_prefix.widths) if expected_prefix else 0}")
    event(f"kv_rows_read checked {'exactly' if expected.kv_rows_read_exact else 'as a bound'}")
    event(f"dtype {spec.dtype}")
    event(f"batch {len(lengths)}")
    event(f"GQA {spec.gqa}, head dim {spec.head_dim}")
    ps.assert_stats(stats, expected)
    if stats.sparse_steps:
        assert spy.critical_calls > 0, "sparse steps ran but the critical indices were never built"
    if stats.selection_steps:
        assert spy.select_calls > 0
        if config.sharing.successors and stats.score_computations:
            assert spy.walk_calls > 0, "successors on, but no selection walked its columns"


@st.composite
def alone_scenarios(draw):
    spec = draw(ps.model_specs(dtypes=("float64",), archs=("llama",)))
    preset = draw(st.sampled_from([p for p in PRESETS if p != "dense" and not p.startswith("random")  # per-row plans:
                                   and hshare.HShareConfig.from_preset(p).planner.scorings is None]))  # no batch budget
    overrides = draw(ps.config_overrides(preset, spec))
    overrides.update(plan_scope="sample", prefix="off")
    config = hshare.HShareConfig.from_preset(preset).replace(**overrides)
    batch = draw(ps.batches(ps.length_classes(max(config.budget.total, 1)), structures=("none",), max_batch=4,
                            paddings=("left", "left_extra")))
    return spec, preset, overrides, batch, draw(st.integers(2, 7))


@settings(max_examples=ps.examples("model_rows_alone"))
@given(scenario=alone_scenarios())
def test_sparse_rows_decode_as_if_alone(scenario):
    """Per-sample plans: a row's selections depend on its own tokens only, so a padded batch decodes
    each row as that row decodes alone (float64; sparse steps included)."""
    spec, preset, overrides, batch, new_tokens = scenario
    model = ps.build_model(spec)
    ids, mask = batch.tensors()
    with hshare.patched(model, preset, **overrides):
        seq, logits = ps.generate(model, ids, mask, new_tokens)
        width = ids.shape[1]
        for row, prompt in enumerate(batch.prompts):
            alone_ids = torch.tensor([prompt])
            alone_seq, alone_logits = ps.generate(model, alone_ids, torch.ones_like(alone_ids), new_tokens)
            ps.assert_same_generation(alone_seq[:, len(prompt):], alone_logits, seq[row:row + 1, width:],
                                      logits[row:row + 1], 0, 1e-8)


@settings(max_examples=ps.examples("model_static_shapes"))
@given(scenario=invariant_scenarios(presets=PRESETS, dtypes=("float32", "float64")))
def test_static_shape_decode_equals_eager_decode(scenario):
    """The static-shape step (buffers reserved at the final length, validity and the token's column
    as device tensors: what a CUDA graph captures, run eagerly on the CPU) decodes as the eager step
    does, in any scenario: same tokens and logits up to rounding, same work counters (static shapes
    score every reserved column: ``scored_tokens`` = scorings x reserve; Quest every reserved page slot)."""
    from hshare import static_decode

    spec, preset, overrides, batch, new_tokens = scenario  # fp32 / fp64: compared to rounding (module docstring)
    model = ps.build_model(spec)
    ids, mask = batch.tensors()
    runs = []
    previous = static_decode.STATIC_ON_CPU
    static_decode.STATIC_ON_CPU = True
    try:
        for graphs in (False, True):
            with hshare.patched(model, preset, cuda_graphs=graphs, **overrides):
                cache = hshare.new_cache(model)
                runs.append((*ps.generate(model, ids, mask, new_tokens, cache=cache), cache))
    finally:
        static_decode.STATIC_ON_CPU = previous
    (eager_seq, eager_logits, eager), (seq, logits, static) = runs
    event(f"static decode: {'ran' if static.static_decode.reason == '' else static.static_decode.reason}")
    if new_tokens > 1 and static.reserve:
        assert static.static_decode.reason == "", static.static_decode.reason
    ps.assert_same_generation(eager_seq, eager_logits, seq, logits, ids.shape[1],
                              1e-8 if spec.dtype == "float64" else 2e-5)
    if torch.equal(seq, eager_seq):
        ours, theirs = static.stats, eager.stats
        for name in ("decode_steps", "sparse_steps", "dense_fallback_steps", "selection_steps",
                     "score_computations", "plans", "dense_kv_rows"):
            assert getattr(ours, name) == getattr(theirs, name), name
        if static.config.planner.selection == "query_head":
            # a step whose rows all fit N_c: eager reads each valid key once per KV head (dense SDPA);
            # static shapes never read the device to learn that, and gather per query head (GQA x)
            assert theirs.kv_rows_read <= ours.kv_rows_read <= theirs.kv_rows_read * spec.gqa
        else:
            assert ours.kv_rows_read == theirs.kv_rows_read
        if static.static_decode.reason == "" and static.reserve:
            if static.config.policy.name == "quest":  # every reserved page slot
                assert ours.scored_pages == ours.score_computations * pages_for(static.reserve, static.config.policy.page_size)
            else:  # every reserved slot, and (a policy scoring candidates alone) a scoring's C candidates or
                # with successors its top C or heavy again (not the label policy: its walk takes the selection's
                # own scores), a refinement's C candidates
                config = static.config
                count, scores_candidates = config.candidate_count, policy_class(config.policy.name).scores_candidates
                again = ((count or config.budget.heavy) if config.sharing.successors else count) \
                    if scores_candidates else 0
                if config.sharing.successors and config.policy.name == "labels":
                    again = 0
                refined = count if scores_candidates else static.reserve
                if config.sharing.refine_by == "keys":  # C key rows a scoring and a refinement instead (the walk's
                    # ranking of a scoring's C stays on the labels)
                    again, refined = (again if config.sharing.successors else 0), 0
                    assert ours.scored_keys == (ours.score_computations + ours.refinements) * count
                expected = ours.score_computations * (static.reserve + again) + ours.refinements * refined
                assert ours.scored_tokens == expected


def test_profiles_have_the_promised_sizes():
    assert ps.total_examples("ci") >= 200
    assert ps.total_examples("local") >= 2000
    assert settings.default.deadline is None
    assert settings.default.derandomize == (ps.PROFILE == "ci")
