"""Qwen2 (and Qwen2.5): Llama's attention with a bias on the q, k and v projections.

The bias is added before RoPE, so the cached keys are biased and rotated, which is all hshare's
attention function sees. Qwen2's optional sliding window (``use_sliding_window``) covers the
layers from ``max_window_layers`` on: with ``max_window_layers=0`` every layer slides by the same
window (handled as Mistral's: the sliding-window mask is read as key validity, full KV is kept);
a model whose layers mix full and sliding attention is refused by `hshare.patches.features`.
"""

from .base import ArchitectureAdapter

QWEN2 = ArchitectureAdapter(model_type="qwen2", attention_class="Qwen2Attention")
