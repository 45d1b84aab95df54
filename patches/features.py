"""Attention features hshare cannot reproduce exactly, found in a model's config and modules.

hshare's attention function computes ``softmax(q k^T * scaling) v`` over the keys that the mask
transformers hands each layer allows, and it builds the decode step's token windows once, from
the first layer's mask, for every layer (selections are shared across layers). A model needs more
than that when its attention

* soft-caps the logits (``cap * tanh(s / cap)`` before the softmax: Gemma 2, ``attn_logit_softcapping``);
* mixes attention types across layers (full and sliding-window layers alternating: Gemma 2 / 3,
  gpt-oss, Qwen2/Qwen3 with ``use_sliding_window`` and ``0 < max_window_layers < layers``): one
  window per step would let a sliding layer attend to tokens outside its window (or cut a full
  layer to the window), and a layer copying another's selection could inherit such tokens;
* uses another attention type in every layer (chunked, linear, state-space);
* adds learned sink logits to the softmax denominator (gpt-oss ``sinks``);
* is not causal (``use_bidirectional_attention``, ``is_causal=False``: decode-time sparsity and the
  shared prefix assume that a token sees only earlier tokens).

`find_unsupported` reports the first of these it finds, so that `hshare.patches.adapter_for`
refuses the model by name, with the reason, before anything is patched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACCEPTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class UnsupportedFeature:
    """An attention feature of a model that hshare does not compute.

    Attributes:
        feature: what it is called (``"attention logit soft-capping"``).
        evidence: where it was found (``"attn_logit_softcapping=50.0"``).
        reason: why hshare's attention would not be exact with it.
        accepted: what hshare accepts instead.
    """

    feature: str
    evidence: str
    reason: str
    accepted: str


def _soft_capping(config, model) -> UnsupportedFeature | None:
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is None:
        return None
    return UnsupportedFeature(
        "attention logit soft-capping", f"attn_logit_softcapping={cap}",
        "the logits pass through cap * tanh(logits / cap) before the softmax; hshare's dense, sparse and "
        "shared-prefix attention compute the plain scaled softmax",
        "attn_logit_softcapping=None")


def _layer_types(config) -> list[str] | None:
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None)  # older Gemma-style configs
    layers = getattr(config, "num_hidden_layers", None)
    if pattern and pattern > 1 and layers and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return None


def _mixed_layer_types(config, model) -> UnsupportedFeature | None:
    types = _layer_types(config)
    if not types or len(set(types)) < 2:
        return None
    spans = ", ".join(f"{kind} (layers {_layer_list(types, kind)})" for kind in dict.fromkeys(types))
    return UnsupportedFeature(
        "alternating sliding windows" if "sliding_attention" in types else "mixed attention types",
        f"layer_types mixes {spans}",
        "hshare builds one set of token windows (sink, local, selectable middle) per decode step from the first "
        "layer's mask and shares selected tokens across layers, so a sliding layer could attend to tokens outside "
        "its window",
        "every layer 'full_attention', or every layer 'sliding_attention' with one window (Qwen2/Qwen3: "
        "use_sliding_window=False, or max_window_layers=0)")


def _other_layer_type(config, model) -> UnsupportedFeature | None:
    types = _layer_types(config) or []
    other = [kind for kind in dict.fromkeys(types) if kind not in ACCEPTED_LAYER_TYPES]
    if not other:
        return None
    return UnsupportedFeature(
        f"{other[0]} layers", f"layer_types contains {other[0]!r}",
        "hshare replaces softmax attention over a causal or sliding-window mask only",
        f"layer_types from {', '.join(map(repr, ACCEPTED_LAYER_TYPES))}")


def _chunked(config, model) -> UnsupportedFeature | None:
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None:
        return None
    return UnsupportedFeature(
        "chunked attention", f"attention_chunk_size={chunk}",
        "queries attend only within their chunk; hshare's windows and shared prefix assume causal attention",
        "attention_chunk_size=None")


def _sinks(config, model) -> UnsupportedFeature | None:
    owners = [type(m).__name__ for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    if not owners:
        return None
    return UnsupportedFeature(
        "attention sinks", f"{owners[0]}.sinks",
        "a learned per-head sink logit joins every softmax denominator; hshare's softmax has no extra term",
        "attention without sink parameters")


def _bidirectional(config, model) -> UnsupportedFeature | None:
    if getattr(config, "use_bidirectional_attention", None):
        evidence = "use_bidirectional_attention=True"
    elif getattr(config, "is_causal", True) is False:
        evidence = "is_causal=False"
    else:
        return None
    return UnsupportedFeature(
        "bidirectional attention", evidence,
        "hshare decodes causal language models (each new token attends to the tokens before it)",
        "causal attention")


_CHECKS = (_soft_capping, _mixed_layer_types, _other_layer_type, _chunked, _sinks, _bidirectional)


def _layer_list(types: list[str], kind: str) -> str:
    layers = [i for i, t in enumerate(types) if t == kind]
    return ", ".join(map(str, layers[:6])) + (", ..." if len(layers) > 6 else "")


def find_unsupported(model) -> UnsupportedFeature | None:
    """The first attention feature of `model` that hshare does not compute, or None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for check in _CHECKS:
        found = check(text_config, model)
        if found is not None:
            return found
    return None
