"""The label cache of one layer: quantized heavy channels of every cached key (HShare section 4.2).

The ``"labels"`` selection policy (`hshare.policy.SelectionPolicy`; DoubleSparse / HShare): built at
prefill from the prompt's keys, appended one token per decode step, and scored against the current
query's heavy channels for the *source* selection heads only. A token's score is its approximate
logit ``q_lab . k_lab``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hshare.channels import dynamic_channels, resolve_calibration
from hshare.config import HShareConfig
from hshare.kernels import append_labels, decode_label_scores, label_scores, label_storage_dtype, query_labels
from hshare.policy import SelectionPolicy, register_policy

if TYPE_CHECKING:
    from hshare.buffer import GrowingBuffer
    from hshare.channels import ChannelCalibration
    from hshare.heads import HeadShard


@register_policy("labels")
class LabelCache(SelectionPolicy):
    """Labels ``[B, H_sel, n, r]`` (quantized) of one layer: a `SelectionPolicy` scoring tokens.

    Args:
        channels: ``[P, H_sel, r]`` heavy channels of each selection head; P = 1 (calibrated, all
            rows) or B (dynamic, per row).
        bits: 4, 8 or 16.
        kv_heads: KV heads of the layer; selection head s reads KV head ``s * Hkv // H_sel``.

    Attributes:
        codes, scale, zero: column buffers ``[B, H_sel, n, r * bits / 8]`` (uint8; 16 bits: ``[B, H_sel,
            n, r]`` half) and ``[B, H_sel, n]`` (None storage at 16 bits): the labels' codes and their
            per-token quantization scale and zero point.
    """

    unit = "tokens"  # one scoring scores every cached token (DecodeStats.scored_tokens)
    options = ("label_channels", "label_bits", "heavy_channels")
    column_buffers = ("codes", "scale", "zero")
    row_or_shared_tensors = ("channels",)
    codes: GrowingBuffer
    scale: GrowingBuffer
    zero: GrowingBuffer

    def __init__(self, channels: torch.Tensor, bits: int, kv_heads: int, reserve: int = 0) -> None:
        super().__init__(channels.shape[1], kv_heads, reserve)
        self.channels = channels
        self.bits = bits

    @classmethod
    def from_prefill(cls, config: HShareConfig, model_state: ChannelCalibration | None, layer: int,
                     query: torch.Tensor, new_keys: torch.Tensor, new_valid: torch.Tensor, kv_heads: int,
                     reserve: int) -> LabelCache:
        """Heavy channels from the calibration `model_state` (all rows), or per row from the prompt's queries
        and keys (`hshare.channels.dynamic_channels`) when there is none."""
        if model_state is not None:
            channels = model_state.channels(layer, kv_heads, config.selection, config.label_channels).to(query.device)
        else:
            channels = dynamic_channels(query, new_keys, new_valid, config.selection, config.label_channels)
        return cls(channels, config.label_bits, kv_heads, reserve)

    @classmethod
    def model_state(cls, config: HShareConfig, model_config) -> ChannelCalibration | None:
        """The heavy-channel calibration ``config.heavy_channels`` names for this model (`hshare.channels`),
        or None: chosen per row from each prompt."""
        return resolve_calibration(config.heavy_channels, model_config)

    @classmethod
    def state_for_heads(cls, state: ChannelCalibration | None, heads: HeadShard) -> ChannelCalibration | None:
        """A calibration narrowed to a tensor-parallel rank's query heads."""
        return state.head_slice(heads.q_offset, heads.q_heads) if state is not None and heads.sharded else state

    @classmethod
    def describe(cls, config: HShareConfig) -> str:
        return f"labels {config.label_channels}x{config.label_bits}b, heavy channels {config.heavy_channels}"

    def add_keys(self, new_keys: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Quantize and append the labels of new keys ``[B, Hkv, t, d]`` (written in place).

        `valid` (``[B, t]``) is not needed: a token's label depends on its key only, and invalid
        columns are never selected (the windows exclude them)."""
        batch, _, tokens, _ = new_keys.shape
        width, code_dtype, store = self._layout(new_keys.dtype)
        shape, device = (batch, self.sel_heads), new_keys.device
        codes = self.codes.claim(shape, tokens, (width,), code_dtype, device)
        scale = zero = None
        if self.bits != 16:
            scale = self.scale.claim(shape, tokens, (), store, device)
            zero = self.zero.claim(shape, tokens, (), store, device)
        append_labels(new_keys, self.channels, self.bits, codes, scale, zero)

    def write(self, column: torch.Tensor, keys: torch.Tensor) -> None:
        """Static shapes: the label of the key at the column held in `column` (``[1]`` int64 device
        tensor), read from the layer's whole key buffer `keys` ``[B, Hkv, n, d]`` and written into
        the frozen label buffers at that column, in one launch."""
        scale, zero = (None, None) if self.bits == 16 else (self.scale.storage, self.zero.storage)
        append_labels(keys, self.channels, self.bits, self.codes.storage, scale, zero, column=column)

    def _layout(self, key_dtype: torch.dtype) -> tuple[int, torch.dtype, torch.dtype]:
        """``(code width per token, code dtype, scale / zero dtype)`` for keys of `key_dtype`."""
        store = label_storage_dtype(key_dtype)
        if self.bits == 16:
            return self.channels.shape[-1], torch.bfloat16 if store == torch.bfloat16 else torch.float16, store
        return self.channels.shape[-1] * self.bits // 8, torch.uint8, store

    def query_labels(self, query: torch.Tensor) -> torch.Tensor:
        """Heavy channels of queries ``[B, Hq, Q, d]`` per selection head: ``[B, H_sel, Q, r]``
        (`kernels.query_labels`)."""
        return query_labels(query, self.channels)

    def score_query(self, query: torch.Tensor) -> torch.Tensor:
        """What `prefill_scores` reads of queries ``[B, Hq, Q, d]``: their labels ``[B, H_sel, Q, r]``."""
        return self.query_labels(query)

    def prefill_scores(self, query_labels: torch.Tensor) -> torch.Tensor:
        """Approximate logits of every cached token for Q query rows.

        Args:
            query_labels: ``[B, H_sel, Q, r]`` (`score_query`).

        Returns:
            ``[B, H_sel, Q, n]`` fp32 (fp64 for fp64 queries).
        """
        return label_scores(query_labels, self.codes.view(), self.scale.view(), self.zero.view(), self.bits)

    def decode_scores(self, query: torch.Tensor, rows: torch.Tensor | None = None,
                      heads: torch.Tensor | None = None) -> torch.Tensor:
        """Approximate logits of every cached token for some rows and source heads (read in place).

        Args:
            query: ``[B, Hq, d]`` the decode query of every row.
            rows: ``[B']`` batch rows to score (None = all).
            heads: ``[B' or 1, H']`` selection heads to score per row (None = all).

        Returns:
            ``[B', H', n]`` fp32 (fp64 for fp64 queries).
        """
        return decode_label_scores(query, self.channels, self.codes.view(), self.scale.view(), self.zero.view(),
                                   self.bits, rows, heads)
