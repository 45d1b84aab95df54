"""`hshare.eval.fidelity`: forced-continuation fidelity against dense decoding (tiny random models)."""

import argparse
import contextlib
import csv
import json
import math

import pytest
import torch

import hshare
from hshare.api import patch_state
from hshare.planner import sources_for_ratio
from hshare.eval.fidelity import (
    FidelityResult,
    add_fidelity_parser,
    forced_decode_logits,
    greedy_decode_logits,
    kl_divergence,
    measure_fidelity,
    parse_lengths,
    text_token_ids,
    window_offsets,
    write_fidelity,
)

from conftest import VOCAB, tiny_llama, tiny_mistral

SMALL = dict(sink=2, local=4, heavy=6)  # N_c = 12, below every context here
TEXT = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(1))  # a synthetic "text" of ids


@pytest.fixture(scope="module")
def model():
    return tiny_llama(dtype=torch.float64)


def prompts(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate_logits(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate``: (new tokens [B, steps], logits [B, steps, V])."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


# ---- the forced path is the generate path ---------------------------------------------------------

@pytest.mark.parametrize("config", [None, "dense", "ds", "hshare-1_2-1_2-1_2", "hshare-7_8-3_4-1_2"])
def test_forced_logits_equal_generate(model, config):
    """Greedy generate of a config, then forcing its own tokens reproduces its logits exactly:
    the forced path runs the same decode steps (query groups, plan) as generate."""
    ids = prompts(2, 40)
    with hshare.patched(model, config, dense_fallback_mib=0, **SMALL) if config else contextlib.nullcontext():
        tokens, logits = generate_logits(model, ids, 9)
        forced = forced_decode_logits(model, ids, tokens)
        greedy_tokens, greedy_logits = greedy_decode_logits(model, ids, 9)
    assert forced.dtype == torch.float32 and forced.shape == (2, 9, VOCAB)
    torch.testing.assert_close(forced, logits, rtol=0, atol=0)
    assert torch.equal(greedy_tokens, tokens)
    torch.testing.assert_close(greedy_logits, logits, rtol=0, atol=0)


def test_forced_cache_counts_the_decode_steps(model):
    ids = prompts(1, 40)
    with hshare.patched(model, "hshare-1_2-1_2-1_2", dense_fallback_mib=0, **SMALL):
        cache = hshare.new_cache(model)
        forced_decode_logits(model, ids, prompts(1, 8, seed=3), cache)
    assert cache.stats.decode_steps == 7  # the last forced token is never fed
    assert cache.stats.selection_steps == 4  # query groups of 2: steps 1, 3, 5, 7
    assert cache.stats.score_computations > 0


def test_forced_continuation_shape_is_checked(model):
    with pytest.raises(ValueError, match=r"continuation has shape"):
        from hshare.eval.fidelity import _decode
        _decode(model, prompts(2, 10), 4, prompts(1, 4))


# ---- measure_fidelity ---------------------------------------------------------------------------------

def test_dense_preset_agrees_exactly_and_model_is_restored(model):
    results = measure_fidelity(model, TEXT, None, [48], ["dense"], windows=2, steps=6)
    (r,) = results
    assert (r.config, r.length, r.windows, r.steps, r.predictions) == ("dense", 48, 2, 6, 12)
    assert r.agreement == 1.0 and abs(r.kl) < 1e-6 and r.budget is None
    assert r.stats["decode_steps"] == 2 * 5 and r.stats["score_computations"] == 0
    assert patch_state(model) is None


def test_sparse_tiny_budget_departs_from_dense(model):
    results = measure_fidelity(model, TEXT, None, [32, 64], ["dense", "ds", "hshare-1_2-1_2-1_2"], windows=2,
                               steps=8, overrides=SMALL)
    assert [(r.config, r.length) for r in results] == [
        ("dense", 32), ("dense", 64), ("ds", 32), ("ds", 64), ("hshare-1_2-1_2-1_2", 32), ("hshare-1_2-1_2-1_2", 64)]
    by = {(r.config, r.length): r for r in results}
    for config in ("ds", "hshare-1_2-1_2-1_2"):
        for length in (32, 64):
            r = by[config, length]
            assert r.agreement < 1 or r.kl > 1e-6
            assert r.budget == 12 and r.stats["sparse_steps"] == 2 * 7  # dense fallback is off
            assert 0 <= r.agreement <= 1 and r.kl >= 0
    # sharing 1/2-1/2-1/2 scores fewer (row, layer, head) triples than DS
    assert by["hshare-1_2-1_2-1_2", 64].stats["score_computations"] < by["ds", 64].stats["score_computations"]
    # the plan each config ran: ds shares nothing; 1/2-1/2-1/2 half the layers and half of each layer's KV heads
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert by["dense", 64].plan == {}
    assert by["ds", 64].plan == {"layer_copies": 0.0, "head_copies": 0.0, "selecting": 1.0}
    half = by["hshare-1_2-1_2-1_2", 64].plan
    assert half["layer_copies"] == layers - sources_for_ratio(0.5, layers)
    assert half["selecting"] == sources_for_ratio(0.5, layers) * sources_for_ratio(0.5, kv_heads) / (layers * kv_heads)


def test_a_patched_model_gets_its_config_back():
    model = tiny_mistral(sliding_window=24)
    hshare.patch(model, "ds", heavy=5)
    measure_fidelity(model, TEXT, None, [40], ["streaming"], windows=1, steps=4)
    assert patch_state(model).config.budget.heavy == 5


def test_measure_checks_before_any_work(model):
    with pytest.raises(ValueError, match=r"max_position_embeddings 1024; accepted: lengths <= 1000"):
        measure_fidelity(model, TEXT, None, [1001], ["dense"], steps=24)
    with pytest.raises(ValueError, match=r"text has 400 tokens: too short"):
        measure_fidelity(model, TEXT, None, [300], ["dense"], windows=200, steps=4)
    with pytest.raises(hshare.ConfigError, match="unknown HShareConfig option 'heavvy'; did you mean 'heavy'"):
        measure_fidelity(model, TEXT, None, [32], ["dense"], overrides={"heavvy": 3})
    with pytest.raises(hshare.ConfigError, match="unknown preset"):
        measure_fidelity(model, TEXT, None, [32], ["nope"])
    assert patch_state(model) is None


# ---- metrics and windows ----------------------------------------------------------------------------

def test_kl_matches_brute_force():
    generator = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(3, 5, 11, generator=generator), torch.randn(3, 5, 11, generator=generator) * 3
    kl = kl_divergence(p_logits, q_logits)
    assert kl.shape == (3, 5) and kl.dtype == torch.float64
    def softmax(logits):  # pure Python, float64
        weights = [math.exp(x) for x in logits.tolist()]
        return [w / sum(weights) for w in weights]

    for i in range(3):
        for j in range(5):
            p, q = softmax(p_logits[i, j]), softmax(q_logits[i, j])
            expected = sum(pk * math.log(pk / qk) for pk, qk in zip(p, q))
            assert abs(float(kl[i, j]) - expected) < 1e-12
    assert float(kl_divergence(p_logits, p_logits + 7.0).abs().max()) < 1e-12  # shift-invariant, KL(p||p) = 0


def test_window_offsets():
    assert window_offsets(100, 25, 4) == [0, 25, 50, 75]  # non-overlapping, spread to the end
    assert window_offsets(1000, 100, 4) == [0, 300, 600, 900]
    assert window_offsets(50, 50, 1) == [0]
    offsets = window_offsets(60, 25, 4)  # overlapping when the text is short, still distinct
    assert offsets == [0, 11, 23, 35] and len(set(offsets)) == 4
    assert window_offsets(27, 25, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="too short"):
        window_offsets(26, 25, 3)
    with pytest.raises(ValueError, match="accepted: integers >= 1"):
        window_offsets(100, 25, 0)


def test_text_token_ids():
    assert torch.equal(text_token_ids([5, 6, 7]), torch.tensor([5, 6, 7]))
    assert text_token_ids(TEXT).dtype == torch.long
    with pytest.raises(ValueError, match="text must be None"):
        text_token_ids(TEXT, "some text")
    with pytest.raises(ValueError, match="1-D integer"):
        text_token_ids(torch.zeros(2, 3, dtype=torch.long))

    class Tokenizer:
        def __call__(self, text, **kwargs):
            assert kwargs["add_special_tokens"] is False
            return {"input_ids": [ord(c) for c in text]}

    assert text_token_ids(Tokenizer(), "ab").tolist() == [97, 98]


# ---- files --------------------------------------------------------------------------------------------

RESULTS = [
    FidelityResult("dense", 1024, 4, 8, 32, 1.0, 0.0, None, {"decode_steps": 28, "score_computations": 0}),
    FidelityResult("ds@512", 1024, 4, 8, 32, 0.75, 0.0123, 512, {"decode_steps": 28, "score_computations": 900}),
    FidelityResult("ds@512", 2048, 4, 8, 32, 0.5, 0.25, 512, {"decode_steps": 28, "score_computations": 900},
                   {"layer_copies": 0.0, "head_copies": 0.0, "selecting": 1.0}),
]


def test_write_fidelity(tmp_path):
    written = write_fidelity(RESULTS, tmp_path / "out")
    names = [p.name for p in written]
    assert names[:3] == ["fidelity.json", "fidelity.csv", "fidelity.md"]
    data = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert data[1] == {"config": "ds@512", "length": 1024, "windows": 4, "steps": 8, "predictions": 32,
                       "agreement": 0.75, "kl": 0.0123, "budget": 512,
                       "stats": {"decode_steps": 28, "score_computations": 900}, "plan": {}}
    assert data[2]["plan"] == {"layer_copies": 0.0, "head_copies": 0.0, "selecting": 1.0}
    with open(tmp_path / "out" / "fidelity.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["config", "length", "windows", "steps", "predictions", "agreement", "kl", "budget",
                             "decode_steps", "score_computations", "plan_layer_copies", "plan_head_copies",
                             "plan_selecting"]
    assert rows[0]["plan_selecting"] == "" and float(rows[2]["plan_selecting"]) == 1.0
    assert rows[0]["budget"] == "" and rows[2]["config"] == "ds@512" and float(rows[2]["kl"]) == 0.25
    assert (tmp_path / "out" / "fidelity.md").read_text() == (
        "| config | agree 1k | KL 1k | agree 2k | KL 2k |\n"
        "|---|---|---|---|---|\n"
        "| dense | 1.000 | 0 | - | - |\n"
        "| ds@512 | 0.750 | 0.0123 | 0.500 | 0.25 |\n"
    )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert "fidelity.png" in names and (tmp_path / "out" / "fidelity.png").stat().st_size > 0


# ---- the command line -----------------------------------------------------------------------------------

def fidelity_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hshare")
    add_fidelity_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_parse_lengths():
    assert parse_lengths("1k,2k") == [1024, 2048]
    assert parse_lengths("1.5k, 1000,8K") == [1536, 1000, 8192]
    for bad in ("1k,,2k", "abc", "0", "-1k", "1.3k"):
        with pytest.raises(argparse.ArgumentTypeError, match="accepted: comma-separated positive token counts"):
            parse_lengths(bad)


def test_cli_arguments(capsys):
    args = fidelity_parser().parse_args(["fidelity", "--text", "t.txt", "--lengths", "1k,2k", "--configs",
                                         "ds@512,hshare-7_8-3_4-1_2@512", "--set", "heavy=200", "--set",
                                         "dense_layers=[0, 1]"])
    assert args.lengths == [1024, 2048]
    assert args.configs == ["ds@512", "hshare-7_8-3_4-1_2@512"]
    assert dict(args.overrides) == {"heavy": 200, "dense_layers": [0, 1]}
    assert (args.model, args.gguf_file, args.dtype, args.device) == (None, None, "auto", None)
    assert (args.windows, args.steps, args.batch, args.out) == (4, 64, 1, "fidelity-results")
    assert callable(args.run)
    for argv, message in [
        (["--lengths", "1k,two"], "context length 'two'"),
        (["--configs", "nope"], "unknown preset 'nope'"),
        (["--set", "heavvy=3"], "accepted: option=value with an HShareConfig option"),
        (["--set", "heavy"], "accepted: option=value"),
    ]:
        defaults = {"--lengths": "1k", "--configs": "ds"}
        defaults.update(dict(zip(argv[::2], argv[1::2])))
        with pytest.raises(SystemExit):
            fidelity_parser().parse_args(["fidelity", "--text", "t.txt", *[x for kv in defaults.items() for x in kv]])
        assert message in capsys.readouterr().err


class CharTokenizer:
    """A stand-in tokenizer: one id per character (inside the tiny vocabulary)."""

    def __call__(self, text, add_special_tokens=True, **kwargs):
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


def test_cli_runs_end_to_end(tmp_path, monkeypatch, capsys):
    import hshare.default_model

    model = tiny_llama()
    loaded = {}

    def load_model(pretrained=None, gguf_file=None, dtype="auto", device=None):
        loaded.update(pretrained=pretrained, dtype=dtype, device=device)
        return model, CharTokenizer()

    monkeypatch.setattr(hshare.default_model, "load_model", load_model)
    text = tmp_path / "text.txt"
    text.write_text("It was in July, 1805, and the speaker was the well-known Anna Pavlovna Scherer. " * 4)
    args = fidelity_parser().parse_args([
        "fidelity", "--text", str(text), "--lengths", "32,48", "--configs", "dense,ds", "--windows", "2",
        "--steps", "4", "--device", "cpu", "--set", "heavy=6", "--set", "local=4", "--out", str(tmp_path / "out")])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "| config | agree 32 | KL 32 | agree 48 | KL 48 |" in out and "| dense | 1.000 | " in out
    assert loaded == {"pretrained": None, "dtype": "auto", "device": "cpu"}
    data = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert [(r["config"], r["length"], r["budget"]) for r in data] == [
        ("dense", 32, None), ("dense", 48, None), ("ds", 32, 18), ("ds", 48, 18)]
    # dense is exact: its KL is rounding (it sums a GQA head's keys in another order than transformers on CPU)
    assert all(r["kl"] < 1e-12 for r in data if r["config"] == "dense")
    assert patch_state(model) is None

    args.lengths = [1021]
    with pytest.raises(ValueError, match="max_position_embeddings 1024; accepted: lengths <= 1020"):
        args.run(args)
