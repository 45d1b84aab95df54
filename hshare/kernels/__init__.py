"""Hot operations of sparse decoding: label quantization and scoring, gather-attention with LSE,
the exact LSE merge, and the prompt's heavy-channel statistic. Each is a plain-PyTorch function
(the CPU path and the test oracle); the Triton kernels for CUDA tensors sit beside their twins.
"""

from __future__ import annotations

from .cache_write import write_kv_column, write_kv_column_torch
from .candidate_keys import candidate_key_topk, candidate_key_topk_torch
from .channel_statistic import channel_statistic, channel_statistic_torch
from .critical_indices import (NO_TOKEN, CriticalWindows, critical_indices, critical_indices_torch, in_window,
                               with_critical)
from .heavy_topk import select_heavy, select_heavy_torch
from .label_topk import candidate_label_topk, candidate_label_topk_torch, candidate_label_walk, \
    candidate_label_walk_torch, decode_label_topk, decode_label_topk_torch, decode_label_topk_walk, \
    decode_label_topk_walk_torch, label_topk, label_topk_torch
from .dispatch import use_triton
from .gather_attention import gather_attention, gather_attention_torch
from .labels import append_labels, candidate_label_scores, decode_label_scores, dequantize_labels, label_scores, label_storage_dtype, \
    quantize_labels, query_labels, score_heads
from .merge import merge_attention_splits, merge_attention_states
from .page_scores import page_scores, page_scores_torch
from .page_topk import page_heavy, page_heavy_torch
from .prefix_attention import attention_with_lse, attention_with_lse_torch, shared_prefix_attention, \
    shared_prefix_decode_states
from .shared_decode import PrefixKV, shared_decode_attention, shared_decode_attention_torch
from .split_decode import split_decode_attention, split_decode_attention_torch
from .successors import with_successors, with_successors_torch

__all__ = [
    "use_triton",
    "channel_statistic",
    "channel_statistic_torch",
    "NO_TOKEN",
    "CriticalWindows",
    "PrefixKV",
    "critical_indices",
    "critical_indices_torch",
    "in_window",
    "append_labels",
    "attention_with_lse",
    "attention_with_lse_torch",
    "candidate_key_topk",
    "candidate_key_topk_torch",
    "candidate_label_scores",
    "candidate_label_topk",
    "candidate_label_topk_torch",
    "candidate_label_walk",
    "candidate_label_walk_torch",
    "decode_label_scores",
    "decode_label_topk",
    "decode_label_topk_torch",
    "decode_label_topk_walk",
    "decode_label_topk_walk_torch",
    "dequantize_labels",
    "gather_attention",
    "gather_attention_torch",
    "label_scores",
    "label_topk",
    "label_topk_torch",
    "label_storage_dtype",
    "merge_attention_splits",
    "merge_attention_states",
    "quantize_labels",
    "query_labels",
    "score_heads",
    "select_heavy",
    "select_heavy_torch",
    "shared_prefix_attention",
    "shared_decode_attention",
    "shared_decode_attention_torch",
    "shared_prefix_decode_states",
    "page_heavy",
    "page_heavy_torch",
    "page_scores",
    "page_scores_torch",
    "split_decode_attention",
    "split_decode_attention_torch",
    "with_successors",
    "with_successors_torch",
    "with_critical",
    "write_kv_column",
    "write_kv_column_torch",
]
