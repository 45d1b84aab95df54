"""Registry of supported architectures: one adapter per model type."""

from __future__ import annotations

from .base import ArchitectureAdapter
from .llama import LLAMA
from .mistral import MISTRAL

ADAPTERS: dict[str, ArchitectureAdapter] = {adapter.model_type: adapter for adapter in (LLAMA, MISTRAL)}


class UnsupportedModelError(ValueError):
    """The model's architecture has no hshare adapter."""


def adapter_for(model) -> ArchitectureAdapter:
    """The adapter for `model`, or `UnsupportedModelError` naming the supported model types."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"hshare does not support model_type {model_type!r} ({type(model).__name__}); supported: "
            f"{', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type]


__all__ = ["ADAPTERS", "ArchitectureAdapter", "UnsupportedModelError", "adapter_for"]
