"""The benchmarks run end to end (tiny shapes on the CPU) and write what they promise."""

import json

import pytest

from hshare import cli
from hshare.bench import attention, generate, plot, prefix


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    attention_results = attention.main_attention(tmp_path, smoke=True)
    prefix_results = prefix.main_prefix(tmp_path, smoke=True)
    saved = json.loads((tmp_path / "bench_attention.json").read_text())
    assert saved["attention"] == attention_results["attention"]
    assert {r["preset"] for r in saved["attention"]} == set(attention.PRESETS)
    assert all(r["step_us"] > 0 and r["speedup"] > 0 for r in saved["attention"])
    rows = json.loads((tmp_path / "bench_prefix.json").read_text())["prefix"]
    assert all(r["max_abs_err"] < 1e-4 for r in rows) and len(rows) == len(prefix.SMOKE_PREFIX_SHAPES)
    memory = prefix_results["memory"]
    assert memory["prefix_tokens"] == 159 and memory["ratio"] > 1.5


def test_bench_generate_smoke_plot(tmp_path):
    """``hshare bench generate --smoke`` writes its JSON and PNG; ``hshare bench plot`` draws the PNG again,
    relative to ``static``, and relative to the first path when ``static`` failed."""
    pytest.importorskip("matplotlib")
    assert cli.main(["bench", "generate", "--smoke", "--out", str(tmp_path), "--paths", "unpatched,static,dense"]) == 0
    path = tmp_path / "bench_generate_tiny_b2_p40.json"
    results = json.loads(path.read_text())
    assert set(results) == {"env", "overrides", "generate"}
    assert [r["path"] for r in results["generate"]] == ["unpatched", "static", "dense"]
    assert all(not r["error"] and r["decode_tok_s"] > 0 for r in results["generate"])
    png = path.with_suffix(".png")
    assert png.stat().st_size > 0
    png.unlink()
    assert cli.main(["bench", "plot", str(path)]) == 0 and png.stat().st_size > 0
    speed = generate.figure(results).axes[0]
    assert speed.get_ylabel() == "decode tok/s relative to static" and len(speed.patches) == 3

    results["generate"][1].update(decode_tok_s=0.0, error="out of memory: CUDA out of memory")
    failed = tmp_path / "static_failed.json"
    failed.write_text(json.dumps(results))
    assert plot(failed).stat().st_size > 0
    assert generate.figure(results).axes[0].get_ylabel() == "decode tok/s relative to unpatched"


def test_bench_generate_repeats_report_the_median_pair(tmp_path):
    """``--repeats 3``: three timed pairs per path, every pair's rate kept, the row's rate the median one."""
    assert cli.main(["bench", "generate", "--smoke", "--out", str(tmp_path), "--paths", "dense,ds@512",
                     "--repeats", "3"]) == 0
    rows = json.loads((tmp_path / "bench_generate_tiny_b2_p40.json").read_text())["generate"]
    for row in rows:
        runs = row["decode_tok_s_runs"]
        assert len(runs) == 3 and all(rate > 0 for rate in runs)
        assert row["decode_tok_s"] == sorted(runs)[1]
    with pytest.raises(ValueError, match="repeats=0"):
        generate.measure_path(None, "dense", None, None, 4, "tiny", False, repeats=0)
