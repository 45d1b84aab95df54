"""`HShareConfig`: what to keep at each decode step and how selections are shared.

Vocabulary of the HShare paper (Wu et al., ICLR 2025, section 4):

* critical tokens N_c = ``sink`` (first valid tokens) + ``local`` (most recent tokens, the current one
  included) + ``heavy`` (top scorers of the middle window ``[sink, n - local)``);
* approximate scores come from a *selection policy* (``policy``): ``"labels"`` scores tokens on
  ``label_channels`` heavy channels of every cached key, quantized to ``label_bits`` (DoubleSparse,
  HShare); ``"quest"`` scores pages of ``page_size`` columns by the channel-wise min and max of their
  keys (Quest, Tang et al., ICML 2024); ``"loki"`` scores tokens on their keys' top ``loki_rank``
  principal components (Loki, Singhania et al., NeurIPS 2024). Sharing, windows and budgets are the
  same for all;
* sharing ratios a-b-c (section 4.2, eq. 4): ``layer_sharing`` = 1 - k_l / n_l,
  ``head_sharing`` = 1 - k_h / n_h, ``query_sharing`` = 1 / query group size (reselect every
  ``query_group`` decode steps).

Presets live in ``configs/presets/*.yaml``; ``HShareConfig.from_preset("hshare-1_2-1_2-1_2")``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

SELECTION_GRANULARITIES = ("kv_head", "query_head")
PLAN_SCOPES = ("batch", "sample")
PLANNERS = ("greedy", "random")
LABEL_BITS = (4, 8, 16)
PREFIX_MODES = ("auto", "on", "off")
POLICIES = ("labels", "quest", "loki")
# On CUDA, the K/V reads per layer a sparse step must save over a dense one to be faster (`sparse_min_saved_bytes`):
# replayed as CUDA graphs, and eager (host launch cost per layer). Calibrated by `hshare bench grid`.
AUTO_MIN_SAVED_MIB = {"graphs": 96.0, "eager": 768.0}


class ConfigError(ValueError):
    """An invalid `HShareConfig` value; the message names the field and the accepted values."""


def _ratio(name: str, value: Any) -> float:
    """Parse a sharing ratio given as a number or a fraction string ("3/4")."""
    if isinstance(value, str):
        try:
            value = float(Fraction(value.strip()))
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"HShareConfig.{name} = {value!r} is not a number; accepted: a ratio in (0, 1] such as 0.5 or '1/2'")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"HShareConfig.{name} = {value!r} has type {type(value).__name__}; accepted: a ratio in (0, 1]")
    value = float(value)
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ConfigError(f"HShareConfig.{name} = {value} is out of range; accepted: a ratio in (0, 1]")
    return value


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"HShareConfig.{name} = {value!r} has type {type(value).__name__}; accepted: an integer >= {low}")
    if value < low or (high is not None and value > high):
        accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"HShareConfig.{name} = {value} is out of range; accepted: an integer {accepted}")
    return value


def _choice(name: str, value: Any, accepted: tuple) -> Any:
    if value not in accepted:
        raise ConfigError(f"HShareConfig.{name} = {value!r} is invalid; accepted: {', '.join(map(repr, accepted))}")
    return value


@dataclass
class HShareConfig:
    """Validated configuration of HShare sparse decoding.

    Attributes:
        sparse: False = exact dense attention at every step (the ``dense`` preset).
        sink: number of first valid tokens always kept (x in the paper).
        local: number of most recent tokens always kept, current token included (y); >= 1.
        heavy: number of top-scoring middle-window tokens kept (z). N_c = sink + local + heavy.
        label_channels: heavy channels r of each key kept in the label cache (<= head_dim).
        label_bits: 4 (packed two per byte), 8, or 16 bits per label channel.
        layer_sharing: a in a-b-c; round(a * n_layers) layers select, the rest copy an earlier one.
        head_sharing: b; round(b * n_heads) heads of each layer select, the rest copy.
        query_sharing: c = 1 / query group; selection is redone every 1/c decode steps.
        group_lookahead: at a selection step of a query group of a > 1 steps, heavy tokens are
            chosen from the middle window extended by the a - 1 tokens that will leave the local
            window before the next selection. False = the paper's code: a reuse step's local
            window has moved on, and the tokens that left it were never candidates, so nobody
            attends them until the next selection. Same work either way; off by default (its
            fidelity: eval/RESULTS.md).
        dense_layers: layers kept dense at decode (not sparse, not in the layer plan).
        policy: the selection policy (`hshare.policy`): what metadata a sparse layer keeps and how it
            scores tokens. "labels" (DoubleSparse / HShare: label cache of heavy channels) or "quest"
            (per page of `page_size` columns and KV head, the channel-wise min and max of the keys;
            a page's score bounds q . k from above; the heavy budget takes whole pages) or "loki"
            (`hshare.loki`: keys projected on their top `loki_rank` principal components, from each
            row's prompt keys; a token's score is its approximate logit in that subspace).
        page_size: columns per Quest page (16 in the Quest paper); read by "quest" only.
        loki_rank: principal components r of the keys that "loki" keeps (<= head_dim); None =
            head_dim // 4 (a quarter of the head dimension), at least 1. Read by "loki" only.
        sparse_prefill: at prefill, each query row of a sparse layer attends only to its own critical
            tokens (sink + local + the heavy top-k of its causal middle window by the policy's
            scores; rows with no more valid keys than N_c attend densely): the HShare paper's
            Appendix A.1 variant. False = exact dense prefill (the paper's main setting). A shared
            prefix is prefilled exactly for all rows at once, so it does not combine with sparse
            prefill: ``prefix="on"`` is refused, ``prefix="auto"`` does not share.
        selection: "kv_head" (one selection per KV head, read once by its g query heads) or
            "query_head" (one per query head, as the paper's code). Same for MHA.
        plan_scope: "batch" (one plan for the batch, the paper's statement) or "sample".
        planner: "greedy" (Algorithm 1) or "random" (the paper's ablation, same ratios).
        plan_rows: last prefill query rows whose keep-sets are the planner's evidence.
        heavy_channels: "auto" (the calibrated file for the model in configs/channels if one
            exists, else dynamic), "dynamic" (chosen per row from the prompt's |q_c * k_c|), or a
            path to a calibration JSON written by ``hshare calibrate``.
        seed: seed of the random planner.
        dense_fallback_mib: a decode step runs exact dense attention unless sparse attention saves at least
            this many MiB of K/V reads per layer, ``rows x (own columns - N_c) x`` K/V bytes per token:
            below it the sparse step's selection, gather and launches cost more than the reads saved
            (`hshare.step.StepPlanner.sparse_pays`; ``cache.planner.decision`` says what the last step
            chose and why). None = auto: on CUDA 96 for steps replayed as CUDA graphs and 768 for eager
            steps (calibrated by ``hshare bench grid``), 0 elsewhere; 0 = sparse at any size.
        prefix: shared-prefix attention inside ``generate`` (Hydragen): "auto" stores a prompt
            prefix shared by the rows once when it pays (at least `prefix_min_tokens` shared
            tokens, `prefix_min_batch` rows sharing them and `prefix_min_saved_tokens` token reads
            saved per step; the same rule for sparse configs),
            "on" whenever any prefix is shared (the KV memory saving alone), "off" never.
        prefix_min_tokens: shortest prefix (level 1) or group extension (level 2) stored once.
        prefix_min_batch: fewest rows that must share a level for "auto" to store it once.
        prefix_min_saved_tokens: fewest KV token reads per layer and step, (rows - 1) x shared
            tokens, a level must save for "auto" (below it the shared step is slower than per-row
            dense: ``benchmarks/RESULTS.md``). The memory saving holds at any size: ``prefix="on"``
            takes it.
        prefix_levels: 1 (one prefix for all rows) or 2 (plus groups of rows sharing more, e.g. the
            samples of each question after a common few-shot prefix).
        cuda_graphs: on CUDA, ``generate`` decodes with static shapes (buffers sized once for the
            prompt plus ``max_new_tokens`` - 1) and replays each kind of decode step as a CUDA graph
            (`hshare.static_decode`); where that cannot apply (beam search, tensor parallelism, an
            unknown final length...) it decodes eagerly and says why in ``cache.static_decode``.
            False = always eager. Tokens are the same either way.
        compile_elementwise: inside those captured steps, the decoder layers' RMSNorms, rotary
            embedding and MLP activation run as inductor-fused kernels (`hshare.elementwise_fusion`,
            compiled once per shape on first use) instead of about 25 small kernels a layer.
            Results equal the unfused step up to the order of a reduction; False = the model's
            own eager kernels in the graph.
    """

    sparse: bool = True
    sink: int = 8
    local: int = 32
    heavy: int = 88
    label_channels: int = 16
    label_bits: int = 4
    layer_sharing: float = 1.0
    head_sharing: float = 1.0
    query_sharing: float = 1.0
    group_lookahead: bool = False
    dense_layers: tuple[int, ...] = ()
    policy: str = "labels"
    page_size: int = 16
    loki_rank: int | None = None
    sparse_prefill: bool = False
    selection: str = "kv_head"
    plan_scope: str = "batch"
    planner: str = "greedy"
    plan_rows: int = 4
    heavy_channels: str = "auto"
    seed: int = 0
    dense_fallback_mib: float | None = None
    prefix: str = "auto"
    prefix_min_tokens: int = 256
    prefix_min_batch: int = 2
    prefix_min_saved_tokens: int = 131072
    prefix_levels: int = 2
    cuda_graphs: bool = True
    compile_elementwise: bool = True
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.sparse, bool):
            raise ConfigError(f"HShareConfig.sparse = {self.sparse!r} is invalid; accepted: true or false")
        self.sink = _int("sink", self.sink, 0)
        self.local = _int("local", self.local, 1)
        self.heavy = _int("heavy", self.heavy, 0)
        self.label_channels = _int("label_channels", self.label_channels, 1, 1024)
        self.label_bits = _choice("label_bits", self.label_bits, LABEL_BITS)
        if self.label_bits == 4 and self.label_channels % 2:
            raise ConfigError(
                f"HShareConfig.label_channels = {self.label_channels} is odd; accepted with label_bits = 4: an even "
                "number (two 4-bit labels are packed per byte)"
            )
        self.layer_sharing = _ratio("layer_sharing", self.layer_sharing)
        self.head_sharing = _ratio("head_sharing", self.head_sharing)
        self.query_sharing = _ratio("query_sharing", self.query_sharing)
        group = 1.0 / self.query_sharing
        if abs(group - round(group)) > 1e-6:
            raise ConfigError(
                f"HShareConfig.query_sharing = {self.query_sharing} is not 1/a for a whole number a; accepted: 1, 1/2, "
                "1/3, ... (a query group of a steps shares one selection)"
            )
        if not isinstance(self.group_lookahead, bool):
            raise ConfigError(f"HShareConfig.group_lookahead = {self.group_lookahead!r} is invalid; accepted: true or false")
        if isinstance(self.dense_layers, (list, tuple)):
            self.dense_layers = tuple(_int("dense_layers[]", i, 0) for i in self.dense_layers)
        else:
            raise ConfigError(f"HShareConfig.dense_layers = {self.dense_layers!r} is invalid; accepted: a list of layer indices")
        if len(set(self.dense_layers)) != len(self.dense_layers):
            raise ConfigError(f"HShareConfig.dense_layers = {list(self.dense_layers)} repeats a layer; accepted: distinct indices")
        self.policy = _choice("policy", self.policy, POLICIES)
        self.page_size = _int("page_size", self.page_size, 1, 65536)
        if self.loki_rank is not None and (isinstance(self.loki_rank, bool) or not isinstance(self.loki_rank, int)
                                           or not 1 <= self.loki_rank <= 1024):
            raise ConfigError(f"HShareConfig.loki_rank = {self.loki_rank!r} is invalid; accepted: an integer in "
                              "[1, 1024] (at most head_dim), or null for head_dim // 4")
        for name in ("sparse_prefill", "cuda_graphs", "compile_elementwise"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"HShareConfig.{name} = {getattr(self, name)!r} is invalid; accepted: true or false")
        self.selection = _choice("selection", self.selection, SELECTION_GRANULARITIES)
        self.plan_scope = _choice("plan_scope", self.plan_scope, PLAN_SCOPES)
        self.planner = _choice("planner", self.planner, PLANNERS)
        self.plan_rows = _int("plan_rows", self.plan_rows, 1, 256)
        if not isinstance(self.heavy_channels, (str, os.PathLike)):
            raise ConfigError(
                f"HShareConfig.heavy_channels = {self.heavy_channels!r} is invalid; accepted: 'auto', 'dynamic' or a "
                "path to a calibration JSON"
            )
        self.heavy_channels = str(self.heavy_channels)
        if self.heavy_channels not in ("auto", "dynamic") and not Path(self.heavy_channels).is_file():
            raise ConfigError(
                f"HShareConfig.heavy_channels = {self.heavy_channels!r} is not an existing file; accepted: 'auto', "
                "'dynamic' or the path of a calibration JSON (hshare calibrate)"
            )
        self.seed = _int("seed", self.seed, 0)
        if self.dense_fallback_mib is not None:
            if isinstance(self.dense_fallback_mib, bool) or not isinstance(self.dense_fallback_mib, (int, float)) \
                    or not self.dense_fallback_mib >= 0:
                raise ConfigError(f"HShareConfig.dense_fallback_mib = {self.dense_fallback_mib!r} is invalid; accepted: "
                                  "a number of MiB >= 0, or null for the device's default")
            self.dense_fallback_mib = float(self.dense_fallback_mib)
        self.prefix = _choice("prefix", self.prefix, PREFIX_MODES)
        self.prefix_min_tokens = _int("prefix_min_tokens", self.prefix_min_tokens, 1)
        self.prefix_min_batch = _int("prefix_min_batch", self.prefix_min_batch, 1)
        self.prefix_min_saved_tokens = _int("prefix_min_saved_tokens", self.prefix_min_saved_tokens, 0)
        self.prefix_levels = _int("prefix_levels", self.prefix_levels, 1, 2)
        if self.sparse_prefill and self.prefix == "on":
            raise ConfigError(
                "HShareConfig.sparse_prefill = True with prefix = 'on' is invalid: a shared prefix is prefilled "
                "exactly, once for all rows, while sparse prefill selects per row; accepted: sparse_prefill with "
                "prefix 'off' or 'auto' (which then does not share), or prefix 'on' without sparse_prefill"
            )

    # ---- derived quantities -------------------------------------------------------------
    @property
    def budget(self) -> int:
        """N_c: critical tokens attended per selection head at each sparse decode step."""
        return self.sink + self.local + self.heavy

    @property
    def query_group(self) -> int:
        """a: decode steps that share one selection."""
        return int(round(1.0 / self.query_sharing))

    @property
    def shares_layers_or_heads(self) -> bool:
        return self.layer_sharing < 1.0 or self.head_sharing < 1.0

    @property
    def shares_prefix(self) -> bool:
        """Whether ``generate`` looks for a shared prompt prefix (never with sparse prefill)."""
        return self.prefix != "off" and not self.sparse_prefill

    def sparse_min_saved_bytes(self, device: torch.device, graphs: bool) -> float:
        """The K/V bytes per layer a sparse decode step must save to run on `device` (`dense_fallback_mib`),
        for steps replayed as CUDA graphs or run eagerly."""
        mib = self.dense_fallback_mib
        if mib is None:
            mib = AUTO_MIN_SAVED_MIB["graphs" if graphs else "eager"] if device.type == "cuda" else 0.0
        return mib * 2**20

    def validate_for_model(self, num_layers: int, head_dim: int) -> None:
        """Checks that need the model's shape; raises `ConfigError` naming the field."""
        bad = [i for i in self.dense_layers if i >= num_layers]
        if bad:
            raise ConfigError(
                f"HShareConfig.dense_layers = {list(self.dense_layers)} names layer(s) {bad} but the model has "
                f"{num_layers} layers; accepted: indices in [0, {num_layers - 1}]"
            )
        if self.sparse and self.policy == "labels" and self.label_channels > head_dim:
            raise ConfigError(
                f"HShareConfig.label_channels = {self.label_channels} exceeds the model's head_dim {head_dim}; "
                f"accepted: 1..{head_dim}"
            )
        if self.sparse and self.policy == "loki" and self.loki_rank is not None and self.loki_rank > head_dim:
            raise ConfigError(f"HShareConfig.loki_rank = {self.loki_rank} exceeds the model's head_dim {head_dim}; "
                              f"accepted: 1..{head_dim}, or null for head_dim // 4")

    def with_budget(self, budget: int) -> "HShareConfig":
        """This config at N_c = `budget` critical tokens (``"<preset>@<N_c>"`` names and the ``budget=``
        override): sink ``min(16, N_c // 16)``, local ``min(64, N_c // 4)`` and the rest heavy; a config
        that scores nothing (``heavy = 0``, StreamingLLM) keeps the rest local. At N_c = 128 this is the
        base presets' 8 + 32 + 88, at 512 the ``@512`` presets' 16 + 64 + 432, at 2048 16 + 64 + 1968: a
        long context gains heavy tokens, chosen by score, while sink and local stay small."""
        budget = _int("budget", budget, 2)
        sink = min(16, budget // 16)
        if self.heavy == 0:
            return self.replace(sink=sink, local=budget - sink)
        local = min(64, budget // 4)
        return self.replace(sink=sink, local=local, heavy=budget - sink - local)

    def replace(self, **changes: Any) -> "HShareConfig":
        """A copy with some fields changed (validated); unknown field names raise `ConfigError`."""
        _check_field_names(changes)
        return dataclasses.replace(self, **changes)

    # ---- loading ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "custom") -> "HShareConfig":
        _check_field_names(data)
        data = dict(data)
        if "dense_layers" in data and isinstance(data["dense_layers"], list):
            data["dense_layers"] = tuple(data["dense_layers"])
        data.setdefault("name", name)
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "HShareConfig":
        path = Path(path)
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} does not hold a mapping of HShareConfig fields")
        return cls.from_dict(data, name=path.stem)

    @classmethod
    def from_preset(cls, name: str) -> "HShareConfig":
        """A preset by name: a file of ``configs/presets``, or ``"<preset>@<N_c>"``, the preset at that
        budget (`with_budget`), e.g. ``"hshare-1_2-1_2-1_2@2048"`` for long contexts."""
        path = preset_dir() / f"{name}.yaml"
        if path.is_file():
            return cls.from_yaml(path)
        base, at, size = name.partition("@")
        if at and (preset_dir() / f"{base}.yaml").is_file():
            if not size.isdigit():
                raise ConfigError(f"preset {name!r}: the budget after '@' is {size!r}; accepted: a number of critical "
                                  f"tokens, e.g. {base}@2048")
            return dataclasses.replace(cls.from_yaml(preset_dir() / f"{base}.yaml").with_budget(int(size)), name=name)
        raise ConfigError(f"unknown preset {name!r}; accepted: {', '.join(preset_names())}, any of them at another "
                          "budget as '<preset>@<N_c>' (e.g. hshare-1_2-1_2-1_2@2048), or a YAML path")


def _check_field_names(names) -> None:
    """Raise `ConfigError` for names that are not `HShareConfig` fields, suggesting the closest."""
    import difflib

    known = sorted(f.name for f in dataclasses.fields(HShareConfig))
    for name in sorted(set(names) - set(known)):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown HShareConfig field {name!r}; {hint}accepted fields: "
                          f"{', '.join(k for k in known if k != 'name')}")


def preset_dir() -> Path:
    return Path(str(resources.files("hshare.configs"))) / "presets"


NAMED_BUDGETS = (512, 1024, 2048, 4096)  # the sparse presets are also listed at these N_c ("<preset>@<N_c>")


def preset_names() -> list[str]:
    """The preset files' names, and each sparse preset at `NAMED_BUDGETS` (any other N_c resolves too)."""
    names = []
    for name in sorted(p.stem for p in preset_dir().glob("*.yaml")):
        names.append(name)
        if HShareConfig.from_yaml(preset_dir() / f"{name}.yaml").sparse:
            names += [f"{name}@{budget}" for budget in NAMED_BUDGETS]
    return names


def resolve_config(config: "HShareConfig | str | os.PathLike | None", **overrides: Any) -> HShareConfig:
    """A config object, a preset name, or a YAML path -> `HShareConfig` (with field overrides; ``budget=N_c``
    resizes it first, `HShareConfig.with_budget`, and explicit ``sink``/``local``/``heavy`` win over it)."""
    budget = overrides.pop("budget", None)
    if config is None:
        config = "hshare-1_2-1_2-1_2"
    if isinstance(config, HShareConfig):
        resolved = config
    elif isinstance(config, (str, os.PathLike)):
        text = str(config)
        if text.endswith((".yaml", ".yml")) or os.sep in text:
            if not Path(text).is_file():
                raise ConfigError(f"config file {text!r} does not exist")
            resolved = HShareConfig.from_yaml(text)
        else:
            resolved = HShareConfig.from_preset(text)
    else:
        raise ConfigError(
            f"config = {config!r} has type {type(config).__name__}; accepted: an HShareConfig, a preset name "
            f"({', '.join(preset_names())}) or a YAML path"
        )
    if budget is not None:
        resolved = resolved.with_budget(budget)
    return resolved.replace(**overrides) if overrides else resolved
