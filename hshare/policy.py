"""Selection policies: what metadata a sparse layer keeps, and how it scores tokens for a query.

A policy is that small (as TensorRT-LLM's sparse-attention "prediction module + auxiliary memory
pool", or kvpress's ``score()``): everything else is shared by all policies and lives elsewhere:
the sink / local windows and the middle-window top-k (`hshare.selection`), the planner's evidence
and plan (`hshare.planner`, `hshare.attention`), head / layer / query sharing, padding, critical
indices and gather attention (`hshare.kernels`), sparse prefill (`hshare.sparse_prefill`).

Policies (``HShareConfig.policy``):

* ``"labels"`` (`hshare.labels.LabelCache`, DoubleSparse / HShare): quantized heavy channels of
  every key; a token's score is its approximate logit.
* ``"quest"`` (`hshare.quest.QuestPageCache`, Quest): per page of ``page_size`` columns and KV
  head, the channel-wise min and max of the keys; a token's score ranks its page (whole pages are
  selected).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hshare.channels import ChannelCalibration, dynamic_channels
from hshare.config import HShareConfig
from hshare.labels import LabelCache
from hshare.quest import QuestPageCache


@runtime_checkable
class SelectionPolicy(Protocol):
    """One sparse layer's selection metadata and scorer.

    Shapes: B rows, Hq query heads, Hkv KV heads, H_sel selection heads (Hkv or Hq, the config's
    ``selection``), n cached columns, d head dim. Scores are only ever *ranked* (top-k over the
    middle window): any key whose order is the policy's preference will do.

    Attributes:
        unit: what one (row, layer, head) scoring scores: ``"tokens"`` or ``"pages"`` (the
            `hshare.cache.DecodeStats` counter ``scored_tokens`` or ``scored_pages`` it adds to).
        sel_heads: H_sel, the heads scores are computed for.
        length: cached columns the metadata covers.
        supports_static: whether `write` works (static-shape decode, `hshare.static_decode`).
    """

    unit: str
    sel_heads: int
    supports_static: bool

    @property
    def length(self) -> int: ...

    def append(self, new_keys: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add the metadata of new keys ``[B, Hkv, t, d]`` (columns ``[length, length + t)``);
        `valid` ``[B, t]`` marks real tokens (None = all)."""

    def decode_scores(self, query: torch.Tensor, rows: torch.Tensor | None = None,
                      heads: torch.Tensor | None = None) -> torch.Tensor:
        """Token scores ``[B', H', n]`` for the decode query ``[B, Hq, d]`` of rows ``[B']`` (None =
        all) and selection heads ``[B' or 1, H']`` (None = all H_sel): only those are computed."""

    def score_query(self, query: torch.Tensor) -> torch.Tensor:
        """What `prefill_scores` reads of W query rows ``[B, Hq, W, d]``: the queries themselves, or
        less (labels: their heavy channels). The planner's evidence keeps this across a prefill
        forward, so the smaller it is, the less the prefill's peak memory holds."""

    def prefill_scores(self, query: torch.Tensor) -> torch.Tensor:
        """Token scores ``[B, H_sel, W, n]`` for W query rows given as `score_query` made them (the
        planner's evidence, sparse prefill)."""

    def scored_units(self) -> int:
        """Units (`unit`) one (row, head) decode scoring computes at the current length."""

    def nbytes(self) -> int:
        """Bytes of the metadata."""

    def freeze(self, width: int) -> None:
        """Static shapes from now on: the metadata of `width` own columns per row (the reserve) is
        exposed whole and written in place (`write`)."""

    def thaw(self, length: int) -> None:
        """Back to growing metadata after static steps wrote the columns up to `length`."""

    def write(self, column: torch.Tensor, keys: torch.Tensor) -> None:
        """Static shapes: the metadata of the key at the column held in the ``[1]`` device tensor
        `column`, read from the layer's whole key buffer `keys` ``[B, Hkv, n, d]`` (policies that
        support static-shape decode)."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows (beam search, ``batch_select_indices``)."""

    def crop(self, length: int) -> None:
        """Keep the metadata of the first `length` columns."""


def new_policy(config: HShareConfig, calibration: ChannelCalibration | None, layer: int, query: torch.Tensor,
               new_keys: torch.Tensor, new_valid: torch.Tensor, kv_heads: int, reserve: int = 0) -> SelectionPolicy:
    """An empty policy for one sparse layer, made at its first prefill.

    Args:
        calibration: heavy channels of the model (labels), or None (chosen per row, dynamic).
        reserve: columns to allocate at once (the generation's final length).
        query: ``[B, Hq, T, d]`` the prefill queries; new_keys: ``[B, Hkv, T, d]`` their keys;
            new_valid: ``[B, T]`` validity of those keys (dynamic channels use all three).
    """
    sel_heads = kv_heads if config.selection == "kv_head" else query.shape[1]
    if config.policy == "quest":
        return QuestPageCache(sel_heads, kv_heads, config.page_size, reserve)
    if calibration is not None:
        channels = calibration.channels(layer, kv_heads, config.selection, config.label_channels).to(query.device)
    else:
        channels = dynamic_channels(query, new_keys, new_valid, config.selection, config.label_channels)
    return LabelCache(channels, config.label_bits, kv_heads, reserve)
