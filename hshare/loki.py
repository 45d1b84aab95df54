"""Loki's low-rank keys of one layer (Singhania et al., NeurIPS 2024): the ``"loki"`` selection policy.

Loki observes that a layer's keys lie close to a subspace of few dimensions. It keeps every key
projected on the top r principal directions ``P`` (``[d, r]``) of the keys and ranks tokens by the
approximate logit in that subspace, ``(q P) . (k P)``; the selected tokens are then attended exactly
(full keys and values), as every policy's are.

Principal directions. Loki computes them offline, once per model, on a calibration corpus. Here they
are computed per row, layer and KV head from the row's valid keys of the layer's first prefill (the
prompt): the *dynamic* variant. Per row, so a row's selection does not depend on its batch mates;
from the prompt, so no calibration file is needed. They are the eigenvectors of the keys' covariance
(centered, as PCA): a query's logits of all keys share the term ``q . mean``, so their order is that
of ``q . (k - mean)``, whose best rank-r approximation lies along the directions of largest variance.
Keys and queries are projected uncentered, as Loki's code does (the shared term leaves the order
unchanged). The keys are the cache's, after the rotary embedding (Loki's post-rotary variant). At
full rank (r = d) ``P`` is orthogonal and the score is ``q . k`` up to rounding. A prompt of fewer
keys than r + 1 spans fewer than r directions of variance; the others are left out (zero columns of
``P``) rather than taken from the null space, where rounding, not the keys, would choose them.

Selection heads. With ``selection="kv_head"`` selection head s (KV head s) scores
``(sum over its query heads h of q_h P_s) . (k P_s)``, the sum of its query heads' approximate
logits; with ``"query_head"`` each query head scores with its KV head's ``P``.

Storage: the projected keys, a column buffer ``[B, Hkv, n, r]`` in the keys' dtype (r / d of the
keys' bytes; `nbytes`) stored channel-major (tokens last in memory, so that a selection reads each channel of
every token coalesced), and ``P`` per row, ``[B, Hkv, d, r]`` in float32 (float64 for float64 keys;
not in `nbytes`, as the label policy's channels are not). Static shapes (`hshare.static_decode`):
`write` projects the key at a column held in a device tensor into the frozen buffer (no host value).

A decode selection of 16-bit keys is the label policy's fused scoring and top-k (`decode_heavy`,
`kernels.label_topk` with the projected keys as 16-bit labels); everything else is plain PyTorch.

Rank: ``config.policy.rank`` (`LokiConfig`); None = ``head_dim // 4`` (a quarter of the head dimension).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hshare.config import ConfigError, HShareConfig, PolicyConfig
from hshare.kernels import label_topk
from hshare.kernels.selection_heads import kv_heads_of
from hshare.policy import SelectionPolicy, register_policy

if TYPE_CHECKING:
    from hshare.buffer import GrowingBuffer


@dataclass(frozen=True)
class LokiConfig(PolicyConfig):
    """The ``"loki"`` policy's section of the config.

    Attributes:
        rank: principal components r of the keys kept (<= head_dim); None = head_dim // 4, at least 1.
    """

    rank: int | None = None
    flat_names = {"loki_rank": "rank"}
    # a selection scores every projected key (r 16-bit channels a token) at every layer, head and step, so a sparse
    # step must save this much more K/V reading a layer than the label policy's to pay for it
    selection_min_saved_mib = 288.0

    def __post_init__(self) -> None:
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int)
                                      or not 1 <= self.rank <= 1024):
            raise ConfigError(f"HShareConfig.policy.rank = {self.rank!r} is invalid; accepted: an integer in "
                              "[1, 1024] (at most head_dim), or null for head_dim // 4")

    def validate_for_model(self, head_dim: int) -> None:
        self.rank_at(head_dim)

    def rank_at(self, head_dim: int) -> int:
        """The rank r at `head_dim`: `rank`, or ``max(1, head_dim // 4)`` when None."""
        rank = max(1, head_dim // 4) if self.rank is None else self.rank
        if rank > head_dim:
            raise ConfigError(f"HShareConfig.policy.rank = {rank} exceeds the model's head_dim {head_dim}; "
                              f"accepted: 1..{head_dim}, or null for head_dim // 4")
        return rank

    def describe(self) -> str:
        return f"loki rank {'head_dim/4' if self.rank is None else self.rank}"


def principal_components(keys: torch.Tensor, valid: torch.Tensor | None, rank: int) -> torch.Tensor:
    """The top-`rank` principal directions of each row's and KV head's valid keys.

    Args:
        keys: ``[B, Hkv, T, d]``.
        valid: ``[B, T]`` bool, the keys to use (None = all); invalid keys (padding) may hold anything.
        rank: r, 1 <= r <= d.

    Returns:
        ``[B, Hkv, d, r]`` the covariance's eigenvectors by decreasing eigenvalue, in float32 (float64
        for float64 keys): orthonormal columns, except that a column whose eigenvalue is zero up to
        rounding (``<= d * eps * largest``: a row with fewer than r + 1 distinct valid keys) is zero.
    """
    acc = SelectionPolicy.accumulation_dtype(keys.dtype)
    keys = keys.to(acc)
    if valid is None:
        valid = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
    inside = valid[:, None, :, None]
    count = valid.sum(-1).clamp(min=1).to(acc)[:, None, None, None]
    zero = keys.new_zeros(())
    mean = torch.where(inside, keys, zero).sum(2, keepdim=True) / count
    centered = torch.where(inside, keys - mean, zero)
    covariance = centered.transpose(-1, -2) @ centered / count  # [B, Hkv, d, d]
    values, vectors = torch.linalg.eigh(covariance)  # eigenvalues ascending
    values, vectors = values[..., -rank:].flip(-1), vectors[..., -rank:].flip(-1)
    # a direction without variance (fewer valid keys than directions) is any vector of the null space,
    # which rounding would choose: zero, it ranks nothing
    tolerance = values[..., :1].clamp(min=0) * keys.shape[-1] * torch.finfo(acc).eps
    return vectors * (values > tolerance)[..., None, :]


@register_policy("loki")
class LokiKeyCache(SelectionPolicy):
    """Keys projected on their top principal directions, ``[B, Hkv, n, r]``: a `SelectionPolicy`
    scoring tokens.

    Args:
        components: ``[B, Hkv, d, r]`` each row's and KV head's principal directions ``P``
            (`principal_components`).
        sel_heads: selection heads H_sel (Hkv or Hq); selection head s reads KV head
            ``s * Hkv // H_sel``.

    Attributes:
        projected: column buffer ``[B, Hkv, n, r]``, the keys times ``P``, in the keys' dtype, channel-major.
    """

    unit = "tokens"  # one scoring scores every cached token (DecodeStats.scored_tokens)
    config_class = LokiConfig
    column_buffers = ("projected",)
    tokens_last_buffers = ("projected",)  # the fused selection reads each channel of every column: coalesced
    row_tensors = ("components",)
    projected: GrowingBuffer

    def __init__(self, components: torch.Tensor, sel_heads: int, reserve: int = 0) -> None:
        super().__init__(sel_heads, components.shape[1], reserve)
        self.components = components

    @classmethod
    def from_prefill(cls, config: HShareConfig, model_state: Any, layer: int,
                     query: torch.Tensor, new_keys: torch.Tensor, new_valid: torch.Tensor, kv_heads: int,
                     reserve: int) -> LokiKeyCache:
        """Principal directions of each row's valid prompt keys `new_keys` (the calibration of heavy
        channels is not used)."""
        components = principal_components(new_keys, new_valid, config.policy.rank_at(new_keys.shape[-1]))
        return cls(components, cls.selection_heads(config, query, kv_heads), reserve)

    @property
    def rank(self) -> int:
        return self.components.shape[-1]

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys ``[B, Hkv, t, d]`` times ``P``: ``[B, Hkv, t, r]`` in the keys' dtype."""
        return (keys.to(self.components.dtype) @ self.components).to(keys.dtype)

    def add_keys(self, new_keys: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Project and append new keys ``[B, Hkv, t, d]``. `valid` is not needed: a token's projection
        depends on its key only, and invalid columns are never selected (the windows exclude them)."""
        batch, kv_heads, tokens, _ = new_keys.shape
        self.projected.claim((batch, kv_heads), tokens, (self.rank,), new_keys.dtype,
                             new_keys.device).copy_(self.project_keys(new_keys))

    def write(self, column: torch.Tensor, keys: torch.Tensor) -> None:
        """Static shapes: project the key at the column held in `column` (``[1]`` int64 device tensor)
        of the layer's whole key buffer `keys` ``[B, Hkv, n, d]`` into the frozen buffer at that column."""
        self.projected.write(column, self.project_keys(keys.index_select(2, column)))

    def project_queries(self, query: torch.Tensor, rows: torch.Tensor | None = None,
                        heads: torch.Tensor | None = None) -> torch.Tensor:
        """Queries ``[B, Hq, Q, d]`` summed over each selection head's query heads and projected on its
        KV head's ``P``, for rows ``[B']`` (None = all) and heads ``[B' or 1, H']`` (None = all H_sel):
        ``[B', H', Q, r]`` in float32 (float64 for float64 queries)."""
        acc = self.accumulation_dtype(query.dtype)
        summed = self.pick_selection_heads(self.group_query_heads(query).to(acc).sum(2), rows, heads)
        return summed @ self.per_selection_head(self.components, rows, heads).to(acc)

    def token_scores(self, projected_query: torch.Tensor, rows: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None) -> torch.Tensor:
        """Approximate logits ``[B', H', Q, n]`` of every cached column for projected queries
        ``[B', H', Q, r]`` (`project_queries` of the same rows and heads)."""
        keys = self.per_selection_head(self.projected.view(), rows, heads)
        return projected_query @ keys.to(projected_query.dtype).transpose(-1, -2)

    def score_query(self, query: torch.Tensor) -> torch.Tensor:
        """What `prefill_scores` reads of queries ``[B, Hq, Q, d]``: their projections ``[B, H_sel, Q, r]``."""
        return self.project_queries(query)

    def prefill_scores(self, projected_query: torch.Tensor) -> torch.Tensor:
        """Approximate logits ``[B, H_sel, Q, n]`` for Q query rows projected by `score_query`."""
        return self.token_scores(projected_query)

    def decode_scores(self, query: torch.Tensor, rows: torch.Tensor | None = None,
                      heads: torch.Tensor | None = None) -> torch.Tensor:
        """Approximate logits ``[B', H', n]`` for the decode query ``[B, Hq, d]`` of some rows and heads."""
        return self.token_scores(self.project_queries(query[:, :, None], rows, heads), rows, heads)[:, :, 0]

    def decode_heavy(self, query: torch.Tensor, selectable: torch.Tensor, heavy: int, rows: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """16-bit keys (bf16, fp16): the projected keys are 16-bit labels of r channels and the projected query
        their query labels, so scoring and the heavy top-k are the label policy's fused operation
        (`kernels.label_topk`: on CUDA the ``[B', H', n]`` scores are never written; its twin elsewhere), each
        selection head reading its KV head's keys. The scores equal `decode_scores`' up to the order of the r
        products' sum. Other dtypes: `decode_scores` then the top-k."""
        keys = self.projected.view()
        if keys.dtype not in (torch.bfloat16, torch.float16):
            return super().decode_heavy(query, selectable, heavy, rows, heads, out)
        projected = self.project_queries(query[:, :, None], rows, heads)[:, :, 0]  # [B', H', r]
        kv = kv_heads_of(self.sel_heads, self.kv_heads, heads, keys.device)
        return label_topk(projected, keys, None, None, 16, heavy, selectable=selectable, rows=rows, heads=kv, out=out)
