"""Evaluation over several devices, on the CPU with a tiny random model and the synthetic CoQA file.

* ``hshare sweep --devices cpu,cpu``: two worker processes give the run files of a sequential sweep,
  finished runs are skipped and interrupted ones redone; a worker failure names device and log.
* lm-eval data parallel (``torchrun``/``accelerate launch``, one model copy per rank): two gloo
  ranks give the scores and summed work counters of one process, and only rank 0 writes.
* ``parallelize=True`` (one model split over devices): dense runs; sparse presets are refused by
  ``hshare eval`` before any request, naming what to change.

Run as a script (``torchrun --nproc_per_node 2 tests/test_eval_parallel.py eval ...``) this file is
``hshare`` with two test adjustments: lm-eval's HF model believes two CUDA devices exist (it only
splits documents over ranks when it sees more than one; the model stays on the CPU) and lm-eval's
stock tasks are not indexed (only the generated ones are used; saves ~13 s per process).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_llama
from eval_support import BYTE_VOCAB, byte_tokenizer

SMALL = {"sink": 2, "local": 4, "heavy": 8, "label_channels": 4}
SWEEP = """configs:
  - dense
  - {name: ds-small, preset: ds, set: {sink: 2, local: 4, heavy: 8, label_channels: 4}}
  - {name: hs-small, preset: hshare-1_2-1_2-1_2, set: {sink: 2, local: 4, heavy: 8, label_channels: 4}}
"""


def _tiny_model():
    model = tiny_llama(kv_heads=2, layers=3)
    model.resize_token_embeddings(BYTE_VOCAB)
    model.config.pad_token_id, model.config.eos_token_id = 0, 2
    return model


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A saved tiny model, a data directory with the synthetic CoQA file, lm-eval's stock tasks not indexed."""
    import lm_eval.tasks

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    model_dir = tmp_path / "tiny"
    _tiny_model().save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "data"
    (data / "coqa").mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "data" / "coqa_synthetic.json", data / "coqa" / "coqa-dev-v1.0.json")
    return model_dir, data


# ---- hshare sweep --devices ---------------------------------------------------------------------

def _sweep_args(model_dir, data, sweep, out, devices):
    return ["sweep", "--configs", str(sweep), "--tasks", "coqa", "--model", str(model_dir), "--data-dir", str(data),
            "--limit", "2", "--batch-size", "2", "--gen-kwargs", "max_gen_toks=4", "--log-samples",
            "--devices", devices, "--out", str(out)]


def _without_times(record):
    return {k: v for k, v in record.items() if k not in ("date", "seconds")}


def test_sweep_over_two_workers_equals_the_sequential_sweep_and_resumes(setup, tmp_path):
    from hshare.cli import main

    model_dir, data = setup
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP)
    seq, par = tmp_path / "seq", tmp_path / "par"
    assert main(_sweep_args(model_dir, data, sweep, seq, "cpu")) == 0  # one device: the sequential sweep
    assert not (seq / "logs").exists()

    # a sweep that stopped: dense finished, ds-small's file damaged, hs-small killed while being written
    (par / "runs").mkdir(parents=True)
    shutil.copy(seq / "runs" / "dense.json", par / "runs" / "dense.json")
    (par / "runs" / "ds-small.json").write_text('{"name": "ds-sm')
    (par / "runs" / "hs-small.json.tmp").write_text("{")
    finished_dense = (par / "runs" / "dense.json").read_bytes()
    assert main(_sweep_args(model_dir, data, sweep, par, "cpu,cpu")) == 0

    assert (par / "runs" / "dense.json").read_bytes() == finished_dense  # skipped, not rerun
    for name in ("ds-small", "hs-small"):
        got = json.loads((par / "runs" / f"{name}.json").read_text())
        want = json.loads((seq / "runs" / f"{name}.json").read_text())
        assert _without_times(got) == _without_times(want)  # scores, work counters, samples, config, device
        assert got["samples"]["coqa"] and got["work"]["decode_steps"] > 0
    logs = sorted((par / "logs").iterdir())
    assert [p.name for p in logs] == ["worker-0-cpu.log", "worker-1-cpu.log"]
    ran = [line for p in logs for line in p.read_text().splitlines() if line in ("== ds-small", "== hs-small")]
    assert sorted(ran) == ["== ds-small", "== hs-small"]  # each unfinished config ran once, on some worker
    strip = lambda path: [line.rsplit(",", 1)[0] for line in path.read_text().splitlines()]  # noqa: E731
    assert strip(par / "sweep.csv") == strip(seq / "sweep.csv")  # the table, but for the seconds column
    assert json.loads((par / "sweep.json").read_text())["meta"]["device"] == "cpu,cpu"
    assert (par / "sweep.png").is_file() and (par / "sweep.md").is_file()

    stamps = {p.name: p.stat().st_mtime_ns for p in (par / "runs").glob("*.json")}
    assert main(_sweep_args(model_dir, data, sweep, par, "cpu,cpu")) == 0  # all finished: no worker starts
    assert {p.name: p.stat().st_mtime_ns for p in (par / "runs").glob("*.json")} == stamps
    assert [p.read_text().count("== ds-small") for p in logs].count(1) == 1


def test_a_failing_worker_names_the_device_and_its_log(setup, tmp_path):
    from hshare.cli import main

    _, data = setup
    sweep = tmp_path / "s.yaml"
    sweep.write_text("configs: [dense]\n")  # one config: one worker
    empty = tmp_path / "no-model"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"loading the model failed on cpu \(log: .*worker-\d-cpu.log\).*resume"):
        main(_sweep_args(empty, data, sweep, tmp_path / "out", "cpu,cpu"))
    assert not list(tmp_path.glob("out/runs/*.json"))
    assert "Traceback" in "".join(p.read_text() for p in (tmp_path / "out" / "logs").iterdir())


def test_devices_option():
    from hshare.eval.sweep import parse_devices

    assert parse_devices(None) == [] and parse_devices("cpu, cpu") == ["cpu", "cpu"]
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device is visible"):
            parse_devices("auto")
        with pytest.raises(SystemExit, match="cuda:1 is not visible"):
            parse_devices("cpu,cuda:1")
    with pytest.raises(SystemExit, match="'gpu7' is not a device"):
        parse_devices("gpu7")


# ---- lm-eval data parallel ----------------------------------------------------------------------

def test_padding_copies_and_work_sums():
    from lm_eval.api.instance import Instance

    from hshare.eval.lm_eval_model import WorkTotals, padding_copies

    a, b = (Instance("generate_until", {}, ("x", {}), i) for i in range(2))
    assert padding_copies([a, b]) == 0 and padding_copies([]) == 0
    assert padding_copies([a, b, b, b]) == 2  # two copies of the rank's last request
    b.repeats = 2
    assert padding_copies([a, b, b]) == 0 and padding_copies([a, b, b, b, b]) == 2  # its own repeats are not
    total = WorkTotals.summed([WorkTotals(2, {"decode_steps": 6}, {"selecting": 2.0}, 2),
                               WorkTotals(1, {"decode_steps": 3, "plans": 1}, {"selecting": 0.25}, 1)])
    assert total.as_dict() == {"generate_calls": 3, "decode_steps": 9, "plans": 1}
    assert total.plan_mean() == {"selecting": 0.75}  # (1.0 + 1.0 + 0.25) / 3 batches, not a mean of the means


def _requests(prompts, max_gen_toks=6):
    from lm_eval.api.instance import Instance

    args = {"until": ["\n\n\n\n"], "max_gen_toks": max_gen_toks, "do_sample": False}
    return [Instance("generate_until", {}, (p, dict(args)), i) for i, p in enumerate(prompts)]


PROMPTS = ["Question: what is 12 plus 30?\nAnswer:", "Q: 7 x 6 = ?\nA:", "Natalia sold clips to 48 friends."]


def test_padding_of_a_data_parallel_rank_is_answered_without_generating():
    from hshare.eval.lm_eval_model import HShareLM

    model, tokenizer = _tiny_model(), byte_tokenizer()
    alone = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="ds", batch_size=3, **{f"hshare_{k}": v
                                                                                          for k, v in SMALL.items()})
    expected = alone.generate_until(_requests(PROMPTS))
    alone.unpatch()
    rank = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="ds", batch_size=3, **{f"hshare_{k}": v
                                                                                         for k, v in SMALL.items()})
    rank._world_size = 2  # what lm-eval sets under accelerate launch
    requests = _requests(PROMPTS)
    got = rank.generate_until(requests + [requests[-1]] * 2)  # the evaluator's padding: two copies
    rank.unpatch()
    assert got == expected + expected[-1:] * 2
    assert rank.work.as_dict() == alone.work.as_dict()  # one batch of three, as without the padding


def _eval_args(model_dir, data, out, hshare="ds", extra=""):
    small = ",".join(f"hshare_{k}={v}" for k, v in SMALL.items())
    return ["eval", "--model_args", f"pretrained={model_dir},hshare={hshare},{small},dtype=float32{extra}",
            "--tasks", "coqa", "--data-dir", str(data), "--limit", "3", "--gen_kwargs", "max_gen_toks=4",
            "--batch_size", "1", "--device", "cpu", "--log_samples", "--output_path", str(out)]


def _work_line(text):
    lines = [line for line in text.splitlines() if line.startswith("hshare work counters")]
    return lines, (ast.literal_eval(lines[-1].split(": ", 1)[1]) if lines else None)


def _results(out):
    (path,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_coqa_*.jsonl")
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
    # filtered_resps: what is scored (resps also holds the answers to lm-eval's padding copies, as with its own models)
    return json.loads(path.read_text())["results"], [(r["doc_id"], r["filtered_resps"], r["metrics"]) for r in rows]


def test_two_data_parallel_ranks_equal_one_process(setup, tmp_path, capsys):
    """torchrun with two gloo ranks (accelerate's multi-CPU state), as ``accelerate launch`` on GPUs."""
    from hshare.cli import main

    model_dir, data = setup
    assert main(_eval_args(model_dir, data, tmp_path / "one")) == 0
    one_out = capsys.readouterr().out
    one_lines, one_work = _work_line(one_out)
    assert len(one_lines) == 1 and "summed" not in one_lines[0] and one_work["generate_calls"] == 3

    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, *_eval_args(model_dir, data, tmp_path / "two")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines, work = _work_line(proc.stdout)
    assert lines == [lines[0]] and "summed over 2 data-parallel ranks" in lines[0]  # printed once, by rank 0
    assert work == one_work  # rank 0: 2 documents, rank 1: 1 (+1 padding copy, not generated)
    plans = lambda text: [line for line in text.splitlines() if line.startswith("hshare sharing plans")]  # noqa: E731
    assert len(plans(one_out)) == 1 and plans(proc.stdout) == plans(one_out)  # the mean over both ranks' batches
    assert len(list((tmp_path / "two").rglob("results_*.json"))) == 1  # only rank 0 writes
    assert _results(tmp_path / "two") == _results(tmp_path / "one")


def test_data_parallel_ranks_load_the_embedded_model_from_its_converted_directory(tmp_path, monkeypatch):
    import hshare.default_model
    from hshare.eval.lm_eval_model import default_model_dir, launched_processes

    monkeypatch.setenv("HSHARE_CACHE", str(tmp_path))
    converted = tmp_path / hshare.default_model.MODEL_NAME
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    monkeypatch.setattr(hshare.default_model, "load_default_model", lambda *a: 1 / 0)  # converted already
    assert default_model_dir() == converted
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_processes() == 2


def test_python_m_hshare_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "hshare", "presets"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.splitlines()[0].startswith("dense")
    auto = next(line for line in proc.stdout.splitlines() if line.startswith("hshare-auto "))
    assert "auto planner: at most 1/4 of the (layer, head) pairs selecting (bounds layer 1/8, head 1/3)" in auto


# ---- parallelize=True: one model split over devices ------------------------------------------------

SPLIT = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.layers.2": 1,
         "model.norm": 1, "lm_head": 1}


def test_sparse_presets_refuse_a_split_model_and_dense_runs_it():
    from hshare.eval.lm_eval_model import HShareLM, SplitPlacementError

    model, tokenizer = _tiny_model(), byte_tokenizer()
    plain = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="dense", batch_size=3)
    plain.unpatch()
    expected = plain.generate_until(_requests(PROMPTS))
    model.hf_device_map = SPLIT  # what from_pretrained(device_map=...) leaves over two GPUs
    with pytest.raises(SplitPlacementError, match=r"split over devices \['0', '1'\].*accelerate launch -m hshare "
                                                  r"eval.*without parallelize=True.*hshare=dense"):
        HShareLM(pretrained=model, tokenizer=tokenizer, hshare="ds", batch_size=3)
    dense = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="dense", batch_size=3)
    assert dense.generate_until(_requests(PROMPTS)) == expected
    dense.unpatch()


def test_hshare_eval_parallelize_passes_through_and_refuses_before_any_request(setup, tmp_path, monkeypatch, capsys):
    import transformers

    from hshare.cli import main
    from hshare.eval.lm_eval_model import HShareLM

    model_dir, data = setup
    loads = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, path, **kwargs):  # a CPU stand-in for accelerate's placement over two GPUs
        loads.append({k: kwargs.pop(k, None) for k in ("device_map", "max_memory", "offload_folder")})
        model = original(cls, path, **kwargs)
        model.hf_device_map = dict(SPLIT)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    generated, generate = [], HShareLM._model_generate

    def counted(self, *args, **kwargs):
        generated.append(1)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(HShareLM, "_model_generate", counted)
    with pytest.raises(SystemExit, match=r"^hshare eval: .*sparse presets.*split over devices.*"
                                         r"accelerate launch -m hshare eval"):
        main(_eval_args(model_dir, data, tmp_path / "out", extra=",parallelize=True"))
    assert loads and loads[0]["device_map"] == "auto"  # parallelize=True reached lm-eval's HF model
    assert not generated and not (tmp_path / "out").exists()  # refused before any request

    capsys.readouterr()
    assert main(_eval_args(model_dir, data, tmp_path / "dense", hshare="dense", extra=",parallelize=True")) == 0
    lines, work = _work_line(capsys.readouterr().out)
    assert len(generated) == 3 and "(dense)" in lines[0] and work["score_computations"] == 0


if __name__ == "__main__":  # a rank of test_two_data_parallel_ranks_equal_one_process
    import lm_eval.tasks
    import torch

    real_count = torch.cuda.device_count

    def device_count() -> int:  # lm-eval's HF model splits documents over ranks only when it sees > 1 GPU
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return 2 if caller == "lm_eval.models.huggingface" else real_count()

    torch.cuda.device_count = device_count
    lm_eval.tasks.TaskManager = functools.partial(lm_eval.tasks.TaskManager, include_defaults=False)
    from hshare.cli import main

    sys.exit(main(sys.argv[1:]))
