"""The benchmarks run end to end (tiny shapes on the CPU) and write what they promise."""

import json

import pytest

from hshare import bench


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    attention = bench.main_attention(tmp_path, smoke=True)
    prefix = bench.main_prefix(tmp_path, smoke=True)
    saved = json.loads((tmp_path / "bench_attention.json").read_text())
    assert saved["attention"] == attention["attention"]
    assert {r["preset"] for r in saved["attention"]} == set(bench.PRESETS)
    assert all(r["step_us"] > 0 and r["speedup"] > 0 for r in saved["attention"])
    rows = json.loads((tmp_path / "bench_prefix.json").read_text())["prefix"]
    assert all(r["max_abs_err"] < 1e-4 for r in rows) and len(rows) == len(bench.SMOKE_PREFIX_SHAPES)
    memory = prefix["memory"]
    assert memory["prefix_tokens"] == 159 and memory["ratio"] > 1.5
