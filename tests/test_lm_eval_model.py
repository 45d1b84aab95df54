"""The lm-eval model ``hshare``: model_args, exactness of the dense path, work counters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

import hshare
from hshare.config import ConfigError
from hshare.eval.lm_eval_model import HShareLM, evaluation_config, parse_overrides
from hshare.planner import sources_for_ratio

from conftest import tiny_llama
from eval_support import BYTE_VOCAB, byte_tokenizer


def _model(kv_heads=2):
    model = tiny_llama(kv_heads=kv_heads, layers=3)
    model.resize_token_embeddings(BYTE_VOCAB)
    model.config.pad_token_id, model.config.eos_token_id = 0, 2
    return model


def _requests(prompts, max_gen_toks=10):
    args = {"until": ["\n\n\n\n"], "max_gen_toks": max_gen_toks, "do_sample": False}
    return [Instance("generate_until", {}, (p, dict(args)), i) for i, p in enumerate(prompts)]


PROMPTS = ["Question: what is 12 plus 30?\nAnswer:", "Q: 7 x 6 = ?\nA:",
           "Natalia sold clips to 48 of her friends in April, and half as many in May. How many?"]


def test_registered_and_model_args_parsed():
    assert get_model("hshare") is HShareLM
    args = {"hshare_heavy": 200, "hshare_layer_sharing": "3/4", "hshare_dense_layers": "0;1", "batch_size": 2}
    assert parse_overrides(args) == {"heavy": 200, "layer_sharing": "3/4", "dense_layers": (0, 1)}
    assert args == {"batch_size": 2}  # ours popped, lm-eval's left
    with pytest.raises(ConfigError, match="hshare_heavy"):
        parse_overrides({"hshare_heavyy": 3})
    assert evaluation_config("ds").runtime.dense_fallback_mib == 0.0  # evaluation measures the algorithm
    assert evaluation_config("ds", dense_fallback=True).runtime.dense_fallback_mib is None
    assert evaluation_config("ds", {"heavy": 7}).budget.heavy == 7


def test_dense_generations_equal_the_unpatched_model_and_sparse_ones_count_work():
    model, tokenizer = _model(), byte_tokenizer()
    reference = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="dense", batch_size=3)
    reference.unpatch()  # the plain HF path: what lm-eval's "hf" model would generate
    plain = reference.generate_until(_requests(PROMPTS))
    dense = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="dense", batch_size=3)
    assert dense.generate_until(_requests(PROMPTS)) == plain
    assert dense.work.generate_calls == 1 and dense.work.counters["decode_steps"] == 9
    assert dense.work.counters["score_computations"] == 0 and dense.work.plan_mean() == {}
    dense.unpatch()

    sparse = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="ds", batch_size=3,
                      hshare_sink=2, hshare_local=4, hshare_heavy=6, hshare_label_channels=4)
    outputs = sparse.generate_until(_requests(PROMPTS))
    assert len(outputs) == 3 and all(isinstance(o, str) for o in outputs)
    work = sparse.work.counters
    assert work["decode_steps"] == 9 and work["dense_fallback_steps"] == 0
    # ds: every (row, layer, KV head) scores at every decode step
    assert work["score_computations"] == 9 * 3 * 3 * 2
    assert sparse.work.plan_mean() == {"layer_copies": 0.0, "head_copies": 0.0, "selecting": 1.0}  # no sharing
    assert hshare.api.patch_state(model).config.runtime.dense_fallback_mib == 0.0
    sparse.unpatch()
    assert hshare.api.patch_state(model) is None


def test_loglikelihood_is_exact_under_a_sparse_config():
    model, tokenizer = _model(), byte_tokenizer()
    requests = [Instance("loglikelihood", {}, ("The answer is", " 42"), 0),
                Instance("loglikelihood", {}, ("Q: 7 x 6 = ?\nA:", " 42"), 1)]
    plain = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="dense", batch_size=2)
    plain.unpatch()
    expected = plain.loglikelihood(requests)
    sparse = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="hshare-1_2-1_2-1_2", batch_size=2,
                      hshare_sink=1, hshare_local=2, hshare_heavy=2, hshare_label_channels=4)
    got = sparse.loglikelihood(requests)
    sparse.unpatch()
    for (a, greedy_a), (b, greedy_b) in zip(got, expected):
        assert a == pytest.approx(b, abs=1e-5) and greedy_a == greedy_b


DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").is_file(), reason=f"no task data at {DATA}")


def _data_dir(tmp_path):
    """gsm8k and multi_news from the shared data, CoQA from the synthetic official-layout fixture."""
    root = tmp_path / "data"
    (root / "coqa").mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "data" / "coqa_synthetic.json", root / "coqa" / "coqa-dev-v1.0.json")
    (root / "gsm8k").symlink_to(DATA / "gsm8k")
    (root / "longbench").mkdir()
    (root / "longbench" / "multi_news.jsonl").symlink_to(DATA / "longbench" / "multi_news.jsonl")
    return root


@needs_data
def test_evaluate_gsm8k_coqa_multi_news_with_limit_2(tmp_path, monkeypatch):
    from hshare.eval.harness import TaskSuite, evaluate

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    model, tokenizer = _model(), byte_tokenizer()
    suite = TaskSuite.prepare(["gsm8k", "coqa", "longbench_multi_news"], _data_dir(tmp_path), tmp_path / "tasks")
    overrides = {"sink": 2, "local": 4, "heavy": 8, "label_channels": 4}
    runs = {name: evaluate(model, tokenizer, name, suite, limit=2, batch_size=2, gen_kwargs="max_gen_toks=6",
                           overrides=None if name == "dense" else overrides)
            for name in ("dense", "hshare-1_2-1_2-1_2")}
    for result in runs.values():
        assert set(result.scores) == {"gsm8k", "coqa", "longbench_multi_news"}
        assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(result.scores["gsm8k"])
        assert {"em,none", "f1,none"} <= set(result.scores["coqa"])
        assert all(0.0 <= v <= 100.0 for task in result.scores.values() for v in task.values())
        assert result.config["runtime"]["dense_fallback_mib"] == 0.0 and result.limit == 2
    assert runs["dense"].work["score_computations"] == 0
    sparse = runs["hshare-1_2-1_2-1_2"].work
    assert sparse["decode_steps"] == runs["dense"].work["decode_steps"] > 0
    assert 0 < sparse["score_computations"] and sparse["plans"] == sparse["generate_calls"]
    layers, heads = 3, 2  # every batch's plan: half the layers and half the KV heads select
    assert runs["hshare-1_2-1_2-1_2"].plan == pytest.approx({
        "layer_copies": layers - sources_for_ratio(0.5, layers),
        "head_copies": sources_for_ratio(0.5, layers) * (heads - sources_for_ratio(0.5, heads)),
        "selecting": sources_for_ratio(0.5, layers) * sources_for_ratio(0.5, heads) / (layers * heads)})
    assert runs["dense"].plan == {}
    assert hshare.api.patch_state(model) is None  # unpatched after each evaluation


@needs_data
def test_hshare_eval_command_runs_lm_eval_with_local_tasks(tmp_path, monkeypatch, capsys):
    from hshare.cli import main

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    model_dir = tmp_path / "tiny"
    _model().save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "results"
    code = main(["eval", "--model_args", f"pretrained={model_dir},hshare=ds,hshare_heavy=8,hshare_local=4,"
                 "hshare_sink=2,hshare_label_channels=4,dtype=float32", "--device", "cpu", "--tasks", "gsm8k",
                 "--data-dir", str(_data_dir(tmp_path)), "--limit", "2", "--gen_kwargs", "max_gen_toks=4",
                 "--output_path", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "gsm8k" in printed and "exact_match" in printed
    assert "hshare work counters (ds)" in printed and "'score_computations': " in printed
    assert "'layer_copies': 0.0, 'head_copies': 0.0, 'selecting': 1.0}" in printed  # ds: every pair selects
    saved = list(out.rglob("results_*.json"))
    assert saved and json.loads(saved[0].read_text())["config"]["model"] == "hshare"
