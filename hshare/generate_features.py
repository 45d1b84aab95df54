"""What a patched ``generate`` does with each of transformers' ``generate`` features: the one table.

Every feature not listed runs as on the unpatched model, with hshare's cache, static-shape decode
and the shared prefix. A listed feature is either refused (a clear error naming it and what is
accepted: the patched model cannot give what it asks for), or served with the eager decode path
(`hshare.static_decode` does not apply), or served without holding the shared prefix once
(`hshare.shared_generate` does not apply), each with its reason. Conditions that are not features a
caller asks for (the device, the model's placement, the config) stay with the path they concern.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# the cache implementations a patched generate serves with hshare's cache; any other is refused
HSHARE_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")


def generation_setting(model, kwargs: dict, name: str) -> Any:
    """A generate setting: the call's keyword, else its generation config's, else the model's."""
    config = kwargs.get("generation_config") or model.generation_config
    return kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)


@dataclass(frozen=True)
class GenerateFeature:
    """One feature of ``generate`` that a patched model does not serve like any other.

    Attributes:
        name: the feature as the caller names it.
        asked: whether a call ``(model, kwargs)`` asks for it.
        refused: the refusal's message (what is wrong and what is accepted), or "" when served.
        refused_with_hshare_cache_only: refused only where hshare makes the cache (a cache of the
            caller's own, or ``use_cache=False``, runs transformers' own path).
        eager: why static-shape decode does not apply, or "".
        unshared: why the shared prefix is not held once, or "".
    """

    name: str
    asked: Callable[[Any, dict], bool]
    refused: str = ""
    refused_with_hshare_cache_only: bool = False
    eager: str = ""
    unshared: str = ""


def _setting(name: str) -> Callable[[Any, dict], bool]:
    return lambda model, kwargs: bool(generation_setting(model, kwargs, name))


def _given(name: str) -> Callable[[Any, dict], bool]:
    return lambda model, kwargs: kwargs.get(name) is not None


OUTPUT_ATTENTIONS_REFUSED = (
    "output_attentions=True on an hshare-patched model: its attention returns no weights (decode attends to "
    "critical tokens only, prefill and dense steps run SDPA); accepted: output_attentions=False, or "
    "hshare.unpatch(model) (or `with hshare.patched(...)` around the calls that should be patched) to get the weights"
)

FEATURES = (
    GenerateFeature("output_attentions", _setting("output_attentions"), refused=OUTPUT_ATTENTIONS_REFUSED),
    GenerateFeature(
        "cache_implementation",
        lambda model, kwargs: generation_setting(model, kwargs, "cache_implementation") not in HSHARE_CACHE_IMPLEMENTATIONS,
        refused="cache_implementation={implementation!r} is not available on an hshare-patched model (its cache is "
                "hshare's); accepted: None or 'dynamic' (hshare's cache), 'static' (hshare's cache with static shapes "
                "and CUDA graphs, the default on CUDA), or hshare.unpatch(model) first",
        refused_with_hshare_cache_only=True,
    ),
    GenerateFeature("num_beams", lambda model, kwargs: (generation_setting(model, kwargs, "num_beams") or 1) > 1,
                    eager="beam search reorders the cache every step",
                    unshared="beam search regroups rows by beam scores"),
    GenerateFeature("assistant_model", _given("assistant_model"),
                    eager="assisted decoding feeds several tokens per step",
                    unshared="assisted decoding feeds several tokens per step"),
    GenerateFeature("prompt_lookup_num_tokens", _setting("prompt_lookup_num_tokens"),
                    eager="assisted decoding feeds several tokens per step"),
    GenerateFeature("output_hidden_states", _setting("output_hidden_states"),
                    eager="output_hidden_states=True needs the eager forward",
                    unshared="the hidden states would cover the rearranged prompt, not the caller's"),
    GenerateFeature("streamer", _given("streamer"),
                    unshared="the streamer would be handed the rearranged prompt, not the caller's"),
    GenerateFeature("inputs_embeds", _given("inputs_embeds"), unshared="the prefix is found on token ids"),
)


def refusal(model, kwargs: dict, hshare_cache: bool) -> str | None:
    """The message refusing this ``generate`` call, or None (checked before anything runs).

    Args:
        hshare_cache: the call will run with a cache hshare makes (no cache of the caller's, ``use_cache``).
    """
    for feature in FEATURES:
        if feature.refused and (hshare_cache or not feature.refused_with_hshare_cache_only) \
                and feature.asked(model, kwargs):
            implementation = generation_setting(model, kwargs, "cache_implementation")
            return feature.refused.format(implementation=implementation)
    return None


def eager_reason(model, kwargs: dict) -> str | None:
    """Why the features this call asks for need eager decode, or None."""
    return next((f.eager for f in FEATURES if f.eager and f.asked(model, kwargs)), None)


def unshared_reason(model, kwargs: dict) -> str | None:
    """Why the features this call asks for keep the shared prefix per row, or None."""
    return next((f.unshared for f in FEATURES if f.unshared and f.asked(model, kwargs)), None)
