import dataclasses

import pytest
import torch
import yaml

import hshare
from hshare.config import (BudgetConfig, ConfigError, HShareConfig, PlannerConfig, PrefixConfig, RuntimeConfig,
                           SharingConfig, resolve_config)

from conftest import tiny_llama


def test_presets_load_with_paper_budgets():
    names = hshare.preset_names()
    for base in ("ds", "streaming", "hshare-7_8-3_4-1_2", "hshare-3_4-3_4-1_2", "hshare-1_2-1_2-1_2"):
        small, large = HShareConfig.from_preset(base), HShareConfig.from_preset(base + "@512")
        assert (small.budget.total, large.budget.total) == (128, 512), base
    assert "dense" in names and not HShareConfig.from_preset("dense").sparse
    ds = HShareConfig.from_preset("ds")
    assert (ds.budget.sink, ds.budget.local, ds.budget.heavy) == (8, 32, 88)
    assert (ds.sharing.layer, ds.sharing.head, ds.sharing.query_group) == (1.0, 1.0, 1)
    big = HShareConfig.from_preset("hshare-7_8-3_4-1_2@512")
    assert (big.budget.sink, big.budget.local, big.budget.heavy) == (16, 64, 432)
    assert (big.sharing.layer, big.sharing.head, big.sharing.query_group) == (0.875, 0.75, 2)


@pytest.mark.parametrize("budget,split", [(128, (8, 32, 88)), (512, (16, 64, 432)), (1024, (16, 64, 944)),
                                          (2048, (16, 64, 1968)), (4096, (16, 64, 4016)), (40, (2, 10, 28))])
def test_a_budget_by_name_keeps_the_preset_and_splits_sink_local_heavy(budget, split):
    for base in ("ds", "hshare-1_2-1_2-1_2", "hshare-7_8-3_4-1_2", "quest", "random-1_2-1_2-1_2"):
        plain = HShareConfig.from_preset(base)
        sized = HShareConfig.from_preset(f"{base}@{budget}")
        assert (sized.budget.sink, sized.budget.local, sized.budget.heavy) == split and sized.budget.total == budget
        assert sized.name == f"{base}@{budget}"
        assert sized.replace(sink=plain.budget.sink, local=plain.budget.local, heavy=plain.budget.heavy) == plain  # nothing else moved
    streaming = HShareConfig.from_preset(f"streaming@{budget}")  # no scoring: the rest is local
    assert (streaming.budget.sink, streaming.budget.local, streaming.budget.heavy) == (split[0], budget - split[0], 0)
    assert resolve_config("ds", budget=budget) == HShareConfig.from_preset(f"ds@{budget}")


def test_a_preset_string_takes_options_after_plus():
    """``"<preset>@<N_c>+FIELD=VALUE..."`` is the preset with those options, wherever a preset name is taken
    (`resolve_config`: `hshare.patch`, eval, fidelity, bench); keyword overrides win over the string's."""
    wide = resolve_config("hshare-refine-successors@512+candidates=4")
    assert wide.replace(name="x") == HShareConfig.from_preset("hshare-refine-successors-c4@512").replace(name="x")
    assert wide.name == "hshare-refine-successors@512+candidates=4"
    config = resolve_config("ds@1024+sharing.query=1/2+dense_fallback_mib=0+sink=4", sink=8)
    plain = HShareConfig.from_preset("ds@1024")
    assert (config.budget.sink, config.budget.local, config.runtime.dense_fallback_mib) == (8, plain.budget.local, 0)
    assert config.sharing.query != plain.sharing.query
    assert config.replace(sink=plain.budget.sink, query_sharing=plain.sharing.query,
                          dense_fallback_mib=plain.runtime.dense_fallback_mib, name=plain.name) == plain
    assert resolve_config("ds+sink=4", budget=1024).budget.sink == 4  # the string's options win over the budget
    assert resolve_config("ds+budget=1024") == resolve_config("ds", budget=1024).replace(name="ds+budget=1024")
    with pytest.raises(ConfigError, match="override 'candidates' is not FIELD=VALUE"):
        resolve_config("hshare-refine@512+candidates")
    with pytest.raises(ConfigError, match="unknown|accepted"):
        resolve_config("ds@512+no_such_option=1")


def test_a_budget_override_yields_to_explicit_windows_and_names_are_listed():
    config = resolve_config("hshare-1_2-1_2-1_2", budget=2048, heavy=1000)
    assert (config.budget.sink, config.budget.local, config.budget.heavy) == (16, 64, 1000)
    names = hshare.preset_names()
    assert {"hshare-1_2-1_2-1_2@2048", "ds@4096", "quest@1024", "streaming@512"} <= set(names)
    assert not any(name.startswith("dense@") for name in names)
    for name in names:
        assert HShareConfig.from_preset(name).name == name


@pytest.mark.parametrize("name,words", [("ds@lots", "budget after '@'.*accepted"), ("nope@512", "unknown preset"),
                                        ("ds@1", "budget.*out of range")])
def test_a_bad_budget_name_is_refused_naming_it(name, words):
    with pytest.raises(ConfigError, match=words):
        HShareConfig.from_preset(name)


@pytest.mark.parametrize("field,value,words", [
    ("sink", -1, "sink"), ("local", 0, "local"), ("heavy", 1.5, "heavy"),
    ("label_bits", 3, "label_bits"), ("label_channels", 0, "label_channels"),
    ("label_channels", 15, "even"), ("layer_sharing", 0.0, "layer_sharing"),
    ("head_sharing", 1.5, "head_sharing"), ("query_sharing", 0.4, "query_sharing"),
    ("query_sharing", "x/y", "query_sharing"), ("selection", "token", "selection"),
    ("plan_scope", "layer", "plan_scope"), ("planner", "best", "planner"), ("plan_rows", 0, "plan_rows"),
    ("heavy_channels", "/no/such/file.json", "heavy_channels"),
    ("dense_layers", [1, 1], "dense_layers"), ("sparse", "yes", "sparse"),
])
def test_invalid_fields_name_the_field(field, value, words):
    with pytest.raises(ConfigError, match=words) as info:
        HShareConfig(**{field: value})
    assert "accepted" in str(info.value)


def test_fraction_strings_and_overrides():
    config = resolve_config("hshare-3_4-3_4-1_2", heavy=40, query_sharing="1/4")
    assert config.sharing.layer == 0.75 and config.budget.heavy == 40 and config.sharing.query_group == 4


def test_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve_config("hshare-9_9")
    with pytest.raises(ConfigError, match="unknown HShareConfig option 'budgett'"):
        HShareConfig.from_dict({"budgett": 3})
    with pytest.raises(ConfigError, match="accepted"):
        resolve_config(42)


def test_yaml_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("sink: 4\nlocal: 8\nheavy: 20\nhead_sharing: '1/2'\n")
    config = resolve_config(str(path))
    assert config.budget.total == 32 and config.sharing.head == 0.5 and config.name == "mine"


def test_model_dependent_checks():
    model = tiny_llama()
    with pytest.raises(ConfigError, match="dense_layers"):
        hshare.patch(model, "ds", dense_layers=[7])
    with pytest.raises(ConfigError, match="head_dim"):
        hshare.patch(model, "ds", label_channels=32)  # head_dim is 16
    assert "hshare_cache" not in str(model.config._attn_implementation)


def test_unsupported_model_names_supported_types():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(hshare.UnsupportedModelError, match="llama, mistral"):
        hshare.patch(model)
    with pytest.raises(hshare.UnsupportedModelError):
        hshare.patch(torch.nn.Linear(2, 2))


def test_misspelt_field_names_the_closest_accepted_field():
    with pytest.raises(ConfigError, match="unknown HShareConfig option 'heavyy'; did you mean 'heavy'"):
        hshare.HShareConfig.from_preset("ds").replace(heavyy=10)
    with pytest.raises(ConfigError, match="did you mean 'query_sharing'"):
        hshare.HShareConfig.from_dict({"query_shareing": 0.5})
    with pytest.raises(ConfigError, match="unknown HShareConfig option 'zzz'; accepted: .*dense_fallback_mib"):
        hshare.HShareConfig().replace(zzz=1)


# ---- sections ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dense", "ds@512", "hshare-7_8-3_4-1_2", "quest-1_2-1_2-1_2@1024", "loki", "streaming"])
def test_every_preset_round_trips_through_its_sections(name, tmp_path):
    config = HShareConfig.from_preset(name)
    assert HShareConfig.from_dict(config.to_dict()) == config
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    assert resolve_config(str(path)) == config


def test_flat_dotted_and_sectioned_spellings_build_the_same_config():
    flat = HShareConfig(sink=4, local=12, heavy=48, layer_sharing="1/2", query_sharing="1/4", planner="random",
                        prefix="off", policy="quest", page_size=8, cuda_graphs=False)
    dotted = HShareConfig(**{"budget.sink": 4, "budget.local": 12, "budget.heavy": 48, "sharing.layer": 0.5,
                             "sharing.query": 0.25, "planner.method": "random", "prefix.mode": "off",
                             "policy.name": "quest", "policy.page_size": 8, "runtime.cuda_graphs": False})
    sectioned = HShareConfig(budget=BudgetConfig(4, 12, 48), sharing=SharingConfig(layer=0.5, query=0.25),
                             planner=PlannerConfig(method="random"), prefix=PrefixConfig(mode="off"),
                             policy={"name": "quest", "page_size": 8}, runtime=RuntimeConfig(cuda_graphs=False))
    assert flat == dotted == sectioned
    assert flat.budget.total == 64 and flat.sharing.query_group == 4 and flat.policy.page_size == 8


def test_prefix_mode_on_and_off_as_yaml_reads_them():
    """YAML 1.1 reads unquoted on / off as booleans: a preset's ``mode: off`` and an override's ``prefix=off``
    mean the modes, not an error."""
    for text in ("ds@512+prefix.mode=off", "ds@512+prefix=off"):
        assert resolve_config(text).prefix.mode == "off"
    assert resolve_config("ds@512+prefix.mode=on").prefix.mode == "on"
    assert HShareConfig.from_dict(yaml.safe_load("prefix: {mode: off}")).prefix.mode == "off"
    with pytest.raises(ConfigError, match="prefix.mode = 'sometimes' is invalid; accepted: 'auto', 'on', 'off'"):
        resolve_config("ds@512+prefix.mode=sometimes")


def test_replace_merges_a_mapping_into_its_section_and_keeps_the_rest():
    base = resolve_config("hshare-1_2-1_2-1_2@512")
    changed = base.replace(sharing={"layer": "3/4"}, budget=1024)
    assert changed.sharing == SharingConfig(layer=0.75, head=0.5, query=0.5)
    assert changed.budget == BudgetConfig.split(1024) and changed.policy == base.policy
    assert base.replace(policy="labels") == base  # the same policy keeps its options
    assert base.replace(label_channels=8).replace(policy="quest").policy.page_size == 16  # a new one starts afresh
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.sharing.layer = 0.25


def test_an_invalid_value_names_its_section_field_and_the_option_as_given():
    with pytest.raises(ConfigError, match=r"HShareConfig.sharing.layer = 0.0 is out of range.*\(set as 'layer_sharing'\)"):
        HShareConfig(layer_sharing=0)
    with pytest.raises(ConfigError, match=r"HShareConfig.sharing has no field 'layr'; did you mean 'layer'"):
        HShareConfig(sharing={"layr": 0.5})
    with pytest.raises(ConfigError, match="'page_size' belongs to the 'quest' policy, but the config's policy is 'labels'"):
        resolve_config("ds", page_size=8)
    with pytest.raises(ConfigError, match="HShareConfig.budget = 'x' is invalid; accepted: a BudgetConfig"):
        HShareConfig().replace(budget="x")
    with pytest.raises(ConfigError, match="sparse_prefill = True with prefix.mode = 'on'"):
        HShareConfig(sparse_prefill=True, prefix="on")
