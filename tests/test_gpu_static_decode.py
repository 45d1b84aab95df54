"""Static-shape decode replayed as CUDA graphs (`hshare.static_decode`), on a GPU.

Graph replay must give the tokens of eager decode (the same hshare config with
``cuda_graphs=False``), and exact configs the tokens of the unpatched model; steps after capture
must not synchronise with the host. Skipped without CUDA (the device run executes it).
"""

from __future__ import annotations

import pytest
import torch

import hshare
from hshare import elementwise_fusion, static_decode
from conftest import VOCAB, cache_kwarg, left_pad, left_padded, tiny_llama, tiny_mistral
from test_static_decode import _generate, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Bitwise comparisons run the model's own elementwise kernels and its three q/k/v products in the graph
# (compile_elementwise=False, fuse_projections=False): inductor's fused RMSNorm reduces in another order, and
# cuBLAS may split a stacked product's sums otherwise. The fused path is checked against them below.
UNFUSED = dict(compile_elementwise=False, fuse_projections=False)
FUSED = dict(compile_elementwise=True, fuse_projections=True)  # as by default
SPARSE = dict(sink=2, local=4, heavy=6, dense_fallback_mib=0, **UNFUSED)  # sparse from the first step on CUDA


@pytest.fixture(autouse=True)
def _exact_float32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def _batch(lengths, device="cuda"):
    ids, mask = left_padded(lengths)
    return ids.to(device), mask.to(device)


def assert_equal_but_near_ties(out: torch.Tensor, reference, width: int) -> None:
    """Greedy tokens `out` equal the reference's (a ``return_dict_in_generate`` output with logits) in each
    row up to a step whose reference logits have a near-tie at the top (16-bit rounding may order such a
    pair either way: hshare's split-KV kernel and transformers' SDPA sum the keys in another order)."""
    logits = torch.stack(reference.logits, 1).float()  # [B, T, V]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[..., 0] - top2[..., 1]
    for row in range(out.shape[0]):
        differ = (out[row, width:] != reference.sequences[row, width:]).nonzero()
        if len(differ):
            step = int(differ[0])
            assert gaps[row, step] <= 3e-2 * logits[row, step].abs().max(), f"row {row} differs at step {step}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[40, 40, 40], [40, 23, 31, 9]])
def test_dense_graphs_equal_unpatched(dtype, lengths):
    model = tiny_llama(dtype=dtype).cuda()
    ids, mask = _batch(lengths)
    reference = _generate(model, ids, mask, new_tokens=12, output_logits=True, return_dict_in_generate=True)
    out, cache = _run(model, "dense", ids, mask, static=True, new_tokens=12, prefix="off", **UNFUSED)
    assert cache.static_decode.reason == "" and cache.static_decode.graphed_steps >= 9
    if dtype == torch.float32:
        assert torch.equal(out, reference.sequences)
    else:
        assert_equal_but_near_ties(out, reference, ids.shape[1])


@pytest.mark.parametrize("preset", ["ds", "hshare-1_2-1_2-1_2", "hshare-7_8-3_4-1_2", "streaming", "quest",
                                    "quest-1_2-1_2-1_2", "hshare-refine", "hshare-refine-successors"])
@pytest.mark.parametrize("scope", ["batch", "sample"])
def test_sparse_graphs_equal_eager(preset, scope):
    model = tiny_llama(kv_heads=2, layers=4).cuda()
    ids, mask = _batch([60, 44, 51, 37])
    eager, eager_cache = _run(model, preset, ids, mask, static=False, new_tokens=12, plan_scope=scope, **SPARSE)
    graphed, cache = _run(model, preset, ids, mask, static=True, new_tokens=12, plan_scope=scope, **SPARSE)
    assert cache.static_decode.reason == "", cache.static_decode
    assert torch.equal(graphed, eager)
    ours, theirs = cache.stats, eager_cache.stats
    assert (ours.kv_rows_read, ours.dense_kv_rows, ours.sparse_steps, ours.selection_steps) == \
        (theirs.kv_rows_read, theirs.dense_kv_rows, theirs.sparse_steps, theirs.selection_steps)
    assert (ours.score_computations, ours.refinements) == (theirs.score_computations, theirs.refinements)


def test_seeded_sampling_graphs_equal_eager():
    model = tiny_llama().cuda()
    ids, mask = _batch([50, 33])
    eager, _ = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=False, new_tokens=12, seed=7, **SPARSE)
    graphed, _ = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True, new_tokens=12, seed=7, **SPARSE)
    assert torch.equal(graphed, eager)


@pytest.mark.parametrize("preset", ["dense", "ds"])
def test_shared_prefix_graphs(preset):
    model = tiny_llama().cuda()
    prefix = torch.randint(3, VOCAB, (48,))
    ids, mask = left_pad([torch.cat((prefix, torch.randint(3, VOCAB, (n,)))) for n in (5, 9, 2)])
    ids, mask = ids.cuda(), mask.cuda()
    overrides = dict(prefix="on", **(UNFUSED if preset == "dense" else SPARSE))
    eager, _ = _run(model, preset, ids, mask, static=False, new_tokens=12, **overrides)
    graphed, cache = _run(model, preset, ids, mask, static=True, new_tokens=12, **overrides)
    assert cache.prefix is not None and cache.static_decode.reason == "", cache.static_decode
    assert torch.equal(graphed, eager)
    if preset == "dense":
        assert torch.equal(graphed, _generate(model, ids, mask, new_tokens=12))


def test_mistral_sliding_window_graphs_equal_unpatched():
    model = tiny_mistral(sliding_window=24).cuda()
    ids, mask = _batch([30, 19])
    reference = _generate(model, ids, mask, new_tokens=16)
    hshare.patch(model, "dense", prefix="off", **UNFUSED)
    cache = hshare.new_cache(model)
    out = _generate(model, ids, mask, new_tokens=16, **cache_kwarg(cache))
    hshare.unpatch(model)
    assert cache.static_decode.reason == ""
    assert torch.equal(out, reference)


def test_repeated_calls_other_shapes_no_stale_graph():
    """Graphs and buffers of one generate call must not leak into the next (other batch, lengths, prompt)."""
    model = tiny_llama().cuda()
    calls = [(_batch(lengths), new) for lengths, new in (([40, 30], 8), ([55, 20, 41], 14), ([40, 30], 8))]
    hshare.patch(model, "hshare-1_2-1_2-1_2", **SPARSE)
    graphed = [_generate(model, ids, mask, new_tokens=new) for (ids, mask), new in calls]
    hshare.patch(model, "hshare-1_2-1_2-1_2", cuda_graphs=False, **SPARSE)
    eager = [_generate(model, ids, mask, new_tokens=new) for (ids, mask), new in calls]
    hshare.unpatch(model)
    for got, expected in zip(graphed, eager):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("preset", ["dense", "ds", "hshare-1_2-1_2-1_2", "quest-1_2-1_2-1_2"])
def test_no_host_sync_in_a_replayed_step(monkeypatch, preset):
    model = tiny_llama().cuda()
    ids, mask = _batch([50, 33, 41])
    checked = []
    decode = static_decode.StaticDecoder._decode

    def strict(self, cache, kwargs):
        if cache.planner.step < 2:
            return decode(self, cache, kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = decode(self, cache, kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(cache.planner.step)
        return out

    monkeypatch.setattr(static_decode.StaticDecoder, "_decode", strict)
    overrides = {} if preset == "dense" else dict(SPARSE, **FUSED)  # the fused step, as by default
    _, cache = _run(model, preset, ids, mask, static=True, new_tokens=12, **overrides)
    assert cache.static_decode.reason == "" and cache.static_decode.fusion == "fused" and len(checked) >= 8


def test_outgrown_generation_goes_on_eagerly(monkeypatch):
    model = tiny_llama().cuda()
    ids, mask = _batch([40, 28])
    eager, _ = _run(model, "ds", ids, mask, static=False, new_tokens=12, **SPARSE)
    monkeypatch.setattr(static_decode.StaticDecoder, "__init__", _short_reserve(static_decode.StaticDecoder.__init__))
    graphed, cache = _run(model, "ds", ids, mask, static=True, new_tokens=12, **SPARSE)
    assert "outgrew" in cache.static_decode.reason
    assert torch.equal(graphed, eager)


def _short_reserve(init):
    def wrapped(self, model, forward, new_tokens, report):
        init(self, model, forward, new_tokens - 5, report)
    return wrapped


@pytest.mark.parametrize("preset", ["dense", "hshare-1_2-1_2-1_2"])
def test_fused_elementwise_equals_unfused_float32(preset):
    """Inductor-fused norms / rotary / MLP and stacked q/k/v products in the captured step give the unfused
    step's tokens (float32: only the order of a reduction differs), also after a call at another batch size
    (a recompile)."""
    model = tiny_llama(kv_heads=2, layers=4).cuda()
    sparse = {} if preset == "dense" else dict(SPARSE, **FUSED)
    for lengths in ([60, 44, 51, 37], [52, 30]):
        ids, mask = _batch(lengths)
        unfused, _ = _run(model, preset, ids, mask, static=True, new_tokens=12, **dict(sparse, **UNFUSED))
        fused, cache = _run(model, preset, ids, mask, static=True, new_tokens=12, **sparse)
        report = cache.static_decode
        assert report.reason == "" and report.fusion == "fused" and report.graphed_steps >= 9, report
        assert report.projections == "stacked", report
        assert torch.equal(fused, unfused)
    attention = model.model.layers[0].self_attn  # stacked for the generate only: each its own storage again
    assert len({p.weight.untyped_storage().data_ptr() for p in (attention.q_proj, attention.k_proj,
                                                                 attention.v_proj)}) == 3


@pytest.mark.parametrize("preset", ["dense", "hshare-1_2-1_2-1_2", "hshare-refine-successors", "quest", "ds-keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dependent_launches_equal_ordinary_launches(monkeypatch, preset, dtype):
    """Programmatic dependent launches (`runtime.dependent_launch`, on by default: hshare's kernels and the
    inductor-fused ones) run the same kernels in the same order as ordinary launches: the same logits, bit for
    bit, at every step; on a GPU before Hopper both runs launch ordinarily. Inductor compiles both variants
    afresh (a function it has seen at other shapes recompiles with dynamic shapes, another reduction order)."""
    torch._dynamo.reset()
    monkeypatch.setattr(elementwise_fusion, "_COMPILED", {})
    model = tiny_llama(kv_heads=2, layers=4, dtype=dtype).cuda()
    ids, mask = _batch([60, 44, 51, 37])
    overrides = {} if preset == "dense" else dict(sink=2, local=4, heavy=6, dense_fallback_mib=0)
    logits = {}
    for on in (False, True):
        hshare.patch(model, preset, dependent_launch=on, **overrides)
        cache = hshare.new_cache(model)
        out = _generate(model, ids, mask, new_tokens=12, **cache_kwarg(cache), output_logits=True,
                        return_dict_in_generate=True)
        hshare.unpatch(model)
        report = cache.static_decode
        assert report.reason == "" and report.fusion == "fused" and report.graphed_steps >= 9, report
        logits[on] = torch.stack(out.logits)
    assert torch.equal(logits[True], logits[False])


def test_fused_elementwise_bfloat16_close_to_unfused():
    model = tiny_llama(dtype=torch.bfloat16).cuda()
    ids, mask = _batch([40, 23, 31, 9])
    scores = {}
    for fused in (False, True):
        hshare.patch(model, "dense", prefix="off", compile_elementwise=fused)
        cache = hshare.new_cache(model)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, pad_token_id=0,
                             do_sample=False, **cache_kwarg(cache), output_scores=True, return_dict_in_generate=True)
        hshare.unpatch(model)
        assert cache.static_decode.fusion == ("fused" if fused else "compile_elementwise=False")
        scores[fused] = torch.stack(out.scores).float()
    # same first tokens' logits up to bf16 rounding; later steps may follow another near-tied token
    torch.testing.assert_close(scores[True][:2], scores[False][:2], rtol=0.05, atol=0.05)


def test_repeated_generates_leave_no_memory_behind():
    """Warm-up and capture run on one side stream per device (`hshare.graphs.side_stream`): each new
    stream would keep a cuBLAS workspace, so memory grew with every ``generate`` (found at B16 P4k as
    peak memory above StaticCache's). After the first call, further calls allocate nothing that stays."""
    from hshare.graphs import side_stream

    model = tiny_llama(kv_heads=2, layers=4).cuda()
    ids, mask = _batch([60, 44, 51, 37])
    allocated = []
    for _ in range(4):
        _, cache = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True, new_tokens=12, **SPARSE)
        assert cache.static_decode.reason == ""
        del cache
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[1] == allocated[2] == allocated[3], allocated
    assert side_stream(torch.device("cuda")) is side_stream(torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.parametrize("preset", ["dense", "hshare-1_2-1_2-1_2", "quest"])
def test_warm_generate_captures_without_eager_steps(preset):
    """A second generate of the same shapes (other prompts) captures each kind and replays it at once: no eager
    warm-up step (`static_decode.warm_signature`), the tokens of eager decode. Other shapes warm up again."""
    model = tiny_llama(kv_heads=2, layers=4).cuda()
    overrides = dict(SPARSE) if preset != "dense" else dict(prefix="off", **UNFUSED)
    first_ids, first_mask = _batch([60, 44, 51, 37])
    _, cold = _run(model, preset, first_ids, first_mask, static=True, new_tokens=12, **overrides)
    assert cold.static_decode.eager_steps == len(cold.static_decode.replays) > 0
    ids, mask = _batch([58, 60, 41, 49])
    ids[:, -5:] = torch.randint(3, VOCAB, (4, 5), device="cuda")  # other prompts, the same shapes
    eager, _ = _run(model, preset, ids, mask, static=False, new_tokens=12, **overrides)
    graphed, warm = _run(model, preset, ids, mask, static=True, new_tokens=12, **overrides)
    report = warm.static_decode
    assert report.reason == "" and report.eager_steps == 0 and report.eager_seconds == 0.0
    assert report.graphed_steps == 11 and set(report.capture_seconds) == set(report.replays)
    assert torch.equal(graphed, eager)
    ours, theirs = warm.stats, _run(model, preset, ids, mask, static=False, new_tokens=12, **overrides)[1].stats
    assert (ours.kv_rows_read, ours.sparse_steps, ours.score_computations) == \
        (theirs.kv_rows_read, theirs.sparse_steps, theirs.score_computations)
    longer_ids, longer_mask = _batch([70, 44, 51, 37])
    _, other = _run(model, preset, longer_ids, longer_mask, static=True, new_tokens=12, **overrides)
    assert other.static_decode.eager_steps == len(other.static_decode.replays)


def test_failed_warm_capture_runs_the_step_eagerly(monkeypatch):
    """A warm capture that fails (here: the forward refuses the first capture) runs the step eagerly and
    captures again: same tokens as eager decode, graphs kept."""
    model = tiny_llama(kv_heads=2, layers=4).cuda()
    ids, mask = _batch([60, 44, 51, 37])
    _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True, new_tokens=12, **SPARSE)  # warms every kind
    eager, _ = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=False, new_tokens=12, **SPARSE)
    original, refused = static_decode.StaticDecoder._step, []

    def refuse_first_capture(self):
        if torch.cuda.is_current_stream_capturing() and not refused:
            refused.append(True)
            raise RuntimeError("refused")
        return original(self)

    monkeypatch.setattr(static_decode.StaticDecoder, "_step", refuse_first_capture)
    graphed, cache = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True, new_tokens=12, **SPARSE)
    assert refused and cache.static_decode.reason == ""
    assert cache.static_decode.eager_steps == 1 and cache.static_decode.graphed_steps == 10
    assert torch.equal(graphed, eager)


def test_patched_generate_leaves_no_cublas_workspace():
    """Warm-up and capture drop cuBLAS's per-stream workspaces (`hshare.graphs.fresh_cublas_workspaces`):
    after a patched generate and its cache are gone, no more memory is allocated than before it (a side
    stream's workspace would stay: 32 MiB on Hopper, the peak excess over StaticCache of session 10)."""
    model = tiny_llama(kv_heads=2, layers=4).cuda()
    ids, mask = _batch([60, 44, 51, 37])
    _generate(model, ids, mask, new_tokens=4)  # the default stream's workspace, as any unpatched run has it
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for preset in ("dense", "hshare-1_2-1_2-1_2"):
        _, cache = _run(model, preset, ids, mask, static=True, new_tokens=12, **SPARSE)
        assert cache.static_decode.reason == ""
        del cache
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= before, preset
