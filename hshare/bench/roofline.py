"""What a decode step must read, and the rate that caps: the roofline column of ``hshare bench generate``,
and the memory estimate the grid (`hshare.bench.grid`) skips shapes by.

A decode step of a memory-bound model cannot take less than (bytes it must read) / (the device's
bandwidth), so rows / that time is the *floor* rate no path can beat; a row's measured rate over it is
the fraction of the floor it reached. The bytes are counted by `decode_step_bytes` (one formula, with its
terms in its docstring); the bandwidth is measured in the same run by a device-to-device copy
(`hshare.bench.timing.copy_bandwidth`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hshare import patches
from hshare.planner import sources_for_ratio

GIB = 2**30


@dataclass(frozen=True)
class SparseReads:
    """What the sparse decode steps of a config read besides the weights (`decode_step_bytes`).

    Attributes:
        sparse_layers: L_s, layers that attend sparsely (the others read every key, as dense).
        budget: N_c, critical tokens a row attends to in a sparse layer.
        critical_token_bytes: bytes of K and V read per critical token in one sparse layer:
            ``2 x H_read x d x e`` with H_read = Hkv (one selection per KV head) or Hq (one per query head).
        scorings: (layer, selection head) scorings per row and step, averaged over the steps:
            ``sources(a, L_s) x sources(b, H_sel) / query_group`` (`scorings_per_step`).
        metadata_token_bytes: bytes of selection metadata per cached token and selection head (labels:
            ``r x bits / 8`` of codes plus a scale and a zero; Quest: the page bounds over the page size).
        sparse_share: share of the decode steps that ran sparse (the rest fell back to dense attention,
            `HShareConfig.runtime.dense_fallback_mib`).
    """

    sparse_layers: int
    budget: int
    critical_token_bytes: float
    scorings: float
    metadata_token_bytes: float
    sparse_share: float = 1.0


def decode_step_bytes(weight_bytes: float, rows: int, context: float, layers: int, kv_token_bytes: float,
                      sparse: SparseReads | None = None) -> float:
    """Bytes one decode step must read from device memory (each byte once; writes of the new token's
    K, V and metadata are a token's worth and left out).

    With B = `rows`, n = `context` (cached tokens a row attends to, its valid ones), L = `layers` and
    kv = `kv_token_bytes` (one token's K and V in one layer: ``2 x Hkv x d x e``)::

        dense  = B x n x L x kv
        sparse = B x ( min(n, N_c) x L_s x critical_token_bytes        K, V of the critical tokens
                     + n x (L - L_s) x kv                              dense layers
                     + n x scorings x metadata_token_bytes )           metadata scanned by the scorings
        step   = weights + s x sparse + (1 - s) x dense                s = sparse.sparse_share

    `weight_bytes`: the parameters a step reads (`weight_bytes_read`). `sparse`: None for dense decode
    (``dense``, transformers' paths).
    """
    dense = rows * context * layers * kv_token_bytes
    if sparse is None:
        return weight_bytes + dense
    attended = min(context, sparse.budget)
    per_row = (attended * sparse.sparse_layers * sparse.critical_token_bytes
               + context * (layers - sparse.sparse_layers) * kv_token_bytes
               + context * sparse.scorings * sparse.metadata_token_bytes)
    return weight_bytes + sparse.sparse_share * rows * per_row + (1.0 - sparse.sparse_share) * dense


def floor_rate(rows: int, step_bytes: float, bandwidth: float) -> float:
    """Tokens per second no decode can beat: ``rows / (step_bytes / bandwidth)`` (bandwidth in bytes/s)."""
    return rows * bandwidth / step_bytes


def kv_token_bytes(model_config, element_bytes: int) -> int:
    """One token's K and V in one layer: ``2 x Hkv x d x e``."""
    return 2 * model_config.num_key_value_heads * patches.head_dim(model_config) * element_bytes


def weight_bytes_read(model, rows: int) -> int:
    """Bytes of parameters one decode step of `rows` rows reads: every parameter once, except the
    input embedding table, of which only the rows' tokens are read (unless it is tied to the output
    projection, which reads it whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is not None and output.weight is embedding:
        return total
    return total - embedding.numel() * embedding.element_size() + rows * embedding.shape[1] * embedding.element_size()


def scorings_per_step(config, sparse_layers: int, sel_heads: int) -> float:
    """(layer, selection head) scorings per row and decode step that a sharing config plans:
    ``sources(a, L_s) x sources(b, H_sel) / query_group`` (`hshare.planner.sources_for_ratio`: round(ratio x
    count), at least 1), 0 without heavy tokens (StreamingLLM scores nothing)."""
    if not config.budget.heavy:
        return 0.0
    return (sources_for_ratio(config.sharing.layer, sparse_layers) * sources_for_ratio(config.sharing.head, sel_heads)
            / config.sharing.query_group)


def sparse_reads(config, model_config, element_bytes: int, stats, metadata_bytes: int, rows: int,
                 columns: int) -> SparseReads:
    """`SparseReads` of a patched generate: the config's shape of reads, the metadata's size per token
    from what the cache held, and the share of sparse steps from its counters.

    Args:
        config: the `HShareConfig` it ran (sparse).
        stats: the cache's `DecodeStats` (decode and dense-fallback steps).
        metadata_bytes: ``cache.label_bytes()``: the selection metadata held for `rows` rows of `columns`
            cached columns in the sparse layers (0 when no step was sparse: none was made).
        columns: cached columns per row (the cache's length).
    """
    heads_q, heads_kv = model_config.num_attention_heads, model_config.num_key_value_heads
    head_dim = patches.head_dim(model_config)
    sel_heads = heads_kv if config.planner.selection == "kv_head" else heads_q
    layers = model_config.num_hidden_layers
    sparse_layers = layers - len([i for i in set(config.sharing.dense_layers) if i < layers])
    held = rows * columns * sparse_layers * sel_heads
    steps = stats.decode_steps
    return SparseReads(
        sparse_layers=sparse_layers, budget=config.budget.total,
        critical_token_bytes=2 * sel_heads * head_dim * element_bytes,
        scorings=scorings_per_step(config, sparse_layers, sel_heads),
        metadata_token_bytes=metadata_bytes / held if held else 0.0,
        sparse_share=(steps - stats.dense_fallback_steps) / steps if steps else 0.0)


def estimated_peak_bytes(model_config, weight_bytes: float, element_bytes: int, rows: int, prompt: int,
                         new_tokens: int, padded: bool, sparse: bool) -> float:
    """A generate's peak device memory, estimated before running it (to skip a shape that cannot fit).

    With B rows of n prompt tokens, N new tokens, hidden size h, MLP size I, Hq x d query width, e bytes
    per element::

        held      = weights + KV of B x (n + N) tokens (+ 16 B per token, layer and KV head of labels
                    when sparse) + the residual stream B x n x h x e
                    + the 4-D bool mask B x n x n when a row is padded (transformers' sdpa_mask)
        transient = max(MLP: 3 x B x n x I x e + B x n x h x 4,
                        attention: 4 x B x n x Hq x d x e (+ SDPA's float copy of the mask,
                        B x n x n x e, when padded))
        peak      = 1.02 x (held + transient) + 1 GiB

    Calibrated against measured peaks (`hshare bench generate` reports them): it errs a little high, so a
    shape it skips would not have fit.
    """
    hidden, inner = model_config.hidden_size, model_config.intermediate_size
    query_width = model_config.num_attention_heads * patches.head_dim(model_config)
    layers = model_config.num_hidden_layers
    tokens = rows * (prompt + new_tokens)
    kv = tokens * layers * kv_token_bytes(model_config, element_bytes)
    labels = tokens * layers * model_config.num_key_value_heads * 16 if sparse else 0
    mask = rows * prompt * prompt if padded else 0
    held = weight_bytes + kv + labels + rows * prompt * hidden * element_bytes + mask
    mlp = 3 * rows * prompt * inner * element_bytes + rows * prompt * hidden * 4
    attention = 4 * rows * prompt * query_width * element_bytes + mask * element_bytes
    return 1.02 * (held + max(mlp, attention)) + GIB


def parameter_bytes(model_class, model_config, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in `dtype`, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = model_class(model_config)
    return sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8
