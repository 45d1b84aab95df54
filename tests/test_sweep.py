"""Sweep files, resuming an interrupted sweep, and the summary table (no model: evaluation injected)."""

from __future__ import annotations

import json

import pytest

from hshare.config import ConfigError
from hshare.eval.harness import EvalResult
from hshare.eval.sweep import run_sweep, summarize, write_tables
from hshare.eval.sweep_spec import load_sweep, sweep_names


def _write(tmp_path, text):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_bundled_sweeps_load_and_cover_the_paper_grid():
    assert {"paper", "paper-128", "ablation", "refine", "successors"} <= set(sweep_names())
    for name in sweep_names():  # every bundled entry builds a valid config
        for entry in load_sweep(name).entries:
            entry.config()
    successors = {e.name: e.config() for e in load_sweep("successors").entries}
    assert successors["hshare-1_2-1_2-1_2@512+successors"].sharing.successors
    assert successors["hshare-1_2-1_2-1_2@512+successors"].candidate_count == 0
    ablation = {e.name: e for e in load_sweep("ablation").entries}
    for field, values in {"layer_sharing": ["3/4", "1/2", "1/4"], "head_sharing": ["3/4", "1/2", "1/4"],
                          "query_sharing": ["1/2", "1/4"]}.items():
        for value in values:
            entry = ablation[f"ds@512+{field}={value}"]
            assert getattr(entry.config().sharing, field.removesuffix("_sharing")) == pytest.approx(eval(value))
    paper = [e.name for e in load_sweep("paper").entries]
    assert paper[0] == "dense" and "random-1_2-1_2-1_2@512" in paper and "streaming@512" in paper


def test_sweep_file_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="heavyy"):
        load_sweep(_write(tmp_path, "configs:\n  - {preset: ds, set: {heavyy: 3}}\n"))
    with pytest.raises(ConfigError, match="more than once"):
        load_sweep(_write(tmp_path, "configs: [ds, ds]\n"))
    with pytest.raises(ConfigError, match="unknown key"):
        load_sweep(_write(tmp_path, "config: [ds]\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_sweep("no-such-sweep")


def _fake_result(name, calls):
    calls.append(name)
    score = {"dense": 0.5, "ds": 0.4}.get(name, 0.3)
    return EvalResult(config={"name": name}, scores={"gsm8k": {"exact_match,strict-match": score}},
                      work={"score_computations": len(calls), "kv_rows_read": 25, "dense_kv_rows": 100},
                      seconds=1.0, limit=2)


def test_sweep_resumes_after_an_interruption_and_reruns_changed_runs(tmp_path):
    spec = load_sweep(_write(tmp_path, "configs: [dense, ds, streaming]\n"))
    out = tmp_path / "out"
    calls = []

    def interrupted(entry):
        if entry.name == "streaming":
            raise KeyboardInterrupt
        return _fake_result(entry.name, calls)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, interrupted, out, ["gsm8k"], 2)
    assert calls == ["dense", "ds"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["dense.json", "ds.json"]

    progress = []
    records = run_sweep(spec, lambda e: _fake_result(e.name, calls), out, ["gsm8k"], 2,
                        progress=lambda name, what: progress.append((name, what)))
    assert calls == ["dense", "ds", "streaming"]  # only the unfinished config ran
    assert [r["name"] for r in records] == ["dense", "ds", "streaming"]
    assert ("dense", "skip") in progress and ("streaming", "done") in progress

    run_sweep(spec, lambda e: _fake_result(e.name, calls), out, ["gsm8k"], 3)  # another limit: all rerun
    assert calls[3:] == ["dense", "ds", "streaming"]
    (out / "runs" / "ds.json").write_text("{truncated")  # a damaged file is redone, not trusted
    run_sweep(spec, lambda e: _fake_result(e.name, calls), out, ["gsm8k"], 3)
    assert calls[6:] == ["ds"]


def test_resume_keeps_runs_that_predate_a_config_field_at_its_default(tmp_path):
    """A run saved before a config field existed has no such key: it is reused exactly where the current
    config holds that field's default (what the older code ran), else run again; every field dropped in turn."""
    import copy

    from hshare.eval.harness import evaluation_config
    from hshare.eval.sweep import finished, run_path

    budget = "hshare-refine-successors-c4@512+planner=auto+share_scorings=1/3+layer_sharing=1/8+head_sharing=1/3"
    spec = load_sweep(_write(tmp_path, f"configs: [hshare-refine-successors-c4@512, '{budget}', dense]\n"))
    out, calls = tmp_path / "out", []
    run_sweep(spec, lambda e: _fake_result(e.name, calls), out, ["gsm8k"], 2)
    for entry in spec.entries:
        path = run_path(out, entry)
        saved = json.loads(path.read_text())
        assert finished(out, entry, ["gsm8k"], 2) is not None
        config = evaluation_config(entry.config())
        for section, fields in saved["identity"]["config"].items():
            if not isinstance(fields, dict):
                continue
            default = type(getattr(config, section))()
            for key in fields:
                older = copy.deepcopy(saved)
                del older["identity"]["config"][section][key]
                path.write_text(json.dumps(older))
                at_default = key == "name" or getattr(getattr(config, section), key) == getattr(default, key)
                assert (finished(out, entry, ["gsm8k"], 2) is not None) == at_default, (entry.name, section, key)
        newer = copy.deepcopy(saved)  # a field the current hshare lacks: not the same config
        newer["identity"]["config"]["planner"]["retired"] = 1
        path.write_text(json.dumps(newer))
        assert finished(out, entry, ["gsm8k"], 2) is None
        path.write_text(json.dumps(saved))
    older = copy.deepcopy(json.loads(run_path(out, spec.entries[1]).read_text()))
    del older["identity"]["config"]["planner"]["scorings"]  # the budget run, made before planner.scorings existed
    run_path(out, spec.entries[1]).write_text(json.dumps(older))
    run_sweep(spec, lambda e: _fake_result(e.name, calls), out, ["gsm8k"], 2)
    assert calls[3:] == [budget]  # only the run whose config the missing field changes ran again


def test_summary_relative_scores_costs_and_files(tmp_path):
    calls = []
    records = [{"name": n, "work": r.work, "scores": r.scores, "seconds": r.seconds}
               for n in ("dense", "ds") for r in [_fake_result(n, calls)]]
    records[0]["work"] = {"score_computations": 0, "kv_rows_read": 100, "dense_kv_rows": 100}
    records[1]["plan"] = {"layer_copies": 2.0, "selecting": 0.25}
    rows = summarize(records)
    assert rows[0]["plan_selecting"] is None and rows[1]["plan_selecting"] == 0.25 and rows[1]["plan_layer_copies"] == 2.0
    assert list(rows[0]) == list(rows[1])  # every row the same columns, seconds last
    assert rows[0]["gsm8k:vs_dense"] == 1.0 and rows[1]["gsm8k:vs_dense"] == pytest.approx(0.8)
    assert rows[0]["kv_read"] == 1.0 and rows[1]["kv_read"] == 0.25
    files = write_tables(rows, tmp_path, {"limit": 2})
    md = files[0].read_text().splitlines()
    assert md[1].startswith("| config | gsm8k:exact_match,strict-match | gsm8k:vs_dense")
    assert md[4].startswith("| ds | 0.4 | 0.8 | 0.25 |")
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][1]["config"] == "ds"
    assert (tmp_path / "sweep.csv").read_text().splitlines()[2].startswith("ds,0.4,0.8")


def test_evaluation_keeps_explicit_fallbacks_and_resume_tells_fallback_runs_apart(tmp_path):
    from hshare.eval.harness import evaluation_config

    assert evaluation_config("ds", {"dense_fallback_mib": 64}).runtime.dense_fallback_mib == 64.0  # set by the user: kept
    spec = load_sweep(_write(tmp_path, "configs: [ds, {name: ds-fb, preset: ds, set: {dense_fallback_mib: 64}}]\n"))
    out, calls = tmp_path / "out", []
    records = run_sweep(spec, lambda e: _fake_result(e.name, calls), out, ["gsm8k"], 2)
    assert [r["identity"]["config"]["runtime"]["dense_fallback_mib"] for r in records] == [0.0, 64.0]
    run_sweep(spec, lambda e: _fake_result(e.name, calls), out, ["gsm8k"], 2, dense_fallback=True)
    assert calls == ["ds", "ds-fb", "ds"]  # ds now keeps the device's fallback: another run; ds-fb is the same
