"""The benchmarks run end to end (tiny shapes on the CPU) and write what they promise."""

import dataclasses
import json

import pytest
import torch

from hshare import cli
from hshare.bench import attention, generate, grid, plot, prefix, roofline
from hshare.bench.generate import GenerateRow
from hshare.config import HShareConfig
from hshare.planner import sources_for_ratio


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
    """``--repeats 3``: three timed pairs per path, every pair's rate kept, the row's rate the median one; with
    ``--rounds 2`` each path is measured again after the others, its row keeping both rounds' pairs."""
    assert cli.main(["bench", "generate", "--smoke", "--out", str(tmp_path), "--paths", "dense,ds@512",
                     "--repeats", "3"]) == 0
    rows = json.loads((tmp_path / "bench_generate_tiny_b2_p40.json").read_text())["generate"]
    for row in rows:
        runs = row["decode_tok_s_runs"]
        assert len(runs) == 3 and all(rate > 0 for rate in runs)
        assert row["decode_tok_s"] == sorted(runs)[1]
    assert cli.main(["bench", "generate", "--smoke", "--out", str(tmp_path), "--paths", "dense,ds@512",
                     "--repeats", "2", "--rounds", "2"]) == 0
    rows = json.loads((tmp_path / "bench_generate_tiny_b2_p40.json").read_text())["generate"]
    assert [len(row["decode_tok_s_runs"]) for row in rows] == [4, 4]
    assert all(row["decode_tok_s"] == sorted(row["decode_tok_s_runs"])[1] for row in rows)
    with pytest.raises(ValueError, match="repeats=0"):
        generate.measure_path(None, "dense", None, None, 4, "tiny", False, repeats=0)
    with pytest.raises(ValueError, match="timing='median'; accepted: pairs, steps"):
        generate.measure_path(None, "dense", None, None, 4, "tiny", False, timing="median")
    with pytest.raises(ValueError, match="new_tokens=2 with timing 'steps'; accepted: at least 3"):
        generate.measure_path(None, "dense", None, None, 2, "tiny", False, timing="steps")


# ---- long context: shapes, prompts, paths with overrides, the roofline, the grid ----


def test_llama3_1_shape_scales_rope_and_raises_positions_to_fit():
    _, config = generate.model_config("llama3.1-8b", None, 131072 + 136)
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 8.0
    assert config.max_position_embeddings == 131072 + 136  # raised to fit the prompt and the new tokens
    assert generate.model_config("llama3.1-8b", None, 4096)[1].max_position_embeddings == 131072  # the published
    assert generate.model_config("llama3-8b", 2, 40000)[1].num_hidden_layers == 2
    with pytest.raises(ValueError, match="unknown shape 'llama4'; accepted: llama2-7b"):
        generate.model_config("llama4", None, 10)


def test_prompts_pad_one_row_in_four_but_never_a_single_row():
    ids, mask = generate.make_prompts(100, 5, 64, shared=False, padded=True)
    assert [bool(mask[row].all()) for row in range(5)] == [False, True, True, True, False]
    assert torch.equal(ids, generate.make_prompts(100, 5, 64, shared=False, padded=True)[0])  # the same prompts
    assert bool(generate.make_prompts(100, 1, 64, shared=False, padded=True)[1].all())
    assert bool(generate.make_prompts(100, 5, 64, shared=False, padded=False)[1].all())


def test_a_single_row_prompt_builds_no_quadratic_mask():
    """A left-padded row makes transformers build the 4-D bool mask ``[B, 1, n, n]`` (and SDPA a float copy
    of it in every layer: at a 128k-token prompt in bf16, 16 GiB and 32 GiB), on every path alike; the
    bench never pads a batch of one row, whose prefill then allocates nothing quadratic in the prompt."""
    import hshare
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    self.numel = max(self.numel, tensor.numel())
            return out

    prompt = 256
    model = generate.build_model("tiny", None, "cpu", torch.float32, prompt + 8)
    for batch, quadratic in ((1, False), (2, True)):
        ids, mask = generate.make_prompts(model.config.vocab_size, batch, prompt, shared=False, padded=True)
        with hshare.patched(model, "dense", prefix="off"), torch.no_grad(), LargestOutput() as largest:
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert (largest.numel >= batch * prompt * prompt) == quadratic, (batch, largest.numel)


def test_path_overrides_after_plus():
    from hshare.config import split_overrides

    assert split_overrides("ds@1024+dense_fallback_mib=0+group_lookahead=true") == (
        "ds@1024", {"dense_fallback_mib": 0, "group_lookahead": True})
    assert split_overrides("dense") == ("dense", {})
    with pytest.raises(ValueError, match="override 'sink' is not FIELD=VALUE; accepted: PRESET"):
        split_overrides("ds+sink")


def test_decode_step_bytes_by_hand():
    """Llama-3-8B shape (32 layers, 8 KV heads of 128, bf16: one token's K and V in a layer 4096 B), B4 at a
    32768-token context, weights 15e9 B:
    dense:  4 x 32768 x 32 x 4096 = 17,179,869,184 B of KV.
    1/2-1/2-1/2 at N_c 1024 (per KV head): scorings 16 layers x 4 heads / 2 steps = 32 per row and step;
    per row 1024 x 32 x 4096 (critical K, V) + 32768 x 32 x 12 (4-bit labels of 16 channels + bf16 scale and
    zero) = 134,217,728 + 12,582,912 = 146,800,640 B; x 4 rows = 587,202,560 B."""
    weights, kv_token = 15e9, 4096
    assert roofline.decode_step_bytes(weights, 4, 32768, 32, kv_token) == weights + 17_179_869_184
    config = HShareConfig.from_preset("hshare-1_2-1_2-1_2")
    assert roofline.scorings_per_step(config, 32, 8) == 32
    assert roofline.scorings_per_step(HShareConfig.from_preset("ds"), 32, 8) == 256
    assert roofline.scorings_per_step(HShareConfig.from_preset("streaming"), 32, 8) == 0
    sparse = roofline.SparseReads(sparse_layers=32, budget=1024, critical_token_bytes=4096, scorings=32,
                                  metadata_token_bytes=12)
    assert roofline.decode_step_bytes(weights, 4, 32768, 32, kv_token, sparse) == weights + 587_202_560
    half = roofline.SparseReads(32, 1024, 4096, 32, 12, sparse_share=0.5)  # half the steps fell back to dense
    assert roofline.decode_step_bytes(weights, 4, 32768, 32, kv_token, half) == \
        weights + 0.5 * 587_202_560 + 0.5 * 17_179_869_184
    # two dense layers read every key; a context within the budget reads all of it
    two_dense = roofline.SparseReads(30, 1024, 4096, 32, 12)
    assert roofline.decode_step_bytes(0, 1, 32768, 32, kv_token, two_dense) == \
        1024 * 30 * 4096 + 32768 * 2 * 4096 + 32768 * 32 * 12
    assert roofline.decode_step_bytes(0, 1, 512, 32, kv_token, sparse) == 512 * 32 * 4096 + 512 * 32 * 12
    assert roofline.floor_rate(4, 3e10, 3e12) == 400.0


def test_sparse_reads_of_a_generate_and_weight_bytes():
    """The metadata's bytes per token and head come from what the cache held; the sparse share from the steps."""
    _, config = generate.model_config("tiny", None, 64)  # 2 layers, 4 query / 2 KV heads of 16
    stats = type("Stats", (), {"decode_steps": 8, "dense_fallback_steps": 2})()
    preset = HShareConfig.from_preset("hshare-1_2-1_2-1_2@64").replace(dense_layers=(1,))
    reads = roofline.sparse_reads(preset, config, 4, stats, metadata_bytes=3 * 50 * 1 * 2 * 12, rows=3, columns=50)
    assert reads == roofline.SparseReads(sparse_layers=1, budget=64, critical_token_bytes=2 * 2 * 16 * 4,
                                         scorings=0.5, metadata_token_bytes=12.0, sparse_share=0.75)
    model = generate.build_model("tiny", None, "cpu", torch.float32, 64)
    total = sum(p.numel() for p in model.parameters()) * 4
    assert roofline.weight_bytes_read(model, 3) == total - 256 * 64 * 4 + 3 * 64 * 4  # 3 embedding rows read
    model.tie_weights = None
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: the output projection reads the table whole
    assert roofline.weight_bytes_read(model, 3) == sum(p.numel() for p in model.parameters()) * 4


def test_peak_estimate_covers_measured_peaks_and_skips_what_cannot_fit():
    """The estimate lands above each measured peak (the `measured` GiB below, from `hshare bench generate` on an
    H100) by under 2 GiB. A padded B1 x 128k prefill needs its quadratic mask."""
    for shape, batch, prompt, new, measured in (("llama2-7b", 16, 4096, 256, 52.9), ("llama3-8b", 4, 32768, 128, 50.2)):
        model_class, config = generate.model_config(shape, None, prompt + new + 8)
        weights = roofline.parameter_bytes(model_class, config, torch.bfloat16)
        estimate = roofline.estimated_peak_bytes(config, weights, 2, batch, prompt, new, True, False) / 2**30
        assert measured < estimate < measured + 2, (shape, estimate)
    model_class, config = generate.model_config("llama3.1-8b", None, 131072 + 136)
    args = (config, roofline.parameter_bytes(model_class, config, torch.bfloat16), 2, "dense", 1, 131072, 128)
    assert generate.skip_reason(*args, False, 78 * 2**30) == ""
    assert generate.skip_reason(*args, True, 78 * 2**30).startswith("skipped: needs 8")
    assert generate.skip_reason(*args, True, 78 * 2**30).endswith(" GiB of 78.0 GiB")
    assert generate.skip_reason(*args, True, None) == ""  # no memory given: nothing skipped


def test_grid_axes_and_cells():
    assert grid.parse_axis("1k,4k, 128k,4096") == [1024, 4096, 131072]
    assert grid.parse_tokens("64") == 64
    for bad in ("4m", "0", "k", ""):
        with pytest.raises(ValueError, match="is not a token count; accepted: a positive integer"):
            grid.parse_tokens(bad)
    assert grid.grid_cells([1, 4], [4096, 1024]) == [(1, 1024), (4, 1024), (1, 4096), (4, 4096)]  # by rows x prompt
    with pytest.raises(SystemExit, match="--shapes: unknown llama9; accepted: llama2-7b"):
        grid.main(["--shapes", "llama9"])
    with pytest.raises(SystemExit, match="override 'heavy' is not FIELD=VALUE"):
        grid.main(["--paths", "dense,hshare-1_2-1_2-1_2@512+heavy"])


def test_grid_smoke_runs_paths_with_overrides(tmp_path):
    """``python -m hshare.bench.grid --smoke`` runs every cell of a preset with options after '+' and writes its
    JSON (the tiny shape on the CPU)."""
    paths = "dense,hshare-1_2-1_2-1_2@16+dense_fallback_mib=0"
    assert grid.main(["--smoke", "--out", str(tmp_path), "--paths", paths, "--name", "smoke"]) == 0
    rows = json.loads((tmp_path / "smoke.json").read_text())["generate"]
    assert sorted({(row["path"], row["batch"], row["prompt"]) for row in rows}) == sorted(
        (path, batch, prompt) for path in paths.split(",") for batch in (1, 2) for prompt in (40, 80))
    assert all(not row["error"] and row["decode_tok_s"] > 0 for row in rows)


def test_rounds_alternate_the_order_and_keep_every_run(monkeypatch, capsys):
    """``rounds=3``: the paths measured A B, B A, A B in one process (``static`` once); each row keeps its three
    rounds' runs and their median; a path that fails in a later round keeps its rounds and says so; a path given
    twice is refused (one row is kept per path)."""
    calls = []
    rates = {"dense": iter([5.0, 1.0, 3.0]), "ds@16": iter([2.0, 4.0, 6.0]), "unpatched": iter([7.0, 8.0])}

    def measure(model, path, ids, mask, new_tokens, *args, **kwargs):
        calls.append(path)
        rate = next(rates[path], None)
        if rate is None:
            raise RuntimeError("broke")
        row = generate.failed_row("tiny", path, ids.shape[0], ids.shape[1], new_tokens, False, "")
        return dataclasses.replace(row, decode_tok_s=rate, decode_tok_s_runs=[rate], peak_gib=rate), \
            torch.zeros(ids.shape[0], new_tokens, dtype=torch.long)

    monkeypatch.setattr(generate, "measure_path", measure)
    rows = generate.bench_cells("tiny", [(2, 40)], 4, ("dense", "ds@16", "unpatched"), device="cpu",
                                dtype=torch.float32, rounds=3, static_process=False)
    assert calls == ["dense", "ds@16", "unpatched", "unpatched", "ds@16", "dense", "dense", "ds@16", "unpatched"]
    by_path = {row.path: row for row in rows}
    assert [row.path for row in rows] == ["dense", "ds@16", "unpatched"]
    assert by_path["dense"].decode_tok_s_runs == [5.0, 1.0, 3.0] and by_path["dense"].decode_tok_s == 3.0
    assert by_path["ds@16"].decode_tok_s == 4.0 and by_path["ds@16"].peak_gib == 6.0 and not by_path["ds@16"].error
    assert by_path["unpatched"].decode_tok_s_runs == [7.0, 8.0] and by_path["unpatched"].decode_tok_s == 7.0
    assert by_path["unpatched"].error == "round failed: RuntimeError: broke"
    assert generate._turns(["a", "b", "static"], 3) == ["a", "b", "static", "b", "a", "a", "b"]
    with pytest.raises(ValueError, match="paths dense given more than once; accepted: each path once"):
        generate.bench_cells("tiny", [(2, 40)], 4, ("dense", "ds@16", "dense"), device="cpu")
    with pytest.raises(ValueError, match="rounds=0; accepted: at least 1"):
        generate.bench_cells("tiny", [(2, 40)], 4, ("dense",), device="cpu", rounds=0)
    with pytest.raises(SystemExit, match="paths dense given more than once"):
        grid.main(["--smoke", "--paths", "dense,dense"])
    with pytest.raises(SystemExit, match="paths dense given more than once"):
        cli.main(["bench", "generate", "--smoke", "--paths", "dense,dense"])
    for main, args in ((cli.main, ["bench", "generate", "--smoke"]), (grid.main, ["--smoke"])):
        for rounds in ("0", "two"):
            with pytest.raises(SystemExit):
                main([*args, "--paths", "dense", "--rounds", rounds])
            assert f"argument --rounds: {rounds}; accepted: an integer, at least 1" in capsys.readouterr().err


def _row(path: str, batch: int, prompt: int, rate: float, peak: float = 20.0, error: str = "") -> GenerateRow:
    return GenerateRow("llama3-8b", path, batch, prompt, 32, False, 1.0, rate, 0.0, peak, 1.0, None, error=error,
                       step_gb=20.0, floor_tok_s=100.0 * batch, floor_share=rate / (100.0 * batch))


def test_grid_tables():
    """The crossover table: dense, each sparse path's rate and ratio, what its default would run and whether
    that is the faster; the rows table: ratios to static, the roofline, peaks above static's marked."""
    _, config = generate.model_config("llama3-8b", None, 131072)  # per layer and token: 4 KiB of K and V
    sparse = "hshare-1_2-1_2-1_2@512+dense_fallback_mib=0"
    rows = [_row("dense", 1, 1024, 100.0), _row(sparse, 1, 1024, 80.0),       # 4 MiB a layer: default dense
            _row("dense", 4, 131072, 40.0), _row(sparse, 4, 131072, 30.0),   # 2 GiB a layer: default sparse
            _row("dense", 64, 4096, 0.0, error="skipped: needs 80.8 GiB of 78.5 GiB"),
            _row(sparse, 64, 4096, 0.0, error="skipped: needs 80.8 GiB of 78.5 GiB")]
    cuda = torch.device("cuda")
    lines = grid.crossover_table(rows, {"llama3-8b": config}, 2, cuda)
    assert lines[0] == f"| shape | B | prompt | KV/layer MiB | dense tok/s | {sparse} tok/s | x dense | default runs |"
    assert lines[2] == "| llama3-8b | 1 | 1024 | 4 | 100.0 | 80.0 | 0.80x | dense (right) |"
    assert lines[3] == "| llama3-8b | 4 | 131072 | 2048 | 40.0 | 30.0 | 0.75x | sparse (wrong) |"
    assert lines[4] == "| llama3-8b | 64 | 4096 | 1024 | skipped | skipped | - | sparse |"
    # within 5% of the faster path is right; a path that follows its default (no forced sparse) gets no verdict
    default = "hshare-1_2-1_2-1_2@512"
    near = [_row("dense", 4, 131072, 40.0), _row(sparse, 4, 131072, 38.5), _row(default, 4, 131072, 38.4),
            _row("dense", 1, 1024, 100.0), _row(sparse, 1, 1024, 104.0), _row(default, 1, 1024, 99.0)]
    lines = grid.crossover_table(near, {"llama3-8b": config}, 2, cuda)
    assert lines[2].endswith("| 38.5 | 0.96x | sparse (right) | 38.4 | 0.96x | sparse |")
    assert lines[3].endswith("| 104.0 | 1.04x | dense (right) | 99.0 | 0.99x | dense |")
    near[4] = _row(sparse, 1, 1024, 106.0)
    assert grid.crossover_table(near, {"llama3-8b": config}, 2, cuda)[3].endswith("| 1.06x | dense (wrong) | 99.0 | 0.99x | dense |")
    # 96 MiB saved (graphs) crossed between the first step and the last: 1 x (25070 + 1 .. 25070 + 31 - 512) x 4 KiB
    assert grid.default_runs(sparse, config, 1, 25070, 32, 2, cuda) == "mixed"
    assert grid.default_runs("dense", config, 1, 1024, 32, 2, cuda) == "-"
    # a policy's selection term moves its crossover: Quest's cells of the measured grid (4 KiB a token and layer)
    assert grid.default_runs("quest@1024", config, 1, 32768, 32, 2, cuda) == "dense"  # 124 MiB < 96 + 96
    assert grid.default_runs("quest@1024", config, 4, 16384, 32, 2, cuda) == "sparse"  # 240 MiB
    assert grid.default_runs("hshare-1_2-1_2-1_2@1024", config, 1, 32768, 32, 2, cuda) == "sparse"
    assert grid.default_runs("loki@1024", config, 4, 16384, 32, 2, cuda) == "dense"  # 240 MiB < 96 + 288
    assert grid.default_runs("loki@1024", config, 4, 32768, 32, 2, cuda) == "sparse"  # 496 MiB
    assert grid.default_runs("loki@1024", config, 1, 131072, 32, 2, cuda) == "sparse"  # 508 MiB
    assert grid.crossover_table([r for r in rows if r.path == "dense"], {"llama3-8b": config}, 2, cuda) == []
    table = grid.rows_table([_row("static", 4, 32768, 60.0, peak=50.0), _row("dense", 4, 32768, 285.0, peak=50.1)])
    assert table[2] == "| llama3-8b | 4 | 32768 | static | 60.0 | 1.00x static | 20.0 | 400 | 15% | 50.00 | 1.00 |"
    assert table[3] == "| llama3-8b | 4 | 32768 | dense | 285.0 | 4.75x static | 20.0 | 400 | 71% | 50.10! | 1.00 |"


def test_grid_runs_and_writes(tmp_path):
    """A grid on the tiny model: rows timed per step with their roofline, a shape over the memory given
    skipped with what it needs, the JSON and the Markdown tables written."""
    sparse = "hshare-1_2-1_2-1_2@32+dense_fallback_mib=0"
    results = grid.run_grid(tmp_path, ["tiny"], [2], [48], ["dense", sparse], 5, device="cpu", dtype=torch.float32,
                            free_bytes=2 * 2**30)
    rows = {r["path"]: r for r in results["generate"]}
    assert list(rows) == ["dense", sparse]
    for row in rows.values():
        assert not row["error"] and row["timing"] == "steps" and row["decode_tok_s"] > 0
        assert row["step_gb"] > 0 and row["floor_tok_s"] > 0 and row["floor_share"] > 0 and row["bandwidth_gb_s"] > 0
        assert len(row["decode_tok_s_runs"]) == 1
    assert rows[sparse]["decode_steps"]["sparse"] == 4 and rows[sparse]["agreement"] is None
    # full-context scorings: ds would score every (row, layer, KV head) at each of the 4 steps; 1/2-1/2-1/2 an eighth
    tiny = generate.model_config("tiny", None, 64)[1]
    every = 2 * 4 * tiny.num_hidden_layers * tiny.num_key_value_heads
    assert rows[sparse]["decode_steps"]["score_computations"] == every // 8
    assert rows[sparse]["decode_steps"]["refinements"] == 0 and "score_computations" not in rows["dense"]["decode_steps"]
    # its plan: half the sparse layers and half the KV heads of each selecting layer select
    dense_layers = generate.path_config(sparse).sharing.dense_layers
    layers = len([i for i in range(tiny.num_hidden_layers) if i not in dense_layers])
    heads = tiny.num_key_value_heads
    selecting = sources_for_ratio(0.5, layers)
    assert rows[sparse]["decode_steps"]["plan"] == pytest.approx({
        "layer_copies": layers - selecting, "head_copies": selecting * (heads - sources_for_ratio(0.5, heads)),
        "selecting": selecting * sources_for_ratio(0.5, heads) / (layers * heads)})
    assert rows[sparse]["step_gb"] < rows["dense"]["step_gb"]  # N_c 32 of 48 + 1..4 columns, labels besides
    assert json.loads((tmp_path / "bench_grid.json").read_text())["generate"] == results["generate"]
    tables = (tmp_path / "bench_grid.md").read_text()
    assert "crossover (5 new tokens, timing steps;" in tables
    assert f"| tiny | 2 | 48 | 0.02344 | {rows['dense']['decode_tok_s']:.1f} |" in tables  # 2 x 48 x 512 B of fp32 K, V
    skipped = grid.run_grid(tmp_path, ["tiny"], [2], [48], ["dense"], 5, device="cpu", dtype=torch.float32,
                            free_bytes=1024, name="too_small")
    assert skipped["generate"][0]["error"].startswith("skipped: needs 1.0 GiB of 0.0 GiB")


@pytest.mark.slow
def test_static_runs_in_a_process_of_its_own():
    """``static`` measured in a spawned process that builds the same model: its tokens agree with unpatched."""
    rows = generate.bench_cells("tiny", [(2, 40)], 4, ("unpatched", "static", "dense"), device="cpu",
                                dtype=torch.float32, static_process=True, timing="steps")
    assert [r.path for r in rows] == ["unpatched", "static", "dense"]
    assert all(not r.error and r.decode_tok_s > 0 for r in rows)
    assert rows[1].agreement == 1.0 and rows[2].agreement == 1.0


def test_peak_sites_replays_frees_as_requested_or_completed():
    """`benchmarks/peak_memory.py`'s replay, by hand: a block used on another stream is released (free_requested)
    before the allocator takes it back (free_completed); its statistics count it until then."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "peak_memory", Path(__file__).resolve().parents[1] / "benchmarks" / "peak_memory.py")
    peak_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peak_memory)
    ours = [{"filename": "/site-packages/hshare/cache.py", "line": 7, "name": "claim"}]
    theirs = [{"filename": "/site-packages/torch/nn/functional.py", "line": 3, "name": "linear"}]
    trace = [dict(action="alloc", addr=1, size=10, frames=ours), dict(action="alloc", addr=2, size=5, frames=theirs),
             dict(action="free_requested", addr=1, size=10), dict(action="alloc", addr=3, size=7, frames=theirs),
             dict(action="free_completed", addr=1, size=10), dict(action="free_requested", addr=2, size=5),
             dict(action="free_completed", addr=2, size=5)]
    best, sites, live = peak_memory.peak_sites(trace)
    assert best == 15 and sites == {"hshare/cache.py:7 claim": 10, "functional.py:3 linear": 5}
    assert live == {1: 10, 2: 5}
    best, sites, live = peak_memory.peak_sites(trace, "free_completed")
    assert best == 22 and sites == {"hshare/cache.py:7 claim": 10, "functional.py:3 linear": 12}
    assert live == {1: 10, 2: 5, 3: 7}
    # after the call: block 1 still allocated in a 2 MiB segment's unsplit block (its remainder under 1 MiB),
    # block 2 freed, block 3's address reused by another request; the rest of the peak's blocks: 512-byte rounding
    segments = [{"blocks": [dict(address=1, size=2 << 20, requested_size=10, state="active_allocated"),
                            dict(address=3, size=1024, requested_size=1000, state="active_allocated"),
                            dict(address=2, size=512, requested_size=0, state="inactive")]}]
    assert peak_memory.allocator_slack(live, segments) == ((2 << 20) - 10, 1, (512 - 5) + (512 - 7))
    assert [peak_memory.block_bytes(n) for n in (1, 512, 513, 3 << 20)] == [512, 512, 1024, 3 << 20]


def test_profile_decode_counts_a_steps_launches_and_keeps_its_last_step_in_order():
    """`benchmarks/profile_decode.py` on the CPU (its smoke path: CPU ops for kernels): the launches a step of
    each op are the difference of two generates over the steps between them, whole numbers for a step that
    repeats, and the sequence is the longer generate's last that many ops, in the order they ran."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "profile_decode", Path(__file__).resolve().parents[1] / "benchmarks" / "profile_decode.py")
    profile_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_decode)
    model = generate.build_model("tiny", None, "cpu", torch.float32, 64)
    ids = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    per_step, launches, sequence = profile_decode.step_kernels(model, "dense", ids, torch.ones_like(ids), 3, False)
    total = sum(launches.values())
    assert total > 0 and all(count > 0 and count == round(count) for count in launches.values())
    assert len(sequence) == round(total)
    assert {name for name, _ in sequence} <= set(per_step) | set(launches)
    _, _, whole = profile_decode.kernel_totals(model, ids, torch.ones_like(ids), 1)  # ordered by start time
    assert whole and all(isinstance(us, float) for _, us in whole)
    assert sequence[-1][0] == whole[-1][0]  # a generate ends on the same bookkeeping op: the sequence is its tail
