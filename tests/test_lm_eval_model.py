"""The lm-eval model ``hshare``: model_args, exactness of the dense path, work counters."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

import hshare
from hshare.config import ConfigError
from hshare.eval.lm_eval_model import HShareLM, evaluation_config, parse_overrides

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
    assert evaluation_config("ds").dense_fallback_mib == 0.0  # evaluation measures the algorithm
    assert evaluation_config("ds", dense_fallback=True).dense_fallback_mib is None
    assert evaluation_config("ds", {"heavy": 7}).heavy == 7


def test_dense_generations_equal_the_unpatched_model_and_sparse_ones_count_work():
    model, tokenizer = _model(), byte_tokenizer()
    reference = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="dense", batch_size=3)
    reference.unpatch()  # the plain HF path: what lm-eval's "hf" model would generate
    plain = reference.generate_until(_requests(PROMPTS))
    dense = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="dense", batch_size=3)
    assert dense.generate_until(_requests(PROMPTS)) == plain
    assert dense.work.generate_calls == 1 and dense.work.counters["decode_steps"] == 9
    assert dense.work.counters["score_computations"] == 0
    dense.unpatch()

    sparse = HShareLM(pretrained=model, tokenizer=tokenizer, hshare="ds", batch_size=3,
                      hshare_sink=2, hshare_local=4, hshare_heavy=6, hshare_label_channels=4)
    outputs = sparse.generate_until(_requests(PROMPTS))
    assert len(outputs) == 3 and all(isinstance(o, str) for o in outputs)
    work = sparse.work.counters
    assert work["decode_steps"] == 9 and work["dense_fallback_steps"] == 0
    # ds: every (row, layer, KV head) scores at every decode step
    assert work["score_computations"] == 9 * 3 * 3 * 2
    assert hshare.api.patch_state(model).config.dense_fallback_mib == 0.0
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
