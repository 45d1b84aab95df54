"""What hshare needs to know about an architecture to patch it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArchitectureAdapter:
    """How to find a model's attention modules and read its attention geometry.

    Attributes:
        model_type: transformers' ``config.model_type``.
        attention_class: class name of the attention module (``LlamaAttention``).
    """

    model_type: str
    attention_class: str

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The attention modules in layer order; each has ``layer_idx`` and ``scaling``."""
        modules = [m for m in model.modules() if type(m).__name__ == self.attention_class]
        return sorted(modules, key=lambda m: m.layer_idx)

    def head_dim(self, config) -> int:
        return head_dim(config)


def head_dim(config) -> int:
    """The size of an attention head: ``config.head_dim`` where the architecture sets one (Gemma, Qwen3 may
    differ from hidden / heads), else ``hidden_size // num_attention_heads``. The one place hshare derives it."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window(config) -> int | None:
    """The sliding window every layer applies (keys older than it are invalid), or None: full attention,
    or a window the config names but no layer applies. Mixed windows are refused when patching
    (`hshare.patches.features`)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if window and all(t == "sliding_attention" for t in types) else None
    return window if getattr(config, "use_sliding_window", True) else None
