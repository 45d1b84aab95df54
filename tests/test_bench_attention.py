"""``hshare bench attention`` times the library's own decode step: its harness (`AttentionProbes`
driven by `ProbeGeneration`, eager and through the static decoder) attends exactly, its rows and
table say what was measured."""

from __future__ import annotations

import json

import pytest
import torch

from hshare.bench import attention
from hshare.config import HShareConfig

BATCH, Q_HEADS, KV_HEADS, CONTEXT, HEAD_DIM, LAYERS = 2, 4, 2, 40, 16, 2
STEPS = 4


@pytest.fixture(scope="module")
def probes():
    return attention.AttentionProbes(BATCH, Q_HEADS, KV_HEADS, CONTEXT, HEAD_DIM, LAYERS, torch.float32, "cpu")


def _decode(probes, config, static: bool) -> tuple[list[torch.Tensor], attention.ProbeGeneration]:
    """Every step's output ``[B, 1, L, Hq, d]`` of one generation of `config`, eager or static shapes."""
    generation = attention.ProbeGeneration(probes, config, STEPS, static)
    return [generation.step(inputs).clone() for inputs in probes.decode_inputs(STEPS)], generation


def _exact_attention(probes, layer: int, step: int) -> torch.Tensor:
    """Softmax attention of decode step `step`'s query of `layer` over the prompt's keys and every decode
    key so far, brute force in float64: ``[B, Hq, d]``."""
    tokens = [inputs["input_ids"][:, 0] for inputs in probes.decode_inputs(step + 1)]
    _, keys, values = probes.prompt(layer)
    keys = torch.cat([keys] + [probes.decode_keys[layer][t][:, :, None] for t in tokens], 2).double()
    values = torch.cat([values] + [probes.decode_values[layer][t][:, :, None] for t in tokens], 2).double()
    group = Q_HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    query = probes.decode_queries[layer][tokens[-1]].double()
    weights = (torch.einsum("bhd,bhnd->bhn", query, keys) * HEAD_DIM ** -0.5).softmax(-1)
    return torch.einsum("bhn,bhnd->bhd", weights, values)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_dense_preset_is_exact_attention(probes, static):
    config = attention.preset_config("dense", CONTEXT, HEAD_DIM, LAYERS)
    outputs, generation = _decode(probes, config, static)
    assert generation.kinds == ["dense"] * STEPS
    if static:  # the static decoder's buffers, every step run without graphs (CPU)
        assert generation.cache.static is not None and generation.report.eager_steps == STEPS
    else:
        assert generation.cache.static is None and generation.report is None
    for step, out in enumerate(outputs):
        assert out.shape == (BATCH, 1, LAYERS, Q_HEADS, HEAD_DIM)
        for layer in range(LAYERS):
            torch.testing.assert_close(out[:, 0, layer].double(), _exact_attention(probes, layer, step),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_sparse_preset_with_a_budget_covering_the_context_equals_dense(probes, static):
    """N_c covers every column: selection, reuse and (static shapes) gather over the critical indices
    attend to every key, as the dense preset does."""
    dense, _ = _decode(probes, attention.preset_config("dense", CONTEXT, HEAD_DIM, LAYERS), static)
    config = attention.preset_config("hshare-1_2-1_2-1_2", CONTEXT + STEPS, HEAD_DIM, LAYERS)
    sparse, generation = _decode(probes, config, static)
    assert generation.kinds == ["select", "reuse"] * (STEPS // 2)
    for ours, theirs in zip(sparse, dense):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_measure_preset_times_whole_sharing_cycles_and_counts_the_work(probes):
    """A query group of two steps: every timed cycle selects once and reuses once; N_c = 16 of 40+ keys
    reads a fraction of dense attention's keys; no graphs off CUDA, and the row says so."""
    config = attention.preset_config("hshare-1_2-1_2-1_2", 16, HEAD_DIM, LAYERS)
    timing = attention.measure_preset(probes, config, cycles=2)
    assert timing.kinds == {"select": 2, "reuse": 2} and timing.step_us > 0
    assert timing.step_graph_us is None and timing.graph_note == "no CUDA"
    assert timing.stats["decode_steps"] == 4 and timing.stats["selection_steps"] == 2
    assert 0 < timing.stats["kv_rows_read"] < timing.stats["dense_kv_rows"]


def test_smoke_rows_and_table(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "SMOKE_ATTENTION_SHAPES", [(2, 4, 2, 64), (1, 2, 2, 48)])
    results = attention.main_attention(tmp_path, smoke=True, layers=2)
    rows = json.loads((tmp_path / "bench_attention.json").read_text())["attention"]
    assert rows == results["attention"]
    assert [(r["shape"], r["preset"]) for r in rows] == [
        (shape, preset) for shape in ("B2 4/2 n64 N_c8", "B1 2/2 n48 N_c6") for preset in attention.PRESETS]
    for r in rows:
        dense = r["preset"] == attention.DENSE_PRESET
        assert r["path"] == ("dense" if dense else "sparse") and r["step_us"] > 0 and r["speedup_sdpa"] > 0
        assert r["speedup"] == 1.0 if dense else r["speedup"] > 0
        assert r["step_graph_us"] is None and r["speedup_graph"] is None and r["graph_note"] == "no CUDA"
        assert r["kv_read_fraction"] == 1.0 if dense else r["kv_read_fraction"] < 1.0
        assert r["stats"]["decode_steps"] == 2 * HShareConfig.from_preset(r["preset"]).sharing.query_group

    lines = attention.table_lines([attention.AttentionRow(**r) for r in rows])
    assert len(lines) == 1 + len(rows)
    assert lines[0].split() == ["shape", "KV", "MiB", "SDPA", "backend", "preset", "path", "eager", "vs", "dense",
                                "vs", "SDPA", "graph", "vs", "dense", "vs", "SDPA", "KV", "read"]
    first = lines[1].split()
    assert first[:4] == ["B2", "4/2", "n64", "N_c8"] and first[7:9] == ["dense", "dense"]
    assert first[-4:] == ["-", "-", "-", "1.000"] and first[10] == "1.00x"
    assert all(len(line) == len(lines[1]) for line in lines[1:])
