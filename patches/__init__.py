"""Registry of supported architectures: one adapter per model type, one file each.

Supported: Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Gemma, Granite, OLMo 2, Phi-3,
StarCoder2. `adapter_for`
refuses, by name, with the reason and what is accepted, before anything is patched: a model with
an attention feature hshare does not compute (`hshare.patches.features`: logit soft-capping,
alternating sliding windows, attention sinks, ...), a model type with no adapter, and a model in
which the adapter does not find one attention module per layer.

Adding a model. hshare works with any model whose attention modules call transformers' attention
interface with the standard arguments: ``fn(module, q [B, Hq, T, d], k, v [B, Hkv, n, d],
attention_mask, scaling=..., dropout=...)`` with q and k already position-encoded and k, v what
``past_key_values.update`` returned; the module has ``layer_idx``; the model builds its masks with
``masking_utils`` (``create_causal_mask`` / ``create_sliding_window_causal_mask``); the config has
``num_hidden_layers``, ``num_attention_heads`` and ``num_key_value_heads``. For such a model the
adapter is one line,

    ArchitectureAdapter(model_type="mixtral", attention_class="MixtralAttention")

either built in (a file ``patches/<model_type>.py`` listed in ``_BUILT_IN`` below, and a row in
``MODELS`` of ``tests/test_architectures.py``, which runs Llama's exactness tests on it) or
registered at run time with `register` (the caller vouches that the model fits; the feature checks
still run). Unknown model types are never accepted silently.
"""

from __future__ import annotations

from .base import ArchitectureAdapter, head_dim, sliding_window
from .features import UnsupportedFeature, find_unsupported
from .gemma import GEMMA
from .granite import GRANITE
from .llama import LLAMA
from .mistral import MISTRAL
from .mixtral import MIXTRAL
from .olmo2 import OLMO2
from .phi3 import PHI3
from .qwen2 import QWEN2
from .qwen2_moe import QWEN2_MOE
from .qwen3 import QWEN3
from .qwen3_moe import QWEN3_MOE
from .starcoder2 import STARCODER2

_BUILT_IN = (LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE, GEMMA, GRANITE, OLMO2, PHI3, STARCODER2)
ADAPTERS: dict[str, ArchitectureAdapter] = {adapter.model_type: adapter for adapter in _BUILT_IN}


class UnsupportedModelError(ValueError):
    """The model's architecture has no hshare adapter, or an attention feature hshare does not compute."""


def register(adapter: ArchitectureAdapter) -> ArchitectureAdapter:
    """Accept `adapter.model_type` from now on (the caller vouches that its attention reaches the
    attention interface with the standard arguments: see this module's docstring)."""
    if not isinstance(adapter, ArchitectureAdapter):
        raise TypeError(f"register takes an ArchitectureAdapter, got {type(adapter).__name__}")
    ADAPTERS[adapter.model_type] = adapter
    return adapter


def adapter_for(model) -> ArchitectureAdapter:
    """The adapter for `model`, or `UnsupportedModelError` naming the model type, the reason and what
    is accepted."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = f"model_type {model_type!r} ({type(model).__name__})"
    found = find_unsupported(model)
    if found is not None:
        raise UnsupportedModelError(
            f"hshare cannot patch {name}: its attention uses {found.feature} ({found.evidence}); {found.reason}. "
            f"Accepted: {found.accepted}"
        )
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"hshare does not support {name}: no adapter for this model type. Accepted model types: "
            f"{', '.join(sorted(ADAPTERS))}; a model whose attention calls transformers' attention interface with "
            f"the standard arguments can be added with hshare.patches.register(ArchitectureAdapter(...))"
        )
    adapter = ADAPTERS[model_type]
    modules = adapter.attention_modules(model)
    layers = getattr(config, "num_hidden_layers", None)
    if len(modules) != layers:
        raise UnsupportedModelError(
            f"hshare cannot patch {name}: found {len(modules)} {adapter.attention_class} modules for {layers} layers. "
            f"Accepted: one {adapter.attention_class} per layer"
        )
    return adapter


__all__ = ["ADAPTERS", "ArchitectureAdapter", "UnsupportedFeature", "UnsupportedModelError", "adapter_for",
           "find_unsupported", "head_dim", "register", "sliding_window"]
