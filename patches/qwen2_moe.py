"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias, optional sliding window)
with sparse experts and a gated shared expert in place of the MLP.

The experts come after attention and never touch the cache: hshare's attention function sees
Qwen2's biased, rotated keys. Windows as in Qwen2 (`patches/qwen2.py`).
"""

from .base import ArchitectureAdapter

QWEN2_MOE = ArchitectureAdapter(model_type="qwen2_moe", attention_class="Qwen2MoeAttention")
