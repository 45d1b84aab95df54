"""`HShareConfig`: what a patched model keeps at each decode step and how selections are shared.

The contract. One `HShareConfig` holds ``sparse`` (False = exact dense attention, the ``dense``
preset) and six sections, each a validated frozen dataclass:

* ``budget`` (`BudgetConfig`): the critical tokens N_c = ``sink`` (first valid tokens) + ``local``
  (most recent, the current one included) + ``heavy`` (top scorers of the middle window
  ``[sink, n - local)``); ``budget.total`` is N_c (HShare section 4).
* ``sharing`` (`SharingConfig`): the sharing ratios a-b-c (section 4.2, eq. 4): ``layer`` =
  1 - k_l / n_l, ``head`` = 1 - k_h / n_h, ``query`` = 1 / query group (reselect every
  ``query_group`` steps); ``lookahead``; ``dense_layers``.
* ``planner`` (`PlannerConfig`): how the sharing plan is made from the prefill's evidence.
* ``policy``: the selection policy's own section, a `PolicyConfig` subclass that the policy's module
  defines and registers (`hshare.policy.register_policy`): ``policy.name`` is ``"labels"``
  (`hshare.labels.LabelsConfig`), ``"quest"`` (`hshare.quest.QuestConfig`) or ``"loki"``
  (`hshare.loki.LokiConfig`). A new policy brings its section with it; this module names none.
* ``prefix`` (`PrefixConfig`): shared-prefix attention inside ``generate`` (Hydragen).
* ``runtime`` (`RuntimeConfig`): how steps run (CUDA graphs, fused elementwise kernels, the
  dense-or-sparse rule, sparse prefill); tokens do not depend on it except through sparse prefill.

Building one, in one line: ``HShareConfig(sharing=SharingConfig(layer=0.5))``, or with the flat
names of `OPTION_NAMES` (``HShareConfig(layer_sharing=0.5, heavy=432)``), or a preset
(``resolve_config("hshare-1_2-1_2-1_2@2048", layer_sharing="3/4")``). A section may also be given as
a mapping (``sharing={"layer": "1/2"}``), and a field by its dotted name (``"sharing.layer"``) where
names are strings (YAML, ``--set``, ``model_args``). YAML files hold either form. Every value is
checked when the config is made; a bad one raises `ConfigError` naming the field and what is
accepted. Configs are immutable: `HShareConfig.replace` makes a changed copy.

Presets live in ``configs/presets/*.yaml``; ``HShareConfig.from_preset("hshare-1_2-1_2-1_2")``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch
import yaml

SELECTION_GRANULARITIES = ("kv_head", "query_head")
PLAN_SCOPES = ("batch", "sample")
PLANNERS = ("greedy", "random", "auto")
PREFIX_MODES = ("auto", "on", "off")
REFINE_BY = ("labels", "keys")  # what a candidate refinement ranks by (`SharingConfig.refine_by`)
# On CUDA, the K/V reads per layer a sparse step must save over a dense one to be faster
# (`RuntimeConfig.sparse_min_saved_bytes`): replayed as CUDA graphs, and eager (host launch cost per
# layer). Calibrated by `hshare bench grid`.
AUTO_MIN_SAVED_MIB = {"graphs": 96.0, "eager": 768.0}
# The token reads per layer and step a shared prefix level must save for ``prefix="auto"`` to hold it
# once (`PrefixConfig.min_saved`): decode steps replayed as CUDA graphs (both paths one launch; the shared
# one was no slower at every shape ``benchmarks/prefix_crossover.py`` measured, from the fewest a level of
# the default 256 tokens over 2 rows saves), and eager or off CUDA (the shared step's host launch cost).
AUTO_PREFIX_MIN_SAVED_TOKENS = {"graphs": 256, "eager": 131072}


class ConfigError(ValueError):
    """An invalid `HShareConfig` value; the message names the field and the accepted values."""


# ---- field checks (each returns the normalized value) ------------------------------------------
def check_ratio(name: str, value: Any) -> float:
    """A sharing ratio given as a number or a fraction string ("3/4"), in (0, 1]."""
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


def check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"HShareConfig.{name} = {value!r} has type {type(value).__name__}; accepted: an integer >= {low}")
    if value < low or (high is not None and value > high):
        accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"HShareConfig.{name} = {value} is out of range; accepted: an integer {accepted}")
    return value


def check_choice(name: str, value: Any, accepted: tuple) -> Any:
    if value not in accepted:
        raise ConfigError(f"HShareConfig.{name} = {value!r} is invalid; accepted: {', '.join(map(repr, accepted))}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"HShareConfig.{name} = {value!r} is invalid; accepted: true or false")
    return value


def _set(section: Any, name: str, value: Any) -> None:
    """Store a normalized value on a frozen section (in `__post_init__` only)."""
    object.__setattr__(section, name, value)


# ---- the sections --------------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetConfig:
    """The critical tokens of a sparse decode step (x, y, z of the paper).

    Attributes:
        sink: first valid tokens always kept.
        local: most recent tokens always kept, the current one included; >= 1.
        heavy: top-scoring middle-window tokens kept; 0 scores nothing (StreamingLLM).
    """

    sink: int = 8
    local: int = 32
    heavy: int = 88

    def __post_init__(self) -> None:
        _set(self, "sink", check_int("budget.sink", self.sink, 0))
        _set(self, "local", check_int("budget.local", self.local, 1))
        _set(self, "heavy", check_int("budget.heavy", self.heavy, 0))

    @property
    def total(self) -> int:
        """N_c: critical tokens attended per selection head at each sparse decode step."""
        return self.sink + self.local + self.heavy

    @classmethod
    def split(cls, total: int, scores: bool = True) -> "BudgetConfig":
        """N_c = `total` as the presets split it: sink ``min(16, N_c // 16)``, local ``min(64, N_c // 4)``,
        the rest heavy; a budget that scores nothing (`scores` False) keeps the rest local. 128 gives
        8 + 32 + 88, 512 16 + 64 + 432, 2048 16 + 64 + 1968: a long context gains heavy tokens, chosen
        by score, while sink and local stay small."""
        total = check_int("budget.total", total, 2)
        sink = min(16, total // 16)
        if not scores:
            return cls(sink=sink, local=total - sink, heavy=0)
        local = min(64, total // 4)
        return cls(sink=sink, local=local, heavy=total - sink - local)


@dataclass(frozen=True)
class SharingConfig:
    """How one selection is shared (HShare section 4.2).

    Attributes:
        layer: a in a-b-c; round(a * n_layers) layers select, the rest copy an earlier one.
        head: b; round(b * n_heads) heads of each layer select, the rest copy.
        query: c = 1 / query group; selection is redone every 1/c decode steps.
        lookahead: at a selection step of a query group of a > 1 steps, heavy tokens are chosen from
            the middle window extended by the a - 1 tokens that will leave the local window before
            the next selection. False = the paper's code (those tokens are never candidates until
            the next selection). Same work either way.
        dense_layers: layers kept dense at decode (not sparse, not in the layer plan).
        candidates: candidate-set refinement, as C / heavy. 1 = off: a reusing step, head or layer
            takes its source's heavy columns as they are (the paper). Above 1, a selecting head keeps
            its top C = round(candidates x heavy) selectable columns as a candidate set that the
            heads, layers and steps reusing its selection share; each of them refines the set to its
            own top `heavy` by scoring only the candidates' metadata with its own query
            (`hshare.refine`, `SelectionPolicy.candidate_scores`).
        refine_steps: with candidates, the later steps of a query group refine the candidates with their
            own query (True); False: they take the columns their layer and head kept at the group's selection
            step, as without candidates (a step's refinements, a launch a layer, only at selection steps; the
            heads and layers sharing a selection still refine it there).
        refine_by: with candidates, what a refinement ranks the candidates by: "labels" (the policy's
            approximate scores, `SelectionPolicy.candidate_heavy`) or "keys" (their exact logits q . k,
            summed over the KV head's query group, read from the KV cache: C key rows a refinement
            instead of C label rows; a selecting head's heavy columns are then its top `heavy` candidates
            by exact logits too, so the labels only pick the C candidates). "keys" needs one selection a
            KV head (``planner.selection = "kv_head"``).
        successors: a selecting head walks its top columns (its heavy columns, or with refinement its C
            candidates) in rank order and keeps each with the column after it (its successor, where
            selectable and not already kept) until as many are kept: without adjacent top columns, the
            top half and their successors. A copying (induction) head attends the column after its last
            match, one column on at each step and one column after the head that found the match, so a
            reusing step or a later layer can still reach it. False = the top columns.
    """

    layer: float = 1.0
    head: float = 1.0
    query: float = 1.0
    lookahead: bool = False
    dense_layers: tuple[int, ...] = ()
    candidates: float = 1.0
    refine_steps: bool = True
    refine_by: str = "labels"
    successors: bool = False

    def __post_init__(self) -> None:
        for name in ("layer", "head", "query"):
            _set(self, name, check_ratio(f"sharing.{name}", getattr(self, name)))
        group = 1.0 / self.query
        if abs(group - round(group)) > 1e-6:
            raise ConfigError(
                f"HShareConfig.sharing.query = {self.query} is not 1/a for a whole number a; accepted: 1, 1/2, "
                "1/3, ... (a query group of a steps shares one selection)"
            )
        check_bool("sharing.lookahead", self.lookahead)
        if not isinstance(self.dense_layers, (list, tuple)):
            raise ConfigError(f"HShareConfig.sharing.dense_layers = {self.dense_layers!r} is invalid; accepted: a list "
                              "of layer indices")
        layers = tuple(check_int("sharing.dense_layers[]", i, 0) for i in self.dense_layers)
        if len(set(layers)) != len(layers):
            raise ConfigError(f"HShareConfig.sharing.dense_layers = {list(layers)} repeats a layer; accepted: distinct "
                              "indices")
        _set(self, "dense_layers", layers)
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, (int, float)) \
                or not 1.0 <= self.candidates <= 64.0:
            raise ConfigError(f"HShareConfig.sharing.candidates = {self.candidates!r} is invalid; accepted: a number "
                              "in [1, 64], C / heavy (1 = no refinement)")
        _set(self, "candidates", float(self.candidates))
        check_bool("sharing.refine_steps", self.refine_steps)
        check_choice("sharing.refine_by", self.refine_by, REFINE_BY)
        check_bool("sharing.successors", self.successors)

    @property
    def query_group(self) -> int:
        """a: decode steps that share one selection."""
        return int(round(1.0 / self.query))

    @property
    def shares_layers_or_heads(self) -> bool:
        return self.layer < 1.0 or self.head < 1.0


@dataclass(frozen=True)
class PlannerConfig:
    """How the sharing plan is made (Algorithm 1) and at what granularity selections are made.

    Attributes:
        selection: "kv_head" (one selection per KV head, read once by its g query heads) or
            "query_head" (one per query head, as the paper's code). Same for MHA.
        scope: "batch" (one plan for the batch, the paper's statement) or "sample".
        method: "greedy" (Algorithm 1) or "random" (the paper's ablation, same ratios), or "auto":
            Algorithm 1 that shares only where the prefill evidence is similar enough: a head or layer
            copies another while the most similar remaining pair reaches `similarity`, so each layer
            gets its own head sharing and the layer sharing follows the evidence; the sharing ratios
            then bound how far it may share (at least that share of layers and heads still selects).
            With `scorings`, "auto" meets a scoring budget instead of a similarity.
        rows: last prefill query rows whose keep-sets are the planner's evidence.
        seed: seed of the random planner.
        similarity: the "auto" planner's target in [0, 1]: the least evidence similarity (`hshare.planner`:
            the share of a node's keep-set its source keeps) at which a pair shares.
        scorings: the "auto" planner's scoring budget, a ratio in (0, 1] (None: the `similarity` target): the
            share of a selection step's (layer, selection head) pairs that still score the whole context.
            Layer and head copies are taken together, the most similar first, until the selecting pairs are
            at most that share (`hshare.planner.budget_copies`); the sharing ratios bound them as above. With
            two `rows` or more, each dimension's copies are ordered on the even rows and compared by their
            similarity on the odd ones (held out, so that the best of many noisy head pairs does not look
            better than it is).
            Query sharing divides the full-context scorings further. A batch plan only (`scope` "batch").
    """

    selection: str = "kv_head"
    scope: str = "batch"
    method: str = "greedy"
    rows: int = 4
    seed: int = 0
    similarity: float = 0.8
    scorings: float | None = None

    def __post_init__(self) -> None:
        check_choice("planner.selection", self.selection, SELECTION_GRANULARITIES)
        check_choice("planner.scope", self.scope, PLAN_SCOPES)
        check_choice("planner.method", self.method, PLANNERS)
        check_int("planner.rows", self.rows, 1, 256)
        check_int("planner.seed", self.seed, 0)
        if isinstance(self.similarity, bool) or not isinstance(self.similarity, (int, float)) \
                or not 0.0 <= self.similarity <= 1.0:
            raise ConfigError(f"HShareConfig.planner.similarity = {self.similarity!r} is invalid; accepted: a number "
                              "in [0, 1]")
        _set(self, "similarity", float(self.similarity))
        if self.scorings is not None:
            _set(self, "scorings", check_ratio("planner.scorings", self.scorings))
            if self.method != "auto":
                raise ConfigError(f"HShareConfig.planner.scorings = {self.scorings!r} with planner.method = "
                                  f"'{self.method}' is invalid: a scoring budget is the 'auto' planner's; accepted: "
                                  "method 'auto' with scorings, or scorings None")
            if self.scope != "batch":
                raise ConfigError(f"HShareConfig.planner.scorings = {self.scorings!r} with planner.scope = "
                                  f"'{self.scope}' is invalid: a scoring budget counts the copies of one plan for the "
                                  "batch (rows planned apart would copy different layers and meet it apart); "
                                  "accepted: scope 'batch' with scorings, or scorings None")


@dataclass(frozen=True)
class PolicyConfig:
    """The section of one selection policy: its options, as fields of a subclass that the policy's
    module defines and `hshare.policy.register_policy` binds to the policy's name.

    A subclass declares its fields (validated in its `__post_init__`), `flat_names` (the flat option
    names it answers to, ``{"page_size": "page_size"}``), and may check the model's shape in
    `validate_for_model` and say what it keeps in `describe`.
    """

    name: ClassVar[str] = ""  # the registered policy's name (set by `register_policy`)
    flat_names: ClassVar[dict[str, str]] = {}
    # MiB of K/V reads per layer a sparse step must save on CUDA on top of `AUTO_MIN_SAVED_MIB`, for the policy's
    # selection work beyond the label policy's (`HShareConfig.sparse_min_saved_bytes`; calibrated under CUDA
    # graphs by `hshare bench grid`)
    selection_min_saved_mib: ClassVar[float] = 0.0
    # why the policy cannot take `SharingConfig.successors` ("" = it can)
    refuses_successors: ClassVar[str] = ""

    def validate_for_model(self, head_dim: int) -> None:
        """Checks that need the model's head dimension; raises `ConfigError` naming the field."""

    def describe(self) -> str:
        """One line: the policy and its options (``hshare presets``)."""
        options = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name} {options}".strip()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


@dataclass(frozen=True)
class PrefixConfig:
    """Shared-prefix attention inside ``generate`` (Hydragen).

    Attributes:
        mode: "auto" stores a prompt prefix shared by the rows once when it pays (at least
            `min_tokens` shared tokens, `min_batch` rows sharing them and `min_saved_tokens` token
            reads saved per step; the same rule for sparse configs), "on" whenever any prefix is
            shared (the KV memory saving alone), "off" never.
        min_tokens: shortest prefix (level 1) or group extension (level 2) stored once.
        min_batch: fewest rows that must share a level for "auto" to store it once.
        min_saved_tokens: fewest KV token reads per layer and step, (rows - 1) x shared tokens, a
            level must save for "auto" (below it the shared step is slower than per-row dense). None =
            auto (`min_saved`): `AUTO_PREFIX_MIN_SAVED_TOKENS` for decode steps replayed as CUDA graphs,
            or run eagerly (and off CUDA).
        levels: 1 (one prefix for all rows) or 2 (plus groups of rows sharing more, e.g. the samples
            of each question after a common few-shot prefix).
    """

    mode: str = "auto"
    min_tokens: int = 256
    min_batch: int = 2
    min_saved_tokens: int | None = None
    levels: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.mode, bool):  # YAML (a preset, an override's value) reads unquoted on / off as booleans
            object.__setattr__(self, "mode", "on" if self.mode else "off")
        check_choice("prefix.mode", self.mode, PREFIX_MODES)
        check_int("prefix.min_tokens", self.min_tokens, 1)
        check_int("prefix.min_batch", self.min_batch, 1)
        if self.min_saved_tokens is not None:
            check_int("prefix.min_saved_tokens", self.min_saved_tokens, 0)
        check_int("prefix.levels", self.levels, 1, 2)

    def min_saved(self, device: torch.device, graphs: bool) -> int:
        """The token reads per layer and step a level must save for "auto" on `device`, for decode steps
        replayed as CUDA graphs or run eagerly (`min_saved_tokens`)."""
        if self.min_saved_tokens is not None:
            return self.min_saved_tokens
        return AUTO_PREFIX_MIN_SAVED_TOKENS["graphs" if graphs and device.type == "cuda" else "eager"]


@dataclass(frozen=True)
class RuntimeConfig:
    """How decode steps run.

    Attributes:
        cuda_graphs: on CUDA, ``generate`` decodes with static shapes (buffers sized once for the
            prompt plus ``max_new_tokens`` - 1) and replays each kind of decode step as a CUDA graph
            (`hshare.static_decode`); where that cannot apply (beam search, tensor parallelism, an
            unknown final length...) it decodes eagerly and says why in ``cache.static_decode``.
            False = always eager. Tokens are the same either way.
        compile_elementwise: inside those captured steps, the decoder layers' RMSNorms, rotary
            embedding and MLP activation run as inductor-fused kernels (`hshare.elementwise_fusion`)
            instead of about 25 small kernels a layer; results equal the unfused step up to the order
            of a reduction. False = the model's own eager kernels in the graph.
        fuse_projections: inside those captured steps, each attention's query, key and value
            projections run as one product over their weights stacked (`hshare.projection_fusion`: for the
            generate, the weights move into one tensor per attention and the parameters become its rows,
            no copy kept; at its end each gets its own storage back); results equal the separate products
            up to the GEMM's order of summation. False = three products.
        dependent_launch: inside those captured steps, on a GPU of compute capability 9 or newer (Hopper),
            hshare's Triton kernels and the inductor-fused ones launch as programmatic dependent launches: each
            is scheduled while the kernel before it drains and waits for it (``griddepcontrol.wait``) before it
            touches memory (`kernels.dependent_launch`), which shortens the gaps between a replayed step's
            dependent launches. Tokens are the same. False = ordinary launches.
        dense_fallback_mib: a decode step runs exact dense attention unless sparse attention saves at
            least this many MiB of K/V reads per layer, ``rows x (own columns - N_c) x`` K/V bytes per
            token (`hshare.step.StepPlanner.sparse_pays`; ``cache.planner.decision`` says what the last
            step chose and why). None = auto: on CUDA `AUTO_MIN_SAVED_MIB` for steps replayed as CUDA
            graphs or run eagerly, plus the policy's `PolicyConfig.selection_min_saved_mib`; 0 elsewhere;
            0 = sparse at any size.
        sparse_prefill: at prefill, each query row of a sparse layer attends only to its own critical
            tokens (sink + local + the heavy top-k of its causal middle window by the policy's
            scores; rows with no more valid keys than N_c attend densely): the HShare paper's
            Appendix A.1 variant. False = exact dense prefill (the paper's main setting). It does not
            combine with a shared prefix (prefilled exactly, once for all rows).
    """

    cuda_graphs: bool = True
    compile_elementwise: bool = True
    fuse_projections: bool = True
    dependent_launch: bool = True
    dense_fallback_mib: float | None = None
    sparse_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("cuda_graphs", "compile_elementwise", "fuse_projections", "dependent_launch", "sparse_prefill"):
            check_bool(f"runtime.{name}", getattr(self, name))
        mib = self.dense_fallback_mib
        if mib is not None:
            if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not mib >= 0:
                raise ConfigError(f"HShareConfig.runtime.dense_fallback_mib = {mib!r} is invalid; accepted: a number "
                                  "of MiB >= 0, or null for the device's default")
            _set(self, "dense_fallback_mib", float(mib))

    def sparse_min_saved_bytes(self, device: torch.device, graphs: bool, selection_mib: float = 0.0) -> float:
        """The K/V bytes per layer a sparse decode step must save to run on `device` (`dense_fallback_mib`),
        for steps replayed as CUDA graphs or run eagerly; `selection_mib` is added to the auto value on CUDA
        (a policy's `PolicyConfig.selection_min_saved_mib`)."""
        mib = self.dense_fallback_mib
        if mib is None:
            mib = AUTO_MIN_SAVED_MIB["graphs" if graphs else "eager"] + selection_mib if device.type == "cuda" else 0.0
        return mib * 2**20


SECTIONS: dict[str, type] = {"budget": BudgetConfig, "sharing": SharingConfig, "planner": PlannerConfig,
                             "prefix": PrefixConfig, "runtime": RuntimeConfig}
# The flat option names (overrides, flat YAML, ``--set``, ``hshare_<name>`` model_args) -> (section, field).
# The policy's options answer to the names its `PolicyConfig.flat_names` declares.
OPTION_NAMES: dict[str, tuple[str, str]] = {
    "sink": ("budget", "sink"), "local": ("budget", "local"), "heavy": ("budget", "heavy"),
    "layer_sharing": ("sharing", "layer"), "head_sharing": ("sharing", "head"), "query_sharing": ("sharing", "query"),
    "group_lookahead": ("sharing", "lookahead"), "dense_layers": ("sharing", "dense_layers"),
    "candidates": ("sharing", "candidates"), "refine_steps": ("sharing", "refine_steps"),
    "refine_by": ("sharing", "refine_by"), "successors": ("sharing", "successors"),
    "selection": ("planner", "selection"), "plan_scope": ("planner", "scope"), "planner": ("planner", "method"),
    "plan_rows": ("planner", "rows"), "seed": ("planner", "seed"), "share_similarity": ("planner", "similarity"),
    "share_scorings": ("planner", "scorings"),
    "policy": ("policy", "name"),
    "prefix": ("prefix", "mode"), "prefix_min_tokens": ("prefix", "min_tokens"),
    "prefix_min_batch": ("prefix", "min_batch"), "prefix_min_saved_tokens": ("prefix", "min_saved_tokens"),
    "prefix_levels": ("prefix", "levels"),
    "cuda_graphs": ("runtime", "cuda_graphs"), "compile_elementwise": ("runtime", "compile_elementwise"),
    "fuse_projections": ("runtime", "fuse_projections"), "dependent_launch": ("runtime", "dependent_launch"),
    "dense_fallback_mib": ("runtime", "dense_fallback_mib"), "sparse_prefill": ("runtime", "sparse_prefill"),
}
DEFAULT_POLICY = "labels"


def _policy_config_class(name: Any) -> type[PolicyConfig]:
    from hshare.policy import policy_class, policy_names  # the registry (its modules import this one)

    if not isinstance(name, str):
        raise ConfigError(f"HShareConfig.policy.name = {name!r} is invalid; accepted: "
                          f"{', '.join(map(repr, policy_names()))}")
    try:
        return policy_class(name).config_class
    except ConfigError:
        raise ConfigError(f"HShareConfig.policy = {name!r} is invalid; accepted: "
                          f"{', '.join(map(repr, policy_names()))}") from None


def policy_option_names() -> dict[str, tuple[str, str]]:
    """Every registered policy's flat option names -> (policy name, field)."""
    from hshare.policy import policy_class, policy_names

    return {flat: (name, option) for name in policy_names()
            for flat, option in policy_class(name).config_class.flat_names.items()}


def option_names() -> list[str]:
    """Every name a config option answers to: the flat names, the policies' flat option names and the
    dotted ``section.field`` names (``hshare_<name>`` model_args, ``--set``, YAML)."""
    from hshare.policy import policy_class, policy_names

    dotted = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    dotted += sorted({f"policy.{f.name}" for name in policy_names()
                      for f in dataclasses.fields(policy_class(name).config_class)} | {"policy.name"})
    return sorted(OPTION_NAMES) + sorted(policy_option_names()) + dotted


def _unknown(name: str) -> ConfigError:
    known = option_names()
    close = difflib.get_close_matches(name, known + ["sparse", "name"] + list(SECTIONS) + ["policy"], n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"unknown HShareConfig option {name!r}; {hint}accepted: sparse, the sections "
                       f"{', '.join(list(SECTIONS) + ['policy'])}, or an option name ({', '.join(known)})")


def _policy_section(value: Any) -> PolicyConfig:
    """A policy section from a `PolicyConfig`, a policy name, or a mapping with ``name`` and its options."""
    if isinstance(value, PolicyConfig):
        return value
    if isinstance(value, str):
        return _policy_config_class(value)()
    if isinstance(value, Mapping):
        options = dict(value)
        cls = _policy_config_class(options.pop("name", DEFAULT_POLICY))
        return _build(cls, options, "policy")
    raise ConfigError(f"HShareConfig.policy = {value!r} is invalid; accepted: a policy name, a PolicyConfig or a "
                      "mapping with its name and options")


def _build(cls: type, fields: Mapping[str, Any], section: str, base: Any = None) -> Any:
    """`cls` from `fields` (over `base`'s values); unknown fields raise `ConfigError` naming the section's."""
    known = [f.name for f in dataclasses.fields(cls)]
    for name in fields:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"HShareConfig.{section} has no field {name!r}; {hint}accepted: {', '.join(known)}")
    if base is not None:
        return dataclasses.replace(base, **fields)
    return cls(**fields)


@dataclass(frozen=True, init=False)
class HShareConfig:
    """Validated configuration of HShare sparse decoding and shared-prefix attention (the module
    docstring states the contract).

    Attributes:
        sparse: False = exact dense attention at every step (the ``dense`` preset; the sections other
            than ``prefix`` and ``runtime`` are then unused).
        budget, sharing, planner, policy, prefix, runtime: the sections (`BudgetConfig`,
            `SharingConfig`, `PlannerConfig`, the policy's `PolicyConfig`, `PrefixConfig`,
            `RuntimeConfig`).
        name: the preset's or file's name (not compared).

    Args (besides the attributes): a section may be given as a mapping of its fields; ``budget`` as
    a number N_c (`BudgetConfig.split`); ``policy`` as a policy's name (its default options);
    ``prefix`` and ``planner`` as their mode / method; ``**options``: flat or dotted option names
    (`OPTION_NAMES`, a policy's `PolicyConfig.flat_names`, ``"sharing.layer"``), applied over the
    sections.
    """

    sparse: bool = True
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    policy: PolicyConfig = field(default=None)  # type: ignore[assignment]  # default: the "labels" policy's
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    name: str = field(default="custom", compare=False)

    def __init__(self, sparse: bool = True, budget: Any = None, sharing: Any = None, planner: Any = None,
                 policy: Any = None, prefix: Any = None, runtime: Any = None, name: str = "custom",
                 **options: Any) -> None:
        given = {"budget": budget, "sharing": sharing, "planner": planner, "prefix": prefix, "runtime": runtime}
        sections: dict[str, Any] = {}
        for section, cls in SECTIONS.items():
            value = given[section]
            if section == "budget" and isinstance(value, int) and not isinstance(value, bool):
                value = BudgetConfig.split(value)
            if value is None:
                value = cls()
            elif isinstance(value, Mapping):
                value = _build(cls, value, section)
            elif not isinstance(value, cls):
                if section in OPTION_NAMES:  # prefix="auto", planner="random": the section's main option
                    options = {section: value, **options}
                    value = cls()
                else:
                    raise ConfigError(f"HShareConfig.{section} = {value!r} is invalid; accepted: a {cls.__name__} or "
                                      "a mapping of its fields")
            sections[section] = value
        sections["policy"] = _policy_section(DEFAULT_POLICY if policy is None else policy)
        _apply_options(sections, options)
        object.__setattr__(self, "sparse", check_bool("sparse", sparse))
        for section, value in sections.items():
            object.__setattr__(self, section, value)
        object.__setattr__(self, "name", str(name))
        if self.sparse and self.sharing.successors and self.policy.refuses_successors:
            raise ConfigError(f"HShareConfig.sharing.successors = True with policy '{self.policy.name}' is invalid: "
                              f"{self.policy.refuses_successors}; accepted: successors with a policy that selects "
                              f"columns (e.g. 'labels'), or '{self.policy.name}' without successors")
        if self.sparse and self.sharing.refine_by == "keys" and not self.candidate_count:
            raise ConfigError("HShareConfig.sharing.refine_by = 'keys' without a candidate set is invalid: it ranks the "
                              "candidates a selection shares; accepted: 'keys' with sharing.candidates > 1 and a heavy "
                              "budget, or refine_by 'labels'")
        if self.sparse and self.sharing.refine_by == "keys" and self.planner.selection != "kv_head":
            raise ConfigError(f"HShareConfig.sharing.refine_by = 'keys' with planner.selection = "
                              f"'{self.planner.selection}' is invalid: a refinement reads the keys of its KV head, "
                              "summed over the head's query group; accepted: 'keys' with selection 'kv_head', or "
                              "refine_by 'labels'")
        floor = self.sharing.layer * self.sharing.head  # at least this share of the pairs selects
        if self.sparse and self.planner.scorings is not None and self.planner.scorings < floor - 1e-9:
            raise ConfigError(f"HShareConfig.planner.scorings = {self.planner.scorings} is unreachable: the sharing "
                              f"ratios keep at least sharing.layer x sharing.head = {floor:.4g} of the (layer, head) "
                              f"pairs selecting; accepted: scorings >= {floor:.4g}, or lower sharing.layer / "
                              "sharing.head bounds (e.g. layer_sharing=1/8, head_sharing=1/8)")
        if self.runtime.sparse_prefill and self.prefix.mode == "on":
            raise ConfigError(
                "HShareConfig.runtime.sparse_prefill = True with prefix.mode = 'on' is invalid: a shared prefix is "
                "prefilled exactly, once for all rows, while sparse prefill selects per row; accepted: sparse_prefill "
                "with prefix 'off' or 'auto' (which then does not share), or prefix 'on' without sparse_prefill"
            )

    # ---- derived quantities -------------------------------------------------------------
    def sparse_min_saved_bytes(self, device: torch.device, graphs: bool) -> float:
        """The K/V bytes per layer a sparse decode step of this config must save to run on `device`
        (`RuntimeConfig.sparse_min_saved_bytes` with the policy's `PolicyConfig.selection_min_saved_mib`)."""
        return self.runtime.sparse_min_saved_bytes(device, graphs, self.policy.selection_min_saved_mib)

    def sparse_saved_bytes(self, rows: int, columns: int, token_bytes: int) -> int:
        """The K/V bytes one layer's sparse step does not read at `columns` own columns: ``rows x (columns - N_c) x
        token_bytes`` (K and V of one token in one layer); the dense-or-sparse rule (`hshare.step.StepPlanner`)
        runs a step sparse where they reach `sparse_min_saved_bytes`."""
        return rows * max(columns - self.budget.total, 0) * token_bytes

    @property
    def candidate_count(self) -> int:
        """C: candidates a selecting head keeps for the heads, layers and steps that refine its selection
        (0 = no refinement: `SharingConfig.candidates` is 1, or nothing is heavy)."""
        count = int(round(self.sharing.candidates * self.budget.heavy))
        return count if count > self.budget.heavy else 0

    @property
    def shares_prefix(self) -> bool:
        """Whether ``generate`` looks for a shared prompt prefix (never with sparse prefill)."""
        return self.prefix.mode != "off" and not self.runtime.sparse_prefill

    def validate_for_model(self, num_layers: int, head_dim: int) -> None:
        """Checks that need the model's shape; raises `ConfigError` naming the field."""
        bad = [i for i in self.sharing.dense_layers if i >= num_layers]
        if bad:
            raise ConfigError(
                f"HShareConfig.sharing.dense_layers = {list(self.sharing.dense_layers)} names layer(s) {bad} but the "
                f"model has {num_layers} layers; accepted: indices in [0, {num_layers - 1}]"
            )
        if self.sparse:
            self.policy.validate_for_model(head_dim)

    # ---- copies -------------------------------------------------------------------------
    def with_budget(self, total: int) -> "HShareConfig":
        """This config at N_c = `total` critical tokens (``"<preset>@<N_c>"`` names and the ``budget=``
        override), split by `BudgetConfig.split`; a config that scores nothing (``heavy = 0``,
        StreamingLLM) keeps the rest local."""
        return self.replace(budget=BudgetConfig.split(total, scores=self.budget.heavy > 0))

    def replace(self, **changes: Any) -> "HShareConfig":
        """A copy with some options changed (validated): flat or dotted option names, ``sparse``,
        ``name``, whole sections, or a section as a mapping of the fields to change. Unknown names raise
        `ConfigError` naming the closest."""
        kwargs: dict[str, Any] = {"sparse": self.sparse, "name": self.name, "policy": self.policy,
                                  **{section: getattr(self, section) for section in SECTIONS}}
        options: dict[str, Any] = {}
        for key, value in changes.items():
            if key in ("sparse", "name") or isinstance(value, (*SECTIONS.values(), PolicyConfig)):
                kwargs[key] = value
            elif key in (*SECTIONS, "policy") and isinstance(value, Mapping):
                value = dict(value)
                if key == "policy" and "name" in value:
                    options["policy.name"] = value.pop("name")
                options.update({f"{key}.{name}": v for name, v in value.items()})
            elif key == "budget" and isinstance(value, int) and not isinstance(value, bool):
                kwargs[key] = value  # N_c, split as `BudgetConfig.split`
            elif key in SECTIONS and not (isinstance(value, (str, bool)) and key in OPTION_NAMES):  # YAML's off: False
                raise ConfigError(f"HShareConfig.{key} = {value!r} is invalid; accepted: a "
                                  f"{SECTIONS[key].__name__} or a mapping of its fields")
            else:  # a section's name given a value (policy="quest", prefix="off"): its main option, dotted
                options[".".join(OPTION_NAMES[key]) if key in (*SECTIONS, "policy") else key] = value
        return HShareConfig(**kwargs, **options)

    def to_dict(self) -> dict[str, Any]:
        """The config as YAML-ready sections (``from_dict`` reads it back; ``name`` is left out)."""
        data: dict[str, Any] = {"sparse": self.sparse}
        for section in ("budget", "sharing", "planner", "policy", "prefix", "runtime"):
            value = getattr(self, section)
            fields = value.to_dict() if section == "policy" else dataclasses.asdict(value)
            data[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
        return data

    # ---- loading ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str = "custom") -> "HShareConfig":
        """A config from sections (mappings) and / or flat or dotted option names, over the defaults."""
        data = dict(data)
        data.setdefault("name", name)
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "HShareConfig":
        path = Path(path)
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} does not hold a mapping of HShareConfig sections or options")
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
            return cls.from_yaml(preset_dir() / f"{base}.yaml").with_budget(int(size)).replace(name=name)
        raise ConfigError(f"unknown preset {name!r}; accepted: {', '.join(preset_names())}, any of them at another "
                          "budget as '<preset>@<N_c>' (e.g. hshare-1_2-1_2-1_2@2048), or a YAML path")


def _apply_options(sections: dict[str, Any], options: Mapping[str, Any]) -> None:
    """Apply flat / dotted option names to `sections` in place: the policy's name first (a new policy
    starts from its default options), then each section's fields at once."""
    options = dict(options)
    for key in ("policy.name", "policy"):
        if key in options:
            new = options.pop(key)
            if new != sections["policy"].name:
                sections["policy"] = _policy_section(new)
    changes: dict[str, dict[str, Any]] = {}
    given_as: dict[str, str] = {}  # "section.field" -> the option name it was given by
    policy_flat = policy_option_names() if options else {}
    for key, value in options.items():
        if key in OPTION_NAMES:
            section, name = OPTION_NAMES[key]
        elif key in policy_flat:
            owner, name = policy_flat[key]
            current = sections["policy"]
            if key not in current.flat_names:
                raise ConfigError(f"HShareConfig option {key!r} belongs to the {owner!r} policy, but the config's policy "
                                  f"is {current.name!r}; accepted for it: {', '.join(current.flat_names) or 'no options'}"
                                  f" (or set policy={owner!r} as well)")
            section, name = "policy", current.flat_names[key]
        elif "." in key and key.split(".", 1)[0] in (*SECTIONS, "policy"):
            section, name = key.split(".", 1)
        else:
            raise _unknown(key)
        changes.setdefault(section, {})[name] = value
        given_as[f"{section}.{name}"] = key
    for section, fields in changes.items():
        try:
            sections[section] = _build(type(sections[section]), fields, section, base=sections[section])
        except ConfigError as error:  # name the option as the caller spelt it
            spelt = [key for dotted, key in given_as.items() if key != dotted and f"HShareConfig.{dotted} " in str(error)]
            if spelt:
                raise ConfigError(f"{error} (set as {spelt[0]!r})") from None
            raise


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


def split_overrides(text: str) -> tuple[str, dict[str, Any]]:
    """``(preset, overrides)`` of a preset string with options after ``+``: ``"ds@1024+dense_fallback_mib=0+sink=4"``
    gives ``("ds@1024", {"dense_fallback_mib": 0, "sink": 4})`` (values read as YAML scalars); a string
    without ``+`` has none."""
    name, *assignments = text.split("+")
    overrides = {}
    for assignment in assignments:
        key, equals, value = assignment.partition("=")
        if not key or not equals or not value:
            raise ConfigError(f"{text!r}: override {assignment!r} is not FIELD=VALUE; accepted: "
                              "PRESET+FIELD=VALUE[+FIELD=VALUE...], e.g. hshare-refine-successors@512+candidates=3")
        overrides[key] = yaml.safe_load(value)
    return name, overrides


def resolve_config(config: "HShareConfig | str | os.PathLike | None", **overrides: Any) -> HShareConfig:
    """A config object, a preset name (``"<preset>[@<N_c>][+FIELD=VALUE...]"``, `split_overrides`), or a YAML
    path -> `HShareConfig`, with option overrides (`HShareConfig.replace`; keyword overrides win over a
    preset string's); ``budget=N_c`` resizes it first (`HShareConfig.with_budget`), and explicit
    ``sink``/``local``/``heavy`` win over it."""
    budget = overrides.pop("budget", None)
    if config is None:
        config = "hshare-1_2-1_2-1_2"
    if isinstance(config, HShareConfig):
        resolved = config
    elif isinstance(config, (str, os.PathLike)):
        text = str(config)
        if text.endswith((".yaml", ".yml")) or os.sep in text.split("+", 1)[0]:  # options may hold '/' (1/2)
            if not Path(text).is_file():
                raise ConfigError(f"config file {text!r} does not exist")
            resolved = HShareConfig.from_yaml(text)
        else:
            name, given = split_overrides(text)
            resolved = HShareConfig.from_preset(name)
            if given:  # the string's options act as keyword ones (after the budget), which win over them
                string_budget = given.pop("budget", None)
                budget = string_budget if budget is None else budget
                overrides = {"name": text, **given, **overrides}
    else:
        raise ConfigError(
            f"config = {config!r} has type {type(config).__name__}; accepted: an HShareConfig, a preset name "
            f"({', '.join(preset_names())}) or a YAML path"
        )
    if isinstance(budget, (BudgetConfig, Mapping)):
        overrides["budget"] = budget
    elif budget is not None:
        resolved = resolved.with_budget(budget)
    return resolved.replace(**overrides) if overrides else resolved
