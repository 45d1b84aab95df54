"""``hshare bench generate`` on several GPUs (`hshare.bench.multi_gpu`), checked on the CPU.

* ``--tp 2`` under torchrun, two processes: gloo on CPU, NCCL where the machine has two GPUs (as in
  `tests/test_tensor_parallel.py`). Rank 0 alone prints and writes one JSON, with a row for each path,
  each rank's peak memory, and the ranks' tokens equal.
* ``--device-map``: sparse presets on a model split over devices are refused by hshare; the row
  records the refusal and the other paths run. A model split over two devices is faked on the CPU (its
  ``hf_device_map`` names two GPUs, its weights stay on the CPU); the refusal is hshare's own check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hshare import cli
from hshare.bench import generate, multi_gpu
from hshare.bench.multi_gpu import Placement

RANKS = 2
ON_GPUS = torch.cuda.device_count() >= RANKS  # transformers picks NCCL on GPUs, gloo on CPU
TP_PATHS = ("unpatched", "dense", "ds", "hshare-1_2-1_2-1_2")


def run_torchrun(args: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m hshare.cli ARGS`` (both ranks on the CPU unless two GPUs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not ON_GPUS:
        env["CUDA_VISIBLE_DEVICES"] = ""  # one GPU for two ranks: both on CPU
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(RANKS), "-m", "hshare.cli", *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return done


def test_tensor_parallel_bench_writes_one_json_from_rank_0(tmp_path):
    # 160-token prompts against N_c = 128 and no dense fallback: `ds` and hshare decode sparsely on each rank's heads
    done = run_torchrun(["bench", "generate", "--tp", str(RANKS), "--shape", "tiny", "--batch", "3", "--prompt", "160",
                         "--new-tokens", "5", "--paths", ",".join(TP_PATHS), "--dense-fallback-mib", "0",
                         "--out", str(tmp_path)])
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert written == ["bench_generate_tiny_b3_p160_tp2.json"]
    results = json.loads((tmp_path / written[0]).read_text())
    assert results["placement"]["tp"] == RANKS and results["placement"]["world"] == RANKS
    assert len(results["placement"]["gpus"]) == RANKS
    rows = {r["path"]: r for r in results["generate"]}
    assert list(rows) == list(TP_PATHS)
    for path, row in rows.items():
        assert not row["error"], (path, row["error"])
        assert row["placement"] == "tp2" and row["decode_tok_s"] > 0 and row["kv_gib"] > 0
        assert len(row["peak_gib_per_gpu"]) == RANKS  # each rank's own GPU, gathered on rank 0
        assert row["peak_gib"] == max(row["peak_gib_per_gpu"])
        assert (min(row["peak_gib_per_gpu"]) > 0) == ON_GPUS
        assert row["ranks_agree"] is True, path
        # printed once (rank 0), not once a rank
        assert sum(line.startswith(f"  {path} ") for line in done.stdout.splitlines()) == 1, done.stdout
    assert rows["unpatched"]["agreement"] is None
    assert rows["dense"]["agreement"] == 1.0 or ON_GPUS  # exact; float32 on the CPU
    assert rows["dense"]["decode_steps"] == {}
    for sparse in ("ds", "hshare-1_2-1_2-1_2"):
        steps = rows[sparse]["decode_steps"]
        assert steps["decode"] == 4 and steps["sparse"] == 4 and steps["kv_read_share"] < 1, (sparse, steps)
    # the KV of all ranks: hshare's caches each hold their rank's heads, unpatched is counted for all heads
    assert rows["dense"]["kv_gib"] >= rows["unpatched"]["kv_gib"]
    if ON_GPUS:  # CUDA graphs are declined under tensor parallelism, by name
        assert "tensor parallelism" in rows["dense"]["static_decode"]["reason"]


def test_tensor_parallel_needs_torchrun(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="torchrun --standalone --nproc-per-node 2 -m hshare.cli"):
        cli.main(["bench", "generate", "--tp", "2", "--smoke", "--out", str(tmp_path)])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="without --tp"):
        multi_gpu.require_torchrun(1)
    with pytest.raises(ValueError, match="exclude each other"):
        Placement(tp=2, device_map="auto")
    with pytest.raises(ValueError, match="splitN"):
        Placement(device_map="halves")
    assert not list(tmp_path.iterdir())


def test_split_device_map_is_contiguous():
    mapping = multi_gpu.split_device_map(5, [0, 1])
    assert [mapping[f"model.layers.{i}"] for i in range(5)] == [0, 0, 0, 1, 1]
    assert mapping["model.embed_tokens"] == mapping["model.rotary_emb"] == 0
    assert mapping["model.norm"] == mapping["lm_head"] == 1
    assert Placement(device_map="split2").tag == "_dm-split2" and Placement(tp=4).label == "tp4"


def test_device_map_bench_records_the_refusal(monkeypatch, tmp_path):
    """dense runs on a model split over two devices; a sparse preset's row holds hshare's refusal."""
    build = multi_gpu.build_device_map_model

    def split_over_two_gpus(model_class, config, dtype, spec, device):
        model = build(model_class, config, dtype, spec, "cpu")
        model.hf_device_map = multi_gpu.split_device_map(config.num_hidden_layers, ["cuda:0", "cuda:1"])
        return model

    monkeypatch.setattr(multi_gpu, "build_device_map_model", split_over_two_gpus)
    monkeypatch.setattr(multi_gpu, "model_gpus", lambda model: [])  # the weights are on the CPU
    results = generate.main_generate(tmp_path, "tiny", 2, 40, 4, ("unpatched", "dense", "ds@512"), False, None,
                                     smoke=True, device_map="split2")
    saved = json.loads((tmp_path / "bench_generate_tiny_b2_p40_dm-split2.json").read_text())
    assert saved["generate"] == results["generate"] and saved["placement"]["label"] == "device_map split2"
    rows = {r["path"]: r for r in saved["generate"]}
    assert not rows["unpatched"]["error"] and not rows["dense"]["error"]
    assert rows["dense"]["decode_tok_s"] > 0 and rows["dense"]["agreement"] == 1.0
    assert rows["ds@512"]["error"].startswith("refused: hshare's sparse presets do not yet support a model split")
    assert "['cuda:0', 'cuda:1']" in rows["ds@512"]["error"] and rows["ds@512"]["decode_tok_s"] == 0
    assert all(r["placement"] == "device_map split2" for r in rows.values())
