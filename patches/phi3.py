"""Phi-3: q, k and v come from one fused projection (split before RoPE); an optional
``sliding_window`` applies to every layer and is handled as Mistral's (mask read as key validity)."""

from .base import ArchitectureAdapter

PHI3 = ArchitectureAdapter(model_type="phi3", attention_class="Phi3Attention")
