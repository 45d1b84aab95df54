"""Gemma (the first generation): Llama's attention; what differs (embeddings scaled by the square
root of the width, GeGLU, RMSNorm with ``1 + weight``) lies outside attention.

``use_bidirectional_attention`` (the EmbeddingGemma variant) is refused by `hshare.patches.features`.
Gemma 2 and 3 are not this adapter: they soft-cap logits or alternate sliding and full layers.
"""

from .base import ArchitectureAdapter

GEMMA = ArchitectureAdapter(model_type="gemma", attention_class="GemmaAttention")
