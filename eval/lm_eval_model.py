"""The lm-eval model ``hshare``: lm-eval's HF model with the loaded model patched by `hshare.patch`.

Registered with lm-eval on import (``@register_model("hshare")``), so that

    hshare eval --model hshare --model_args pretrained=<dir or hub id>,hshare=ds@512 --tasks gsm8k

(or ``lm_eval`` itself after ``import hshare.eval.lm_eval_model``) evaluates a patched model. Every
``model_args`` key of lm-eval's ``hf`` model is accepted (``gguf_file``, ``dtype``, ``device``,
``parallelize``, ...), plus:

* ``hshare``: a preset name, a YAML path, or ``dense`` (default ``hshare-1_2-1_2-1_2``);
* ``hshare_<field>``: an `HShareConfig` field override (``hshare_heavy=200``,
  ``hshare_layer_sharing=3/4``, ``hshare_dense_layers=0;1``: list items separated by ``;``);
* ``dense_fallback``: keep the config's dense fallback for small steps (default False: evaluation
  measures the algorithm, so every decode step of a sparse layer is sparse);
* no ``pretrained``: the embedded default model (SmolLM2-135M-Instruct, `hshare.default_model`).

From Python, with an already loaded model: ``HShareLM(pretrained=model, tokenizer=tokenizer,
hshare="ds")``. Log-likelihood requests are plain forwards (exact dense attention); generation
requests go through the patched ``generate`` with a fresh `HShareCache` per batch, whose work
counters are summed in `HShareLM.work` (`WorkTotals`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from hshare.api import new_cache, patch, patch_state, unpatch
from hshare.config import ConfigError, HShareConfig
from hshare.eval.harness import evaluation_config

OVERRIDE_PREFIX = "hshare_"


@dataclass
class WorkTotals:
    """Work counters of every generation an `HShareLM` ran (sums of `HShareCache.stats` fields).

    Attributes:
        generate_calls: batches generated.
        counters: field name of `hshare.cache.DecodeStats` -> sum over the batches.
    """

    generate_calls: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    def add(self, stats: Any) -> None:
        self.generate_calls += 1
        for name, value in dataclasses.asdict(stats).items():
            self.counters[name] = self.counters.get(name, 0) + int(value)

    def as_dict(self) -> dict[str, int]:
        return {"generate_calls": self.generate_calls, **self.counters}


def parse_overrides(model_args: dict[str, Any]) -> dict[str, Any]:
    """``hshare_<field>`` entries of lm-eval ``model_args`` -> `HShareConfig` overrides (popped).

    Raises:
        ConfigError: a field `HShareConfig` does not have (the message lists the fields).
    """
    fields = {f.name for f in dataclasses.fields(HShareConfig)} - {"name"}
    overrides = {}
    for key in [k for k in model_args if k.startswith(OVERRIDE_PREFIX)]:
        name, value = key[len(OVERRIDE_PREFIX):], model_args.pop(key)
        if name not in fields:
            raise ConfigError(f"model_args {key}: HShareConfig has no field {name!r}; accepted: "
                                     f"{', '.join(OVERRIDE_PREFIX + f for f in sorted(fields))}")
        if name == "dense_layers" and isinstance(value, (str, int)):
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
    """

    last: "HShareLM | None" = None  # the latest instance (``hshare eval`` prints its work counters)

    def __init__(self, pretrained: Any = None, hshare: HShareConfig | str | None = None,
                 dense_fallback: bool = False, **kwargs: Any) -> None:
        overrides = parse_overrides(kwargs)
        self.hshare_config = evaluation_config(hshare, overrides, dense_fallback)  # validated before loading
        if pretrained is None:  # the embedded model, float32 unless a dtype is given
            from hshare.default_model import load_model, torch_dtype

            dtype = torch_dtype(kwargs.pop("dtype", "auto"), torch.float32)
            pretrained, tokenizer = load_model(None, kwargs.pop("gguf_file", None), dtype, kwargs.pop("device", None))
            kwargs.setdefault("tokenizer", tokenizer)
        super().__init__(pretrained=pretrained, **kwargs)
        self.work = WorkTotals()
        patch(self._model, self.hshare_config)
        HShareLM.last = self

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        if patch_state(self._model) is None:  # unpatched (`unpatch`): lm-eval's own generation
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        cache = new_cache(self._model)
        out = super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
        self.work.add(cache.stats)
        return out

    def unpatch(self) -> None:
        """Restore the wrapped model (e.g. before patching it with another config)."""
        unpatch(self._model)

