"""`hshare plan` (`hshare.eval.plan`): the plan each config makes, read as `generate` makes it (tiny random models)."""

import random

import pytest
import torch

import hshare
from hshare.api import patch_state
from hshare.cli import main as cli_main
from hshare.eval.harness import evaluation_config
from hshare.eval.plan import ConfigPlan, measure_plans, plan_lines

from conftest import VOCAB, cache_kwarg, tiny_llama

SMALL = dict(sink=2, local=4, heavy=6)  # N_c = 12, below the windows here


def test_plan_lines_hand_worked():
    plan = ConfigPlan("x", 64, 2, layer_source=[[0, 1, 1, 3]], head_source=[[[0, 1]], [[0, 0]], [[0, 1]], [[0, 1]]],
                      sparse_layers=[1, 2, 3], summary={"layer_copies": 1.0, "head_copies": 1.0, "selecting": 0.5})
    assert plan_lines(plan) == [
        "x: 2 window(s) of 64 tokens: 1 layer copies, 1 head copies, 0.500 of the (layer, selection head) pairs "
        "score the whole context",
        "  layer   0: dense",
        "  layer   1: selects, head sources 0 0",
        "  layer   2: copies layer 1",
        "  layer   3: selects, head sources 0 1",
    ]
    rows = ConfigPlan("y", 8, 2, [[0, 0], [0, 1]], [[[0], [0]], [[0], [0]]], [0, 1], {"layer_copies": 0.5,
                      "head_copies": 0.0, "selecting": 0.75})
    assert plan_lines(rows)[1:] == ["row 0:", "  layer   0: selects, head sources 0", "  layer   1: copies layer 0",
                                    "row 1:", "  layer   0: selects, head sources 0",
                                    "  layer   1: selects, head sources 0"]
    assert "no sharing plan" in plan_lines(ConfigPlan("dense", 8, 1, [], [], [], {}))[0]


def _generate_plan(model, windows, config):
    """The plan `generate` makes on `windows` under `config` (the reference)."""
    with hshare.patched(model, evaluation_config(config)):
        cache = hshare.new_cache(model)
        model.generate(windows, attention_mask=torch.ones_like(windows), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=0, **cache_kwarg(cache))
        return cache.planner.sharing, cache.sparse_layers


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_measured_plans_are_generates_and_state_is_restored(kv_heads):
    seed = random.randrange(2**31)
    model = tiny_llama(kv_heads=kv_heads, layers=6, heads=4, seed=seed % 1000)
    text = torch.randint(3, VOCAB, (600,), generator=torch.Generator().manual_seed(seed))
    budget = dict(SMALL, planner="auto", share_scorings=0.5, layer_sharing=0.25, head_sharing=0.5)
    configs = [hshare.HShareConfig(name="ds", **SMALL), hshare.HShareConfig.from_preset("hshare-1_2-1_2-1_2")
               .replace(**SMALL), hshare.HShareConfig.from_preset("hshare-refine-successors-c4").replace(**budget),
               "dense"]
    hshare.patch(model, "ds")
    before = patch_state(model).config
    plans = measure_plans(model, text, None, 96, configs, batch=2)
    assert patch_state(model).config == before, f"seed {seed}"
    hshare.unpatch(model)
    windows = torch.stack([text[0:96], text[504:600]])
    for config, plan in zip(configs[:3], plans):
        sharing, sparse = _generate_plan(model, windows, config)
        assert plan.layer_source == sharing.layer_source.tolist(), f"seed {seed}"
        assert plan.head_source == sharing.head_source.tolist(), f"seed {seed}"
        assert plan.summary == sharing.summary(sparse) and plan.sparse_layers == sparse
        lines = plan_lines(plan)
        copies = [line for line in lines if "copies layer" in line]
        assert len(copies) == plan.summary["layer_copies"]
        for line in copies:  # a copied layer is an earlier one that selects
            layer, source = int(line.split()[1].rstrip(":")), int(line.split()[-1])
            assert source < layer and plan.layer_source[0][source] == source
    ds, shared, planned, dense = plans
    assert ds.summary == {"layer_copies": 0.0, "head_copies": 0.0, "selecting": 1.0}
    assert shared.summary["selecting"] < 1.0
    assert planned.summary["selecting"] <= 0.5 + 1e-9, f"seed {seed}"  # within the scoring budget
    assert dense.layer_source == [] and "no sharing plan" in plan_lines(dense)[0]


def test_plan_command_refuses_before_loading_a_model(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("a b c")
    with pytest.raises(SystemExit, match="2 lengths given; accepted: one"):
        cli_main(["plan", "--text", str(text), "--length", "1k,2k", "--configs", "ds"])
    model = tiny_llama()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        measure_plans(model, torch.arange(3, 2000) % VOCAB, None, 1023, ["ds"])
    with pytest.raises(ValueError, match="batch = 0"):
        measure_plans(model, torch.arange(3, 200) % VOCAB, None, 64, ["ds"], batch=0)
