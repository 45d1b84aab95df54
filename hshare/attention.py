"""The attention function registered as ``"hshare"`` with transformers' `AttentionInterface`.

It runs what the step planner decided before layer 0 of the forward (`hshare.step`): it never
decides a step itself.

* No `HShareCache` (a plain forward, lm-eval loglikelihood, a user's own cache): exact SDPA.
* Prefill: exact SDPA, or with ``sparse_prefill`` each query row of a sparse layer over its own
  critical tokens (`hshare.sparse_prefill`); sparse layers make their selection policy
  (`hshare.policy`) and leave what its metadata and the planner's evidence need; both are built
  once the forward is done (`hshare.prefill_metadata`: not alive beside the forward's activations).
* Shared prefix (`HShareCache.prefix`): prefill and decode attend exactly to the prefix levels
  held once (one batched product per group and KV head) and to the row's own columns (dense, or
  HShare-sparse on sparse layers), merged exactly by LSE.
* Decode (the step's `hshare.step.DecodeStep`): dense layers and dense steps run exact attention
  (split-KV, `hshare.kernels.split_decode_attention`). Sparse layers write the new token's
  metadata; at selection steps the layer's source heads score the selectable window and take the
  top-k, copying heads and layers reuse their source's columns; then gather-attention over sink +
  heavy + local, or exact attention when every row is within the budget.
* Heads: everything per head is sized from the tensors received at the first prefill, which under
  tensor parallelism hold the rank's own heads (`hshare.heads`).
* Work counters (`hshare.counters`): every decode path tells the planner what it read (a dense
  reading, or the critical indices), with device tensors only.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hshare import prefill_metadata
from hshare.cache import HShareCache, HShareLayer
from hshare.step import DecodeStep
from hshare.heads import head_shard
from hshare.kernels import (CriticalWindows, attention_with_lse, gather_attention, merge_attention_states,
                            split_decode_attention)
from hshare.refine import Refine, refine_by_keys, select_candidates
from hshare.selection import NO_TOKEN, per_head, valid_columns_from_mask
from hshare.sparse_prefill import sparse_prefill_attention

ATTENTION_NAME = "hshare"


def hshare_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     hshare_cache: HShareCache | None = None, **kwargs):
    """Attention with transformers' calling convention.

    Args:
        query: ``[B, Hq, T, d]``; key, value: ``[B, Hkv, n, d]`` (the whole cache after update).
        attention_mask: bool ``[B, 1, T, n]`` or None (see transformers' ``sdpa_mask``).
        hshare_cache: handed over by the forward pre-hook `hshare.api` installs.

    Returns:
        ``(out [B, T, Hq, d], None)``.
    """
    cache = hshare_cache
    if not isinstance(cache, HShareCache) or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    planner = cache.planner
    layer_idx = module.layer_idx
    scaling = module.scaling if scaling is None else scaling
    if planner.forward is None:
        raise RuntimeError("an HShareCache forward reached the attention without a planned step; the patched "
                           "model's forward plans each forward (hshare.patch): call the model, not its inner modules")
    if planner.forward == "prefill":
        return _prefill(module, cache, layer_idx, query, key, value, attention_mask, scaling, dropout, **kwargs)

    step = planner.current
    layer = cache.layers[layer_idx]
    sparse = planner.is_sparse(layer_idx)
    if sparse:
        if cache.static is None:
            layer.policy.append(key[:, :, layer.policy.length:])
        else:
            layer.policy.write(cache.static.column, key)
    if not sparse or step.dense:
        if not step.dense:  # a dense step counted its reads once, at its start
            planner.work.add_dense_layer()
        if cache.prefix is None:
            return _dense_decode(query, key, value, step.valid, scaling), None
        return _decode_attention(cache, layer_idx, query, key, value, step.own_columns, scaling), None
    by_keys = refine_by_keys(key) if cache.config.sharing.refine_by == "keys" else None
    dense = step.windows.all_short and cache.prefix is None  # every row fits the budget: exact dense attention
    # the critical indices' operands; a refinement of every row and head writes them in its own launch
    critical = None if dense else step.windows.critical_windows(planner.work.rows_read(query.device))
    indices = None
    if step.selecting:
        if cache.config.candidate_count:
            indices = _select_candidates(cache, step, layer_idx, query, by_keys, critical)
        else:
            _keep(cache, layer, "heavy", _select_heavy_columns(cache, step, layer_idx, query))
    elif layer.candidates is not None and cache.config.sharing.refine_steps:  # refined with this step's query
        indices = _refine(cache, layer, _refinement(layer, by_keys), query[:, :, 0], layer.candidates,
                          step.windows.middle_bounds, critical)
    elif layer.heavy is None:  # no heavy budget (StreamingLLM): sink + local only
        layer.heavy = torch.full((query.shape[0], cache.sel_heads, cache.config.budget.heavy), NO_TOKEN, dtype=torch.long,
                                 device=query.device)
    if dense:
        planner.work.add_dense_layer()
        return _dense_decode(query, key, value, step.valid, scaling), None
    if indices is None:
        indices = critical.indices(layer.heavy)
    return _decode_attention(cache, layer_idx, query, key, value, indices, scaling), None


def _prefill(module, cache: HShareCache, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, scaling: float, dropout: float, **kwargs):
    """A prefill forward's attention, and what its sparse layers leave for their metadata.

    Returns:
        ``(out [B, T, Hq, d], None)``.
    """
    config, planner = cache.config, cache.planner
    batch, kv_len = query.shape[0], key.shape[2]
    prefix = cache.prefix_attention(layer_idx, query, scaling)  # exact, over the shared prefix levels
    if cache.heads is None:  # the first prefill sizes per-head state (a rank's own heads under TP)
        cache.set_heads(head_shard(module, query, key))
    cache.check_heads(layer_idx, query, key)
    sparse = planner.is_sparse(layer_idx) and not cache.filling_prefix
    if sparse:  # the policy from the prompt's queries; its metadata once the forward is done
        valid = valid_columns_from_mask(attention_mask, batch, kv_len, 1, query.device)[:, 0]
        prefill_metadata.defer(cache, planner, layer_idx, query, key, valid)
    if prefix is not None:
        if config.runtime.sparse_prefill:
            raise ValueError("HShareConfig.runtime.sparse_prefill does not combine with a shared prefix; accepted: "
                             "prefix='off' (or 'auto', which does not share with sparse prefill)")
        return _own_prefill_attention(query, key, value, attention_mask, scaling, prefix)
    if sparse and config.runtime.sparse_prefill and kv_len > config.budget.total:
        prefill_metadata.complete(cache, planner, layer_idx)  # sparse prefill scores with the metadata now
        return sparse_prefill_attention(query, key, value, attention_mask, scaling, cache.layers[layer_idx].policy,
                                        config.budget.sink, config.budget.local, config.budget.heavy), None
    # dense (a context within the budget: every row would attend to all its keys anyway)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _dense_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """Exact dense attention of a decode step over the keys `valid` ``[B, n]`` marks: ``[B, 1, Hq, d]``
    (`hshare.kernels.split_decode_attention`: a GQA model's keys and values read once, the keys split over
    the GPU's SMs, merged by LSE)."""
    return split_decode_attention(query[:, :, 0], key, value, valid, scaling)[:, None]


def _keep(cache: HShareCache, layer: HShareLayer, name: str, columns: torch.Tensor) -> None:
    """Keep a selection's heavy columns ``[B, H_sel, heavy]`` (or its candidates ``[B, H_sel, C]``) as the
    layer's `name` for the query group's reuse steps. With static shapes they are written into the layer's
    own buffer (a captured reuse step reads it), unless they were written there already."""
    kept = getattr(layer, name)
    if cache.static is None:
        setattr(layer, name, columns)
    elif kept is columns:  # written in place
        return
    elif kept is None or kept.shape != columns.shape:
        setattr(layer, name, columns.clone())
    else:
        kept.copy_(columns)


def _kept_buffer(layer: HShareLayer, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The layer's kept `name` buffer ``shape`` int64 (`_keep`), made now if it has none of that shape: a
    selection given it writes in place, and a step captured before any eager one (a signature warmed by an
    earlier generate) holds no copy into a buffer first made by that capture."""
    kept = getattr(layer, name)
    if kept is None or kept.shape != shape:
        kept = torch.empty(shape, dtype=torch.long, device=device)
        setattr(layer, name, kept)
    return kept


def _refinement(layer: HShareLayer, by_keys: Refine | None) -> Refine:
    """How the layer's heads refine candidates: by exact logits (`by_keys`, ``refine_by = "keys"``) or by their
    policy's scores (`SelectionPolicy.candidate_heavy`)."""
    return by_keys or layer.policy.candidate_heavy


def _refine(cache: HShareCache, layer: HShareLayer, refine: Refine, query: torch.Tensor, candidates: torch.Tensor,
            window: torch.Tensor, critical: CriticalWindows | None) -> torch.Tensor | None:
    """Keep as the layer's heavy columns ``[B, H_sel, heavy]`` the best of every selection head's `candidates`
    ``[B, H_sel, C]`` in the `window` (column bounds ``[B, 2]``) by its own decode `query` ``[B, Hq, d]`` (`refine`,
    `_refinement`).
    With static shapes they are written into the layer's own buffer in place (made at the first refinement, so that a
    captured step refines as its eager warm-up did). Returns their critical indices ``[B, H_sel, N_c]`` for the
    step's `critical` windows, made by the refinement (on CUDA in its own launch), or None without them."""
    heavy = cache.config.budget.heavy
    if cache.static is None:
        refined = refine(query, candidates, window, heavy, critical=critical)
    else:
        refined = refine(query, candidates, window, heavy, heads=cache.planner.every_head,
                         out=_kept_buffer(layer, "heavy", (*candidates.shape[:2], heavy), candidates.device),
                         critical=critical)
    layer.heavy, indices = (refined, None) if critical is None else refined
    return indices


def _decode_attention(cache: HShareCache, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, indices: torch.Tensor, scaling: float) -> torch.Tensor:
    """Decode attention over the own columns `indices` (``[B, H_sel, N_c]``) of the rows' cache and,
    when the cache holds a shared prefix, its levels, merged exactly: ``[B, 1, Hq, d]``."""
    if cache.prefix is None:
        out, _ = gather_attention(query[:, :, 0], key, value, indices, scaling)
    else:
        out, _ = cache.prefix.decode_attention(layer_idx, query[:, :, 0], scaling, key, value, indices)
    return out[:, None]


def _own_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float,
                           prefix: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, None]:
    """Prefill of the rows' own parts: causal attention over the own columns (GQA folded into GEMM
    rows), merged by LSE with the exact attention over the shared prefix levels.

    Args:
        query: ``[B, Hq, T, d]``; key, value: ``[B, Hkv, S, d]`` the own columns (after update).
        attention_mask: transformers' mask over prefix + own columns (its last S columns are used).
        prefix: ``(out [B, Hq, T, d], lse [B, Hq, T])`` over the prefix levels.

    Returns:
        ``(out [B, T, Hq, d], None)``.
    """
    batch, q_heads, steps, dim = query.shape
    kv_heads, own = key.shape[1], key.shape[2]
    per_kv = q_heads // kv_heads
    valid = valid_columns_from_mask(attention_mask, batch, own, steps, query.device)  # [B, T, S]
    mask = valid[:, None, None].expand(batch, 1, per_kv, steps, own).reshape(batch, 1, per_kv * steps, own)
    out, lse = attention_with_lse(query.reshape(batch, kv_heads, per_kv * steps, dim), key, value, scaling, mask)
    out, _ = merge_attention_states(out.reshape(batch, q_heads, steps, dim), lse.reshape(batch, q_heads, steps), *prefix)
    return out.transpose(1, 2).contiguous(), None


def _select_heavy_columns(cache: HShareCache, step: DecodeStep, layer_idx: int, query: torch.Tensor) -> torch.Tensor:
    """Heavy columns ``[B, H_sel, heavy]`` of one layer at a selection step.

    Only the rows for which this layer is a source, and only its source heads, compute policy
    scores; copying heads take their source head's columns, copying layers their source layer's.
    """
    config = cache.config
    layer = cache.layers[layer_idx]
    share = step.shares[layer_idx]
    heavy = None
    rows = share.select_rows
    if rows is None or len(rows):
        middle, source_heads, head_slot, _ = _source_rows(share, step.windows.selectable)
        heads = None if share.all_heads else source_heads
        kept = None  # with static shapes, the layer's kept buffer, which the selection writes into (`_keep`)
        if cache.static is not None and rows is None:
            kept = _kept_buffer(layer, "heavy", (query.shape[0], cache.sel_heads, config.budget.heavy), query.device)
        if config.sharing.successors:  # every head's entries at once
            chosen, _ = layer.policy.decode_heavy_successors(query[:, :, 0], middle, config.budget.heavy, rows, heads,
                                                             head_slot=None if share.all_heads else head_slot,
                                                             out=(kept, None))
        else:
            chosen = layer.policy.decode_heavy(query[:, :, 0], middle, config.budget.heavy, rows, heads,
                                               out=kept if share.all_heads else None)
            if not share.all_heads:
                chosen = per_head(chosen, head_slot, kept)
        heavy = _in_batch(chosen, rows, query.shape[0])
    for source_layer, copy_rows in share.copy_groups:
        source = cache.layers[source_layer].heavy
        if copy_rows is None:  # every row (the layer's only group): the source's columns themselves, as
            layer.heavy = heavy = source  # `_select_candidates` keeps its candidates
        else:
            if heavy is None:
                heavy = torch.full_like(source, NO_TOKEN)
            heavy[copy_rows] = source[copy_rows]
    return heavy


def _select_candidates(cache: HShareCache, step: DecodeStep, layer_idx: int, query: torch.Tensor,
                       by_keys: Refine | None, critical: CriticalWindows | None) -> torch.Tensor | None:
    """Keep the heavy columns ``[B, H_sel, heavy]`` and candidates ``[B, H_sel, C]`` of one layer at a selection
    step with candidate-set refinement (`SharingConfig.candidates`) for its query group. Returns the step's critical
    indices (`critical`) where a refinement of every row made them (`_refine`), else None.

    The rows for which this layer is a source score every column with its source heads and keep their top C
    as candidates, and the top `heavy` of those as their heavy columns; copying heads take their source
    head's candidates, copying layers their source layer's, and each refines them with its own query
    (`SelectionPolicy.candidate_heavy`, or `by_keys`: ``refine_by = "keys"``, for every head). A layer that
    copies for every row keeps its source layer's candidates themselves, not a copy (the plan holds for the
    generate, and the source keeps them until its next selection, which precedes this layer's).
    """
    config = cache.config
    layer = cache.layers[layer_idx]
    share = step.shares[layer_idx]
    batch, count, kept = query.shape[0], config.candidate_count, config.budget.heavy
    decode_query = query[:, :, 0]
    window = step.windows.selectable_bounds  # the refinements' (a candidate is a valid column: bounds suffice)
    heavy = candidates = None
    rows = share.select_rows
    if rows is None or len(rows):
        selectable, source_heads, head_slot, copy_heads = _source_rows(share, step.windows.selectable)
        sharing = {} if share.all_heads else dict(heads=source_heads, head_slot=head_slot, copy_heads=copy_heads)
        if cache.static is not None and rows is None:  # the selection writes into the kept buffers (`_keep`)
            sharing["out"] = (_kept_buffer(layer, "heavy", (batch, cache.sel_heads, kept), query.device),
                              _kept_buffer(layer, "candidates", (batch, cache.sel_heads, count), query.device))
        chosen, picked = select_candidates(layer.policy, decode_query, selectable,
                                           window if rows is None else window.index_select(0, rows), count, kept,
                                           rows=rows,
                                           successors=config.sharing.successors, refine=by_keys, **sharing)
        heavy, candidates = _in_batch(chosen, rows, batch), _in_batch(picked, rows, batch)
    refine = _refinement(layer, by_keys)
    for source_layer, copy_rows in share.copy_groups:
        source = cache.layers[source_layer].candidates
        if copy_rows is None:  # every row (the layer's only group)
            layer.candidates = source
            return _refine(cache, layer, refine, decode_query, source, window, critical)
        if heavy is None:
            heavy = torch.full((batch, cache.sel_heads, kept), NO_TOKEN, dtype=torch.long, device=query.device)
            candidates = torch.full_like(source, NO_TOKEN)
        candidates[copy_rows] = source[copy_rows]
        heavy[copy_rows] = refine(decode_query, source[copy_rows], window.index_select(0, copy_rows), kept,
                                  rows=copy_rows)
    _keep(cache, layer, "heavy", heavy)
    _keep(cache, layer, "candidates", candidates)
    return None


def _source_rows(share, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the rows for which a layer is a source (``share.select_rows``, None = all) select with:
    their selectable windows ``[B', n]`` and their source heads ``[P, n_src]``, head slots ``[P, H_sel]``
    and copying heads ``[P, H_sel - n_src]`` (P = 1 for a batch plan, else one entry per row)."""
    rows = share.select_rows
    source_heads, head_slot, copy_heads = share.source_heads, share.head_slot, share.copy_heads
    if rows is None:
        return window, source_heads, head_slot, copy_heads
    if source_heads.shape[0] > 1:
        source_heads, head_slot = source_heads.index_select(0, rows), head_slot.index_select(0, rows)
        copy_heads = copy_heads.index_select(0, rows)
    return window.index_select(0, rows), source_heads, head_slot, copy_heads


def _in_batch(columns: torch.Tensor, rows: torch.Tensor | None, batch: int) -> torch.Tensor:
    """``[B', H_sel, k]`` columns of rows `rows` (None = all) as ``[B, H_sel, k]``, ``NO_TOKEN`` elsewhere."""
    if rows is None:
        return columns
    full = torch.full((batch, *columns.shape[1:]), NO_TOKEN, dtype=columns.dtype, device=columns.device)
    full[rows] = columns
    return full
