"""StarCoder2: biased q/k/v/o projections and LayerNorm; an optional ``sliding_window`` applies to
every layer and is handled as Mistral's (mask read as key validity, full KV kept)."""

from .base import ArchitectureAdapter

STARCODER2 = ArchitectureAdapter(model_type="starcoder2", attention_class="Starcoder2Attention")
