"""The demo's measures and preset handling, without the model (the model's path: test_default_model.py)."""

import pytest
import torch

import hshare.demo as demo
from hshare.config import ConfigError


def test_token_agreement_by_hand():
    reference = torch.tensor([[5, 6, 7, 0], [1, 2, 0, 0]])  # 0 pads a row that ended
    generated = torch.tensor([[5, 9, 7, 4], [1, 3, 8, 0]])
    # counted: 3 + 2 reference tokens; equal: 5, 7 and 1
    assert demo.token_agreement(generated, reference, pad_token_id=0) == pytest.approx(3 / 5)
    # every reference token counted; a shorter generation misses the tokens it lacks
    assert demo.token_agreement(generated[:, :2], reference) == pytest.approx(2 / 8)


def test_common_prefix_tokens_by_hand():
    reference = torch.tensor([[5, 6, 7], [1, 2, 3], [4, 4, 4]])
    generated = torch.tensor([[5, 6, 9], [0, 2, 3], [4, 4, 4]])
    # leading equal tokens: 2, 0 (a later match does not count), 3
    assert demo.common_prefix_tokens(generated, reference) == pytest.approx(5 / 3)


@pytest.mark.parametrize("text,number", [("so 48+24 = 72 clips.", "72"), ("The answer is 1,234.", "1234"),
                                         ("it costs 18.0 dollars", "18"), ("no number", None)])
def test_last_number(text, number):
    assert demo.last_number(text) == number


def test_gsm8k_gold():
    assert demo.gsm8k_gold("48/2 = 24\n#### 1,072") == "1072"
    assert demo.gsm8k_gold("no marker") is None


@pytest.mark.parametrize("preset,expected", [
    ("dense+prefix", ("dense", True)),
    ("hshare-auto+group_lookahead=true", ("hshare-auto+group_lookahead=true", False)),
    ("hshare-auto@512+group_lookahead=true+prefix", ("hshare-auto@512+group_lookahead=true", True)),
])
def test_presets_with_options_and_the_shared_prefix(preset, expected):
    assert demo._split_preset(preset) == expected


@pytest.mark.parametrize("preset", ["hshare-nonexistent", "hshare-auto+no_such_option=1", "ds+heavy=-3"])
def test_a_bad_preset_is_refused_before_the_model_loads(monkeypatch, preset):
    def load():
        raise AssertionError("the model loaded before the presets were checked")

    monkeypatch.setattr(demo, "load_default_model", load)
    with pytest.raises(ConfigError):
        demo.run_demo(presets=("dense", preset))


def test_the_default_presets_resolve():
    for preset in demo.DEMO_PRESETS:
        demo.resolve_config(demo._split_preset(preset)[0])
