"""Qwen3: Qwen2's attention without the projection bias (``attention_bias``, off by default) and
with an RMSNorm over each head of q and of k (``q_norm``, ``k_norm``).

The norms run inside the attention module before RoPE and before the cache update, so the keys
hshare caches and scores (labels, Quest pages) are the normed and rotated keys, and the queries it
receives are normed and rotated too: nothing to add. Sliding windows as in Qwen2.
"""

from .base import ArchitectureAdapter

QWEN3 = ArchitectureAdapter(model_type="qwen3", attention_class="Qwen3Attention")
