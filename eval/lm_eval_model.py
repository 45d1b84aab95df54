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

import os
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from hshare.api import new_cache, patch, patch_state, refuse_split_placement, unpatch
from hshare.config import ConfigError, HShareConfig, option_names
from hshare.counters import WorkTotals
from hshare.eval.harness import evaluation_config

OVERRIDE_PREFIX = "hshare_"


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
        self.work.add(cache.stats, cache.planner.sharing_summary())
        return out

    def unpatch(self) -> None:
        """Restore the wrapped model (e.g. before patching it with another config)."""
        unpatch(self._model)

