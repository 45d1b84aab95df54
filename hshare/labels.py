"""The label cache of one layer: quantized heavy channels of every cached key (HShare section 4.2).

The ``"labels"`` selection policy (`hshare.policy.SelectionPolicy`; DoubleSparse / HShare): built at
prefill from the prompt's keys, appended one token per decode step, and scored against the current
query's heavy channels for the *source* selection heads only. A token's score is its approximate
logit ``q_lab . k_lab``.
"""

from __future__ import annotations

import os

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hshare.channels import dynamic_channels, resolve_calibration
from hshare.config import ConfigError, HShareConfig, PolicyConfig, check_choice, check_int
from hshare.kernels import (CriticalWindows, append_labels, candidate_label_scores, candidate_label_topk,
                            decode_label_scores, decode_label_topk, decode_label_topk_walk, label_scores,
                            label_storage_dtype, query_labels, use_triton)
from hshare.policy import SelectionPolicy, register_policy

if TYPE_CHECKING:
    from hshare.buffer import GrowingBuffer
    from hshare.channels import ChannelCalibration
    from hshare.heads import HeadShard


LABEL_BITS = (4, 8, 16)


@dataclass(frozen=True)
class LabelsConfig(PolicyConfig):
    """The ``"labels"`` policy's section of the config.

    Attributes:
        channels: heavy channels r of each key kept in the label cache (<= head_dim).
        bits: 4 (packed two per byte), 8, or 16 bits per label channel.
        heavy_channels: "auto" (the calibrated file for the model in configs/channels if one exists,
            else dynamic), "dynamic" (chosen per row from the prompt's |q_c * k_c|), or a path to a
            calibration JSON written by ``hshare calibrate``.
    """

    channels: int = 16
    bits: int = 4
    heavy_channels: str = "auto"
    flat_names = {"label_channels": "channels", "label_bits": "bits", "heavy_channels": "heavy_channels"}

    def __post_init__(self) -> None:
        check_int("policy.channels", self.channels, 1, 1024)
        check_choice("policy.bits", self.bits, LABEL_BITS)
        if self.bits == 4 and self.channels % 2:
            raise ConfigError(f"HShareConfig.policy.channels = {self.channels} is odd; accepted with bits = 4: an even "
                              "number (two 4-bit labels are packed per byte)")
        if not isinstance(self.heavy_channels, (str, os.PathLike)):
            raise ConfigError(f"HShareConfig.policy.heavy_channels = {self.heavy_channels!r} is invalid; accepted: "
                              "'auto', 'dynamic' or a path to a calibration JSON")
        object.__setattr__(self, "heavy_channels", str(self.heavy_channels))
        if self.heavy_channels not in ("auto", "dynamic") and not Path(self.heavy_channels).is_file():
            raise ConfigError(f"HShareConfig.policy.heavy_channels = {self.heavy_channels!r} is not an existing file; "
                              "accepted: 'auto', 'dynamic' or the path of a calibration JSON (hshare calibrate)")

    def validate_for_model(self, head_dim: int) -> None:
        if self.channels > head_dim:
            raise ConfigError(f"HShareConfig.policy.channels = {self.channels} exceeds the model's head_dim {head_dim}; "
                              f"accepted: 1..{head_dim}")

    def describe(self) -> str:
        return f"labels {self.channels}x{self.bits}b, heavy channels {self.heavy_channels}"


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
    config_class = LabelsConfig
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
        options, selection = config.policy, config.planner.selection
        if model_state is not None:
            channels = model_state.channels(layer, kv_heads, selection, options.channels).to(query.device)
        else:
            channels = dynamic_channels(query, new_keys, new_valid, selection, options.channels)
        return cls(channels, options.bits, kv_heads, reserve)

    @classmethod
    def model_state(cls, config: HShareConfig, model_config) -> ChannelCalibration | None:
        """The heavy-channel calibration ``config.policy.heavy_channels`` names for this model (`hshare.channels`),
        or None: chosen per row from each prompt."""
        return resolve_calibration(config.policy.heavy_channels, model_config)

    @classmethod
    def state_for_heads(cls, state: ChannelCalibration | None, heads: HeadShard) -> ChannelCalibration | None:
        """A calibration narrowed to a tensor-parallel rank's query heads."""
        return state.head_slice(heads.q_offset, heads.q_heads) if state is not None and heads.sharded else state

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

    def decode_heavy(self, query: torch.Tensor, selectable: torch.Tensor, heavy: int, rows: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """On CUDA, label scoring and the heavy top-k in one fused operation (`kernels.decode_label_topk`:
        the ``[B', H', n]`` scores are never written); elsewhere `decode_scores` then the top-k (the twin)."""
        if not use_triton(self.codes.view()):
            return super().decode_heavy(query, selectable, heavy, rows, heads, out)
        return decode_label_topk(query, self.channels, self.codes.view(), self.scale.view(), self.zero.view(),
                                 self.bits, heavy, selectable=selectable, rows=rows, heads=heads, out=out)

    def decode_heavy_successors(self, query: torch.Tensor, selectable: torch.Tensor, heavy: int,
                                rows: torch.Tensor | None = None, heads: torch.Tensor | None = None, top: int = 0,
                                head_slot: torch.Tensor | None = None,
                                out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top `heavy` columns by label scores walked with their successors, and their best `top`, each column
        scored once (`kernels.decode_label_topk_walk`; CUDA: the fused top-k writes its columns' keys and the walk
        reads them, and writes every selection head's entries where `head_slot` is given)."""
        return decode_label_topk_walk(query, self.channels, self.codes.view(), self.scale.view(), self.zero.view(),
                                      self.bits, heavy, selectable, rows, heads, top=top, head_slot=head_slot,
                                      out=out)

    def successor_rescorings(self, walked: int) -> int:
        return 0  # the walk takes the selection's own scores (`decode_heavy_successors`)

    def candidate_heavy(self, query: torch.Tensor, candidates: torch.Tensor, window: torch.Tensor, heavy: int,
                        rows: torch.Tensor | None = None, heads: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, critical: CriticalWindows | None = None
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The candidates' label scores and their top `heavy` in one operation (`kernels.candidate_label_topk`;
        CUDA: one launch, the ``[B', H', C]`` scores never written; with `out`, each head's candidates read and
        its columns written at its own head's entries; with `critical`, the critical indices written by the same
        launch)."""
        return candidate_label_topk(query, self.channels, self.codes.view(), self.scale.view(), self.zero.view(),
                                    self.bits, heavy, candidates, window, rows, heads, out=out, critical=critical)

    def candidate_scores(self, query: torch.Tensor, columns: torch.Tensor, rows: torch.Tensor | None = None,
                         heads: torch.Tensor | None = None) -> torch.Tensor:
        """Approximate logits ``[B', H', C]`` of candidate columns ``[B', H', C]`` only (their label rows are
        read, nothing else; `kernels.candidate_label_scores`), as `decode_scores` scores them."""
        return candidate_label_scores(query, self.channels, self.codes.view(), self.scale.view(), self.zero.view(),
                                      self.bits, columns, rows, heads)
