"""The lm-eval model ``hshare``: lm-eval's HF model with the loaded model patched by `hshare.patch`.

Registered with lm-eval on import (``@register_model("hshare")``), so that

    hshare eval --model hshare --model_args pretrained=<dir or hub id>,hshare=ds@512 --tasks gsm8k

(or ``lm_eval`` itself after ``import hshare.eval.lm_eval_model``) evaluates a patched model. Every
``model_args`` key of lm-eval's ``hf`` model is accepted (``gguf_file``, ``dtype``, ``device``,
``parallelize``, ...), plus:

* ``hshare``: a preset name, a YAML path, or ``dense`` (default ``hshare-1_2-1_2-1_2``);
* ``hshare_<option>``: an `HShareConfig` option override (``hshare_heavy=200``,
  ``hshare_layer_sharing=3/4``, ``hshare_dense_layers=0;1``: list items separated by ``;``);
* ``dense_fallback``: keep the config's dense fallback for small steps (default False: evaluation
  measures the algorithm, so every decode step of a sparse layer is sparse);
* no ``pretrained``: the embedded default model (SmolLM2-135M-Instruct, `hshare.default_model`).

From Python, with an already loaded model: ``HShareLM(pretrained=model, tokenizer=tokenizer,
hshare="ds")``. Log-likelihood requests are plain forwards (exact dense attention); generation
requests go through the patched ``generate`` with a fresh `HShareCache` per batch, whose work
counters are summed in `HShareLM.work` (`WorkTotals`).

Several GPUs:

* data parallel, one model copy per GPU: ``accelerate launch -m hshare eval --model_args
  pretrained=...,hshare=ds@512 ...``. lm-eval's HF model loads a copy on each rank's GPU and
  splits the documents over the ranks (it does so when more than one CUDA device is visible; a
  ``pretrained`` path is needed, so without one the embedded model is converted once and loaded
  from its directory). Each rank patches its own copy; `HShareLM.work` counts that rank's
  generations, `HShareLM.work_over_ranks` sums them over the ranks (``hshare eval`` prints the sum,
  on rank 0). The copies of a rank's last request that lm-eval appends so that every rank runs as
  many requests (`padding_copies`) are answered without generating, so that the sum counts each
  document once. lm-eval itself writes results on rank 0 only.
* one model split over GPUs (``parallelize=True``, or a ``device_map``): the ``dense`` config
  runs; sparse configs are refused when the model is loaded, before any request
  (`SplitPlacementError`, naming what to change).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from hshare.api import new_cache, patch, patch_state, refuse_split_placement, unpatch
from hshare.config import ConfigError, HShareConfig, option_names
from hshare.eval.harness import evaluation_config

OVERRIDE_PREFIX = "hshare_"


@dataclass
class WorkTotals:
    """Work counters of every generation an `HShareLM` ran (sums of `HShareCache.stats` fields), and what
    their sharing plans share.

    Attributes:
        generate_calls: batches generated.
        counters: field name of `hshare.cache.DecodeStats` -> sum over the batches.
        plan_totals: `SharingPlan.summary` name -> sum over the batches that made a plan (`planned`).
    """

    generate_calls: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    plan_totals: dict[str, float] = field(default_factory=dict)
    planned: int = 0

    def add(self, stats: Any, plan: dict[str, float] | None = None) -> None:
        """One batch's `HShareCache.stats` and, where it made one, its plan's `SharingPlan.summary`."""
        self.generate_calls += 1
        for name, value in dataclasses.asdict(stats).items():
            self.counters[name] = self.counters.get(name, 0) + int(value)
        if plan:
            self.planned += 1
            for name, value in plan.items():
                self.plan_totals[name] = self.plan_totals.get(name, 0.0) + float(value)

    def plan_mean(self) -> dict[str, float]:
        """The mean of the batches' plan summaries (empty: no batch made a plan)."""
        return {name: total / self.planned for name, total in self.plan_totals.items()}

    def as_dict(self) -> dict[str, int]:
        return {"generate_calls": self.generate_calls, **self.counters}

    @classmethod
    def summed(cls, parts: Iterable["WorkTotals"]) -> "WorkTotals":
        """The sum of several totals (e.g. one per data-parallel rank): counters and plan summaries."""
        total = cls()
        for part in parts:
            total.generate_calls += part.generate_calls
            total.planned += part.planned
            for name, value in part.counters.items():
                total.counters[name] = total.counters.get(name, 0) + value
            for name, value in part.plan_totals.items():
                total.plan_totals[name] = total.plan_totals.get(name, 0.0) + value
        return total


class SplitPlacementError(ValueError):
    """A sparse config on a model split over devices (``parallelize=True``, ``device_map``); the
    message says what to change. ``hshare eval`` prints it and exits."""


def padding_copies(requests: list[Any]) -> int:
    """How many entries at the end of `requests` are lm-eval's data-parallel padding.

    Under ``accelerate launch`` lm-eval's evaluator appends copies of a rank's last request (the
    same `Instance` object, ``repeats`` entries per copy) so that every rank runs as many requests;
    their answers are dropped. A request's own ``repeats`` entries are not padding.
    """
    if not requests:
        return 0
    last, run = requests[-1], 0
    for request in reversed(requests):
        if request is not last:
            break
        run += 1
    return max(run - int(getattr(last, "repeats", 1) or 1), 0)


def launched_processes() -> int:
    """Processes of a distributed launch (``accelerate launch``, ``torchrun``: ``WORLD_SIZE``), 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def default_model_dir() -> Path:
    """The embedded model's converted directory, for lm-eval to load on every rank (converted once:
    the first process to take the lock converts it, the others wait; no collective is involved)."""
    from filelock import FileLock

    from hshare.default_model import MODEL_NAME, cache_dir, load_default_model

    path = cache_dir() / MODEL_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f"{MODEL_NAME}.lock")):
        if not (path / "config.json").is_file():
            load_default_model()
    return path


def parse_overrides(model_args: dict[str, Any]) -> dict[str, Any]:
    """``hshare_<option>`` entries of lm-eval ``model_args`` -> `HShareConfig` overrides (popped); the
    option is a flat or dotted option name (`hshare.config.option_names`).

    Raises:
        ConfigError: an option `HShareConfig` does not have (the message lists the options).
    """
    known = set(option_names())
    overrides = {}
    for key in [k for k in model_args if k.startswith(OVERRIDE_PREFIX)]:
        name, value = key[len(OVERRIDE_PREFIX):], model_args.pop(key)
        if name not in known:
            raise ConfigError(f"model_args {key}: HShareConfig has no option {name!r}; accepted: "
                              f"{', '.join(OVERRIDE_PREFIX + f for f in option_names())}")
        if name in ("dense_layers", "sharing.dense_layers") and isinstance(value, (str, int)):
            value = tuple(int(i) for i in str(value).replace(";", " ").split())
        overrides[name] = value
    return overrides


@register_model("hshare")
class HShareLM(HFLM):
    """lm-eval's HF model, patched with HShare (see the module docstring for ``model_args``).

    Args:
        pretrained: a directory, a hub id, a loaded ``PreTrainedModel``, or None (the default model).
        hshare: the `HShareConfig`, preset name or YAML path.
        dense_fallback: keep the dense fallback of small decode steps (default off).
        **kwargs: lm-eval ``hf`` model arguments and ``hshare_<field>`` overrides.

    Raises:
        ConfigError: an unknown ``hshare_<field>`` or an invalid config (before loading).
        SplitPlacementError: a sparse config and a model split over devices (after loading, before
            any request).
    """

    last: "HShareLM | None" = None  # the latest instance (``hshare eval`` prints its work counters)

    def __init__(self, pretrained: Any = None, hshare: HShareConfig | str | None = None,
                 dense_fallback: bool = False, **kwargs: Any) -> None:
        overrides = parse_overrides(kwargs)
        self.hshare_config = evaluation_config(hshare, overrides, dense_fallback)  # validated before loading
        if pretrained is None and launched_processes() > 1:  # lm-eval's data parallelism needs a path
            if kwargs.get("gguf_file"):
                raise ValueError("gguf_file needs pretrained=<the directory or hub id holding it>")
            pretrained = str(default_model_dir())
            kwargs.setdefault("dtype", "float32")
        elif pretrained is None:  # the embedded model, float32 unless a dtype is given
            from hshare.default_model import load_model, torch_dtype

            dtype = torch_dtype(kwargs.pop("dtype", "auto"), torch.float32)
            pretrained, tokenizer = load_model(None, kwargs.pop("gguf_file", None), dtype, kwargs.pop("device", None))
            kwargs.setdefault("tokenizer", tokenizer)
        super().__init__(pretrained=pretrained, **kwargs)
        self.work = WorkTotals()
        try:
            refuse_split_placement(self._model, self.hshare_config)
        except ValueError as error:
            raise SplitPlacementError(
                f"{error}. With hshare eval: run data parallel instead, one model copy per GPU "
                "(accelerate launch -m hshare eval ..., without parallelize=True or device_map in --model_args), "
                "or evaluate the split model with hshare=dense"
            ) from None
        patch(self._model, self.hshare_config)
        HShareLM.last = self

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """lm-eval's generation; under data parallelism its padding copies (`padding_copies`) get the
        answer of the request they copy instead of being generated (and counted) again."""
        padding = padding_copies(requests) if self.world_size > 1 else 0
        if not padding:
            return super().generate_until(requests, disable_tqdm)
        answers = super().generate_until(requests[:-padding], disable_tqdm)
        return answers + answers[-1:] * padding

    def work_over_ranks(self) -> WorkTotals:
        """`work` summed over lm-eval's data-parallel ranks; with one rank, `work` itself.

        A collective (``all_gather_object``) under ``accelerate launch``: every rank must call it.
        """
        if self.world_size <= 1:
            return self.work
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, self.work)
        return WorkTotals.summed(parts)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        if patch_state(self._model) is None:  # unpatched (`unpatch`): lm-eval's own generation
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        cache = new_cache(self._model)
        out = super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
        plan = cache.planner.sharing
        self.work.add(cache.stats, plan.summary(cache.sparse_layers) if plan is not None else None)
        return out

    def unpatch(self) -> None:
        """Restore the wrapped model (e.g. before patching it with another config)."""
        unpatch(self._model)

