"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (an RMSNorm over each head of q and
of k before RoPE) with sparse experts in place of the MLP.

The experts come after attention and never touch the cache: the keys hshare caches and scores are
the normed, rotated keys, as in Qwen3 (`patches/qwen3.py`).
"""

from .base import ArchitectureAdapter

QWEN3_MOE = ArchitectureAdapter(model_type="qwen3_moe", attention_class="Qwen3MoeAttention")
