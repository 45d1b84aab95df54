"""What a sparse layer's prefill leaves for decode, built after the prefill forward.

A sparse layer needs two things from the prompt: its selection policy's metadata over every prompt
key (labels or Quest pages, `hshare.policy`) and, when layers or heads share, the planner's
evidence (HShare section 4.3: the keep-sets of the last ``plan_rows`` prompt queries). Both are
built from the cache's keys *after* the prefill forward has returned (`complete`, called by
`hshare.step.StepPlanner.finish_prefill`), not inside the layer: during the forward every layer's MLP and
attention activations are alive, so metadata allocated there (0.8 GiB of labels at 32 layers,
16 rows of 4k tokens) adds to the generation's peak memory; afterwards only the weights and the
KV are. The planner keeps for the layer only what the cache does not: the policy made from its prompt
queries (heavy channels or Loki's principal directions, no token buffers yet; on the layer, its row tensors
parked until `complete`), what the policy scores of the evidence rows' queries
(`SelectionPolicy.score_query`: for labels ``[B, H_sel, W, r]``, a quarter of the queries at r = 16 in
fp32, 12 MiB less for 32 layers of 16 rows, 32 heads) and the keys' validity ``[B, n]``, one copy
shared by the layers of a forward (`PendingPrefill`). On CUDA both wait in pinned host memory (copies
ordered on the stream, no sync): at the forward's peak a sparse preset then holds on the device only
what an unpatched forward holds. Sparse prefill needs the metadata inside the layer and completes it
there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hshare.planner import head_similarity, layer_overlaps
from hshare.policy import new_policy
from hshare.selection import prefill_middle_windows, select_heavy

if TYPE_CHECKING:
    from hshare.cache import HShareCache
    from hshare.step import StepPlanner


@dataclass
class PendingPrefill:
    """A sparse layer's prefill, waiting for its metadata (`complete`).

    Attributes:
        valid: ``[B, n]`` key validity of the last prompt query over the layer's cached columns.
        evidence_query: the last W prompt queries as the layer's policy scores them
            (`SelectionPolicy.score_query` of ``[B, Hq, W, d]``; the planner's evidence rows), or None
            when no greedy plan will use them.
        Both are parked (`park`: pinned host memory on CUDA); `complete` brings them back to the device of
        the layer's keys.
    """

    valid: torch.Tensor
    evidence_query: torch.Tensor | None


def park(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` off the device for the rest of a forward: CUDA tensors in pinned host memory
    (a copy ordered on the current stream, no sync; `unpark` brings it back in stream order), others cloned."""
    if not tensor.is_cuda:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def unpark(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` again (a no-op where it already is)."""
    return tensor.to(device, non_blocking=True)


def defer(cache: HShareCache, planner: StepPlanner, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
          valid: torch.Tensor) -> None:
    """Inside a prefill forward: make the layer's selection policy at its first prefill (heavy channels
    from the prompt's queries and keys) and record what `complete` needs (copies, parked off the device:
    the forward's tensors are freed).

    Args:
        query: ``[B, Hq, T, d]`` the prefill queries; key: ``[B, Hkv, n, d]`` all cached keys;
            valid: ``[B, n]`` key validity of the last query.
    """
    layer = cache.layers[layer_idx]
    if layer.policy is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        layer.policy = new_policy(cache.config, cache.policy_state, layer_idx, query, key[:, :, kv_len - q_len:],
                                  valid[:, kv_len - q_len:], cache.kv_heads, cache.reserve)
    evidence = None
    if planner.collects_evidence:
        rows = min(cache.config.planner.rows, query.shape[2])
        evidence = park(layer.policy.score_query(query[:, :, query.shape[2] - rows:]))
    # the policy's per-row state too (Loki: [B, Hkv, d, r] fp32 a layer)
    layer.policy.map_row_state(lambda _, tensor: park(tensor))
    # one copy of the validity per forward: every layer sees the same mask (views with one address)
    source = (valid.data_ptr(), valid.shape, valid.stride())
    if planner.prefill_valid is None or planner.prefill_valid[0] != source:
        planner.prefill_valid = (source, park(valid))
    planner.pending[layer_idx] = PendingPrefill(planner.prefill_valid[1], evidence)


def complete(cache: HShareCache, planner: StepPlanner, layer_idx: int) -> None:
    """Append the layer's metadata for its keys not yet covered and record the planner's evidence."""
    layer = cache.layers[layer_idx]
    pending = planner.pending.pop(layer_idx, None)
    if pending is None:
        return
    device = layer.keys.device  # where the parked tensors come back to
    layer.policy.map_row_state(lambda _, tensor: unpark(tensor, device))
    valid = unpark(pending.valid, device)
    keys = layer.keys[:, :, :valid.shape[1]]  # the prefill's columns (a decode step may have added one)
    start = layer.policy.length
    layer.policy.append(keys[:, :, start:], valid[:, start:])
    if pending.evidence_query is not None:
        record_evidence(cache, planner, layer_idx, unpark(pending.evidence_query, device), valid)


def record_evidence(cache: HShareCache, planner: StepPlanner, layer_idx: int, query: torch.Tensor,
                    valid: torch.Tensor) -> None:
    """This layer's keep-sets for a greedy plan: the top `heavy` columns of the last W prompt query rows
    (the policy scores and windows of decode selection; with `SharingConfig.successors`, the ranking
    before successors are added).

    Args:
        query: the last W prompt queries as `SelectionPolicy.score_query` made them.
        valid: ``[B, n]`` key validity of the last prompt query.
    """
    config = cache.config
    layer = cache.layers[layer_idx]
    rows, kv_len = query.shape[-2], valid.shape[1]
    # keys each evidence row sees: the row's valid keys, causally (a left-pad row sees none)
    row_column = torch.arange(kv_len - rows, kv_len, device=query.device)[:, None]
    causal = torch.arange(kv_len, device=query.device)[None, :] <= row_column
    row_valid = valid[:, None, :] & causal[None] & valid[:, kv_len - rows:, None]  # [B, W, n]
    middle = prefill_middle_windows(row_valid, config.budget.sink, config.budget.local)
    scores = layer.policy.prefill_scores(query)  # [B, H_sel, W, n]
    # the top `heavy` with successors too: the plan pairs heads and layers by what they rank
    keep = select_heavy(scores, middle[:, None], config.budget.heavy)
    # the similarities on every evidence row, and with a scoring budget and two rows or more on each half of them
    # (`build_plan`'s halves: the budget orders copies on the even rows and merges them by the odd rows')
    targets = [((planner.head_similarity, planner.layer_similarity), slice(None))]
    if config.planner.scorings is not None and rows > 1:
        targets += [(half, slice(start, None, 2)) for start, half in enumerate(planner.half_similarity)]
    earlier = planner.earlier_keep_sets(layer_idx) if config.sharing.layer < 1 else []
    for (heads_out, layers_out), rows_of in targets:
        rows_keep = keep[:, :, rows_of]
        if config.sharing.head < 1:
            heads_out[layer_idx] = head_similarity(rows_keep, kv_len)
        if config.sharing.layer < 1:  # one layer plan for all ranks
            overlaps = layer_overlaps(rows_keep, [kept[:, :, rows_of] for kept in earlier], kv_len)
            layers_out[layer_idx] = cache.heads.mean_over_ranks(overlaps)
    if config.sharing.layer < 1:
        planner.keep[layer_idx] = keep
