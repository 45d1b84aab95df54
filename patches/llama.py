"""Llama (and Llama-shaped models such as SmolLM2): full causal attention, MHA or GQA."""

from .base import ArchitectureAdapter

LLAMA = ArchitectureAdapter(model_type="llama", attention_class="LlamaAttention")
