"""Granite: Llama's attention with the softmax scale set by ``attention_multiplier`` instead of
``head_dim ** -0.5``; it reaches hshare as the ``scaling`` argument, which hshare always uses."""

from .base import ArchitectureAdapter

GRANITE = ArchitectureAdapter(model_type="granite", attention_class="GraniteAttention")
