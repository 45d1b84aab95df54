"""``hshare.patch(model)``, ``hshare.unpatch(model)`` and ``with hshare.patched(model):``.

Patching (transformers 5.x attention interface, no forward replacement):
1. registers the attention function ``"hshare"`` and its mask function (transformers' own
   ``sdpa_mask``: without it the mask would silently be None and padding ignored);
2. switches the model to it with ``set_attn_implementation`` (the previous one is restored by
   `unpatch`);
3. adds a forward pre-hook on each attention module that hands the layer the generation's
   `HShareCache` (the cache is not among the attention function's kwargs); on the model, a forward
   pre-hook that takes the cache under either spelling (``cache=``, ``past_key_values=``:
   `hshare.compat`) and refuses ``output_attentions``, and a forward hook that ends a forward over
   an `HShareCache` (the sparse layers' prefill metadata once the forward's activations are freed,
   the step's host counters); on the decoder (``model.base_model``), a forward pre-hook that plans
   each forward before its first layer (`hshare.step`);
4. wraps the instance's ``generate`` so that every call gets a fresh `HShareCache` (unless the
   caller passes a cache), which holds all state of that generation, and so that a prompt prefix
   shared by the rows is detected, prefilled once and held once (`hshare.shared_generate`).
Plain forward calls (no `HShareCache`) stay exact dense attention.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hshare import compat
from hshare.attention import ATTENTION_NAME, hshare_attention
from hshare.cache import HShareCache
from hshare.config import HShareConfig, resolve_config
from hshare.patches import adapter_for
from hshare.policy import policy_class
from hshare.generate_features import OUTPUT_ATTENTIONS_REFUSED, refusal
from hshare.shared_generate import generate_with_shared_prefix
from hshare.static_decode import (StaticDecodeReport, StaticDecoder, new_token_budget, placement_devices,
                                  static_decode_unsupported)

_STATE_ATTR = "_hshare_patch"


@dataclass
class PatchState:
    """What `patch` changed on a model, so that `unpatch` can undo it."""

    config: HShareConfig
    policy_state: Any  # the policy's `SelectionPolicy.model_state` (labels: a heavy-channel calibration)
    previous_attn_implementation: str | None
    hooks: list[Any]
    had_instance_generate: bool


def _register() -> None:
    AttentionInterface.register(ATTENTION_NAME, hshare_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _hand_over_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    cache = compat.cache_from(kwargs)
    if isinstance(cache, HShareCache):
        kwargs["hshare_cache"] = cache
    return args, kwargs


def _before_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before a forward of the patched model: the cache under the installed release's name whichever
    spelling the caller used, and a request for attention weights refused by name, as ``generate`` refuses
    it (transformers refuses ``config.output_attentions = True`` itself under a non-eager attention)."""
    if kwargs.get("output_attentions"):
        raise ValueError(OUTPUT_ATTENTIONS_REFUSED)
    cache = compat.cache_from(kwargs)
    if cache is not None:
        compat.with_cache(kwargs, cache)
    return args, kwargs


def _begin_forward(decoder: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before the decoder's first layer, over an `HShareCache`: the forward planned (`StepPlanner.begin_forward`)."""
    cache = compat.cache_from(kwargs)
    if isinstance(cache, HShareCache):
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        cache.planner.begin_forward(cache, tokens.shape[1], kwargs.get("attention_mask"))
    return args, kwargs


def _after_forward(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """After a forward of the patched model over an `HShareCache`: the sparse layers' prefill metadata, now
    that the forward's activations are freed, and the step's host counters (`StepPlanner.end_forward`)."""
    cache = compat.cache_from(kwargs)
    if cache is None:
        cache = compat.output_cache(output)
    if isinstance(cache, HShareCache):
        cache.planner.end_forward(cache)


def new_cache(model) -> HShareCache:
    """A fresh `HShareCache` for a patched model (what each ``generate`` call gets)."""
    state = patch_state(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched; call hshare.patch(model) first")
    return HShareCache(state.config, model.config, state.policy_state)


def patch_state(model) -> PatchState | None:
    return model.__dict__.get(_STATE_ATTR)


@contextlib.contextmanager
def _without_cache_implementation(model, kwargs: dict) -> Iterator[dict]:
    """`kwargs` without a cache implementation, and none in the generation configs for the call
    (generate refuses one next to a cache object; it also reads the model's own config)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "cache_implementation"}
    configs = [c for c in (kwargs.get("generation_config"), model.generation_config)
               if getattr(c, "cache_implementation", None) is not None]
    saved = [c.cache_implementation for c in configs]
    for c in configs:
        c.cache_implementation = None
    try:
        yield kwargs
    finally:
        for c, value in zip(configs, saved):
            c.cache_implementation = value


def _wrap_generate(model) -> None:
    original = type(model).generate.__get__(model)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        wants_cache = kwargs.get("use_cache", True) is not False
        given = compat.cache_from(kwargs)  # either spelling; passed on under the installed release's name
        kwargs = compat.without_cache(kwargs)
        refused = refusal(model, kwargs, hshare_cache=given is None and wants_cache)
        if refused is not None:
            raise ValueError(refused)
        if given is not None or not wants_cache:
            return _generate(model, original, args, kwargs if given is None else compat.with_cache(kwargs, given))
        with _without_cache_implementation(model, kwargs) as kwargs:
            return _generate(model, original, args, compat.with_cache(kwargs, new_cache(model)))

    model.generate = generate


def refuse_split_placement(model, config: HShareConfig) -> None:
    """Sparse decode of a model whose layers sit on several devices (accelerate's ``device_map``) is not
    supported yet: a step's shared state (row windows, plan, selections) lives on the first layer's
    device. Raised before anything is generated, naming what is accepted."""
    devices = placement_devices(model)
    if config.sparse and len(devices) > 1:
        raise ValueError(
            f"hshare's sparse presets do not yet support a model split over devices {devices} (device_map); "
            "accepted: the 'dense' preset (exact, the shared prefix still held once), the model on one device, "
            "or tensor parallelism (from_pretrained(..., tp_plan='auto') under torchrun)"
        )


def _generate(model, original, args: tuple, kwargs: dict):
    """``generate`` with hshare's cache: the shared prefix held once, static-shape decode."""
    cache = compat.cache_from(kwargs)
    if isinstance(cache, HShareCache):
        refuse_split_placement(model, cache.config)  # the model may have been dispatched after patching
    if isinstance(cache, HShareCache) and cache.prefix is not None:
        raise ValueError(
            "this HShareCache holds a shared-prefix layout from an earlier generate (its columns are not the "
            "returned sequences' columns), so generation cannot continue from it; accepted: a fresh cache, or "
            "patch with prefix='off' for caches you continue"
        )
    if not isinstance(cache, HShareCache):
        return original(*args, **kwargs)
    with static_decode(model, cache, args, kwargs):
        if not cache.get_seq_length() and cache.config.shares_prefix:
            shared = generate_with_shared_prefix(model, original, cache, args, kwargs)
            if shared is not None:
                return shared
        return original(*args, **kwargs)


@contextlib.contextmanager
def static_decode(model, cache: HShareCache, args: tuple, kwargs: dict) -> Iterator[None]:
    """Decode with static shapes and CUDA graphs for one ``generate`` call where it applies
    (`hshare.static_decode`); ``cache.static_decode`` reports what ran and, if eager, why."""
    report = cache.static_decode = StaticDecodeReport()
    input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    reason = static_decode_unsupported(model, cache, kwargs)
    new_tokens = None
    if reason is None:
        width = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else None
        new_tokens = None if width is None else new_token_budget(model, kwargs, width)
        if new_tokens is None:
            reason = "the number of new tokens is unknown (pass max_new_tokens)"
    if reason is not None:
        report.reason = reason
        yield
        return
    previous = model.__dict__.get("forward")  # an instance forward (accelerate's hooks) stays in the chain
    decoder = model.forward = StaticDecoder(model, model.forward, new_tokens, report)
    try:
        yield
    finally:
        decoder.close()
        if previous is None:
            del model.forward
        else:
            model.forward = previous
        cache.thaw()


def patch(model, config: HShareConfig | str | os.PathLike | None = None, **overrides: Any):
    """Make `model` decode with HShare sparse attention.

    Args:
        model: a transformers causal LM of a supported architecture (`hshare.patches.ADAPTERS`).
        config: an `HShareConfig`, a preset name (``hshare.preset_names()``), or a YAML path;
            default ``"hshare-1_2-1_2-1_2"``.
        **overrides: `HShareConfig` fields replacing the config's (``heavy=432, sink=16``).

    Returns:
        The same model, patched in place. Patching a patched model replaces its config.
    """
    compat.check_installed()
    adapter = adapter_for(model)
    config = resolve_config(config, **overrides)
    model_config = model.config
    config.validate_for_model(model_config.num_hidden_layers, adapter.head_dim(model_config))
    refuse_split_placement(model, config)
    policy_state = policy_class(config.policy.name).model_state(config, model_config) if config.sparse else None

    state = patch_state(model)
    if state is not None:  # patched already: swap the config, keep hooks and wrappers
        state.config, state.policy_state = config, policy_state
        return model

    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    hooks = [m.register_forward_pre_hook(_hand_over_cache, with_kwargs=True) for m in adapter.attention_modules(model)]
    hooks.append(model.register_forward_pre_hook(_before_forward, with_kwargs=True))
    hooks.append(model.base_model.register_forward_pre_hook(_begin_forward, with_kwargs=True))
    hooks.append(model.register_forward_hook(_after_forward, with_kwargs=True))
    had_instance_generate = "generate" in model.__dict__
    model.__dict__[_STATE_ATTR] = PatchState(config, policy_state, previous, hooks, had_instance_generate)
    if not had_instance_generate:
        _wrap_generate(model)
    return model


def unpatch(model):
    """Undo `patch`: previous attention implementation, no hooks, the class's ``generate``."""
    state = patch_state(model)
    if state is None:
        return model
    for hook in state.hooks:
        hook.remove()
    if not state.had_instance_generate:
        model.__dict__.pop("generate", None)
    if state.previous_attn_implementation is not None:
        model.set_attn_implementation(state.previous_attn_implementation)
    del model.__dict__[_STATE_ATTR]
    return model


@contextlib.contextmanager
def _restored(model) -> Iterator[None]:
    """The model's patch state (unpatched, or patched with its config) restored after the block."""
    was = patch_state(model)
    previous_config = was.config if was is not None else None
    try:
        yield
    finally:
        if previous_config is None:
            unpatch(model)
        else:
            patch(model, previous_config)


@contextlib.contextmanager
def patched(model, config: HShareConfig | str | os.PathLike | None = None, **overrides: Any) -> Iterator[Any]:
    """``with hshare.patched(model, "ds"):`` patches for the block and restores the model after."""
    with _restored(model):
        patch(model, config, **overrides)
        yield model


@contextlib.contextmanager
def unpatched(model) -> Iterator[Any]:
    """``with hshare.unpatched(model):`` the stock model for the block (its own attention and caches), and its
    patch, if it had one, restored after."""
    with _restored(model):
        unpatch(model)
        yield model
