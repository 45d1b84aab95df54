"""The per-`generate` storage: keys and values, selection metadata, the shared prefix, static columns.

A fresh `HShareCache` is made for every ``generate`` call (`hshare.api` injects it), so batch
size, prompts and lengths may change freely between calls and nothing leaks. It is a transformers
`Cache` (generate, beams and pipelines use it as any other cache); its layers keep the whole KV
in growable buffers (no per-step ``torch.cat``). Sliding-window models keep full KV: the window is
enforced by the key validity, so the sparse path never attends outside it.

Static shapes are one mechanism of the storage, not a second cache class (transformers makes a
static cache a layer type; here the same buffers switch modes, because a generation starts eager,
decodes static, and goes back to eager when it must, without copying anything): `freeze` exposes the
buffers reserved at the generation's final length (``reserve``: the prompt plus ``max_new_tokens``
- 1) whole, the decode token is written at a column held in a device tensor and key validity is a
device tensor (`StaticColumns`), so every decode step of one kind has the same shapes and device work
(`hshare.static_decode`).

The cache decides nothing about a step: its `planner` (`hshare.step.StepPlanner`) plans the steps,
keeps the planner's evidence and the counters (``cache.stats``); the cache tells it when rows or
columns change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hshare.buffer import GrowingBuffer
from hshare.config import HShareConfig
from hshare.counters import DecodeStats
from hshare.heads import HeadShard
from hshare.kernels import write_kv_column
from hshare.patches import sliding_window
from hshare.policy import SelectionPolicy, policy_class
from hshare.prefix_store import PrefixStore
from hshare.step import StepPlanner


class HShareLayer(CacheLayerMixin):
    """One layer's KV (``[B, Hkv, n, d]`` views of growable buffers) and selection state.

    Attributes:
        policy: the layer's selection-policy metadata (`hshare.policy.SelectionPolicy`; sparse layers,
            after prefill).
        heavy: ``[B, H_sel, heavy]`` heavy columns of the last selection (query groups reuse them).
        candidates: ``[B, H_sel, C]`` candidate columns of the last selection, which reusing layers, heads
            and steps refine (`SharingConfig.candidates`; None without refinement).
        prefix_width: columns held by the cache's shared-prefix store before this layer's own
            columns (counted in the sequence length transformers sees).
        column: static shapes: ``[1]`` int64 device tensor, the column the decode token is written
            to (None: tokens are appended).

    Args:
        reserve: own columns to allocate at the first allocation (`hshare.buffer.GrowingBuffer`).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, reserve: int = 0) -> None:
        super().__init__()
        self.reserve = reserve
        self.key_buffer = GrowingBuffer(reserve)
        self.value_buffer = GrowingBuffer(reserve)
        self.policy: SelectionPolicy | None = None
        self.heavy: torch.Tensor | None = None
        self.candidates: torch.Tensor | None = None
        self.prefix_width = 0
        self.column: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.column is not None:  # static shapes: the decode token at the step's column, K and V in one launch
            write_kv_column(self.key_buffer.storage, self.value_buffer.storage, self.column, key_states, value_states)
            return self.keys, self.values
        self.keys = self.key_buffer.append(key_states)
        self.values = self.value_buffer.append(value_states)
        return self.keys, self.values

    @property
    def buffers(self) -> list[GrowingBuffer]:
        """Every token buffer of the layer (KV, and the policy's metadata when it has buffers)."""
        return [self.key_buffer, self.value_buffer, *getattr(self.policy, "buffers", ())]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.prefix_width + self.key_buffer.length

    def get_max_length(self) -> int:
        return -1

    def select_rows(self, rows: torch.Tensor) -> None:
        """Reorder / select / repeat batch rows of everything this layer holds (the cache's beam and
        batch methods call this for every layer)."""
        self.key_buffer.select_rows(rows)
        self.value_buffer.select_rows(rows)
        self.keys, self.values = self.key_buffer.view(), self.value_buffer.view()
        if self.policy is not None:
            self.policy.select_rows(rows)
        if self.heavy is not None:
            self.heavy = self.heavy.index_select(0, rows.to(self.heavy.device))
        if self.candidates is not None:
            self.candidates = self.candidates.index_select(0, rows.to(self.candidates.device))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): accepted: a negative number of tokens to remove")
        length = self.get_seq_length() + tokens_to_remove - self.prefix_width
        if length < 0:
            raise ValueError(f"crop({tokens_to_remove}) would cut into the shared prefix ({self.prefix_width} tokens); "
                             f"accepted: at most {self.key_buffer.length} tokens")
        self.key_buffer.crop(length)
        self.value_buffer.crop(length)
        self.keys, self.values = self.key_buffer.view(), self.value_buffer.view()
        if self.policy is not None:
            self.policy.crop(length)
        self.heavy = self.candidates = None  # selections may point past the cropped end: select again

    def reset(self) -> None:
        self.__init__(self.reserve)

    def kv_bytes(self) -> int:
        return self.key_buffer.nbytes() + self.value_buffer.nbytes()


@dataclass
class StaticColumns:
    """Device tensors a static-shape decode step reads instead of host values.

    Attributes:
        valid: ``[B, capacity]`` bool, key validity of the step's own columns (the columns not yet
            written are False).
        column: ``[1]`` int64, the column the step's token is written to.
    """

    valid: torch.Tensor
    column: torch.Tensor


class HShareCache(Cache):
    """The storage of one generation: KV, selection metadata, the shared prefix, static columns.

    Head counts (``q_heads``, ``kv_heads``, ``sel_heads``: Hq, Hkv, H_sel) are those the attention
    function receives, set at the first prefill (`set_heads`): under tensor parallelism, the
    rank's own heads (`hshare.heads`); None before.

    Args:
        config: the validated `HShareConfig`.
        model_config: the model's transformers config.
        policy_state: the selection policy's model-level state (`SelectionPolicy.model_state`; labels: a
            heavy-channel calibration), held opaquely for the policy; None = none.
        reserve: own columns per row to allocate at once (the prompt plus ``max_new_tokens`` - 1; 0 =
            grow as needed). Required for static shapes (`freeze`).
    """

    def __init__(self, config: HShareConfig, model_config, policy_state: Any = None,
                 reserve: int = 0) -> None:
        self.num_layers = model_config.num_hidden_layers
        super().__init__(layers=[HShareLayer(reserve) for _ in range(self.num_layers)])
        self.config = config
        self.policy_state = policy_state
        self.reserve = reserve
        self.heads: HeadShard | None = None
        self.q_heads: int | None = None
        self.kv_heads: int | None = None
        self.sel_heads: int | None = None
        self.planner = StepPlanner(config, self.num_layers, sliding_window(model_config))
        self.prefix: PrefixStore | None = None
        self.static: StaticColumns | None = None
        self._static_buffers: list[GrowingBuffer] = []  # every token buffer a static step writes (`advance`)
        self.static_decode = None  # hshare.static_decode.StaticDecodeReport of the generate that filled it

    @property
    def stats(self) -> DecodeStats:
        """The generation's counters (`DecodeStats`), a fresh object at each read. The data-dependent
        counters live on the device during generation; reading them here is one host sync."""
        return self.planner.stats()

    @property
    def sparse_layers(self) -> list[int]:
        return self.planner.sparse_layers

    def set_heads(self, heads: HeadShard) -> None:
        """Size the per-head state from the heads the attention function receives (the first
        prefill; `hshare.heads.head_shard`). The policy's state follows the heads (`SelectionPolicy.state_for_heads`)."""
        self.heads = heads
        self.q_heads, self.kv_heads = heads.q_heads, heads.kv_heads
        self.sel_heads = heads.kv_heads if self.config.planner.selection == "kv_head" else heads.q_heads
        if self.config.sparse:
            self.policy_state = policy_class(self.config.policy.name).state_for_heads(self.policy_state, heads)

    def check_heads(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Every layer and forward must attend with the heads `set_heads` saw."""
        if (query.shape[1], key.shape[1]) != (self.q_heads, self.kv_heads):
            raise ValueError(f"layer {layer} attends with {query.shape[1]} query / {key.shape[1]} KV heads, the cache "
                             f"was sized for {self.heads.describe()} at its first prefill; accepted: the same heads "
                             "in every layer and forward of one generation")

    # ---- what is stored -----------------------------------------------------------------
    @property
    def key_storage(self) -> torch.Tensor | None:
        """Layer 0's whole key buffer ``[B, Hkv, capacity, d]`` (every layer's has its shape), or None
        before the first own token."""
        return self.layers[0].key_buffer.storage

    @property
    def rows(self) -> int:
        """Batch rows of the own columns (after the first own token)."""
        return self.key_storage.shape[0]

    @property
    def storage_device(self) -> torch.device:
        return self.key_storage.device

    @property
    def own_length(self) -> int:
        """Own columns stored per row (prefix levels excluded)."""
        return self.layers[0].key_buffer.length

    @property
    def own_capacity(self) -> int:
        """Own columns the buffers hold without growing."""
        return self.layers[0].key_buffer.capacity

    def layer_kv_bytes(self, rows: int, columns: int) -> int:
        """Bytes of one layer's own keys and values over `columns` columns of `rows` rows (what dense
        attention reads)."""
        keys = self.key_storage
        return rows * columns * keys.shape[1] * keys.shape[3] * keys.element_size() * 2

    def drop_selections(self) -> None:
        """Forget every layer's heavy columns (a prefill invalidates them)."""
        for layer in self.layers:
            layer.heavy = layer.candidates = None

    def drop_policies(self) -> None:
        """Forget every layer's selection metadata (a generation decoded densely throughout needs none)."""
        for layer in self.layers:
            layer.policy = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.filling_prefix:
            return self.prefix.store(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ---- static shapes ------------------------------------------------------------------
    def freeze(self) -> StaticColumns:
        """Static-shape decode from now on (after prefill): every buffer is exposed whole (its
        reserved size), tokens are written at ``static.column``, validity is ``static.valid``."""
        if self.planner.pending:
            raise RuntimeError("freeze() with a prefill's selection metadata pending; the patched model's forward "
                               "hook builds it (StepPlanner.end_forward)")
        keys = self.key_storage
        if keys is None or not self.reserve or keys.shape[2] != self.reserve:
            raise RuntimeError("static shapes need buffers reserved at the generation's final length "
                               f"(reserve={self.reserve}, prefilled storage {None if keys is None else tuple(keys.shape)})")
        device = keys.device
        self.static = StaticColumns(
            valid=torch.zeros(keys.shape[0], keys.shape[2], dtype=torch.bool, device=device),
            column=torch.zeros(1, dtype=torch.long, device=device),
        )
        for layer in self.layers:
            layer.key_buffer.freeze()
            layer.value_buffer.freeze()
            if layer.policy is not None:
                layer.policy.freeze(self.reserve)
            layer.keys, layer.values = layer.key_buffer.view(), layer.value_buffer.view()
            layer.column = self.static.column
        self._static_buffers = [buffer for layer in self.layers for buffer in layer.buffers
                                if buffer.storage is not None]
        return self.static

    def thaw(self) -> None:
        """Back to growing buffers and views of the stored tokens (generation goes on eagerly)."""
        self.static, self._static_buffers = None, []
        for layer in self.layers:
            layer.key_buffer.thaw()
            layer.value_buffer.thaw()
            if layer.policy is not None:
                layer.policy.thaw(layer.key_buffer.length)
            layer.column = None
            if layer.key_buffer.storage is not None:
                layer.keys, layer.values = layer.key_buffer.view(), layer.value_buffer.view()

    def set_reserve(self, reserve: int) -> None:
        """Reserve `reserve` own columns per row at the first allocation (before the own prefill)."""
        if self.key_storage is not None:
            raise RuntimeError("set_reserve must come before the first token is cached")
        self.reserve = reserve
        self.planner.dense_throughout = None  # decided anew after the next own prefill
        for layer in self.layers:
            layer.reserve = reserve
            layer.key_buffer.reserve = layer.value_buffer.reserve = reserve

    def advance(self, tokens: int = 1) -> None:
        """Host bookkeeping of a static step's token (written on the device at ``static.column``): the
        length of every token buffer moves on. All were reserved at ``reserve`` columns, so one check
        covers them; the host time of this runs while the GPU waits for the step, so it is one loop
        over a list made at `freeze`."""
        if self.own_length + tokens > self.reserve:
            raise RuntimeError(f"static buffers full: {self.own_length} + {tokens} tokens > reserve {self.reserve}")
        for buffer in self._static_buffers:
            buffer.length += tokens

    # ---- shared prefix ------------------------------------------------------------------
    def set_prefix(self, prefix: PrefixStore) -> None:
        """Hold `prefix` once; rows keep only their own columns (before any token is cached)."""
        if self.get_seq_length():
            raise ValueError("a shared prefix must be set on an empty cache")
        self.prefix = prefix
        self._set_prefix_width(0)

    def _set_prefix_width(self, width: int) -> None:
        for layer in self.layers:
            layer.prefix_width = width

    def begin_prefix_fill(self, level: int) -> None:
        self.prefix.begin_fill(level)
        self._set_prefix_width(self.prefix.start(level))

    def end_prefix_fill(self) -> None:
        self.prefix.end_fill()
        self._set_prefix_width(self.prefix.width)

    @property
    def filling_prefix(self) -> bool:
        return self.prefix is not None and self.prefix.filling is not None

    def prefix_attention(self, layer: int, query: torch.Tensor, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Exact attention over the visible prefix levels (`PrefixStore.attend`), or None."""
        return None if self.prefix is None else self.prefix.attend(layer, query, scale)

    # ---- transformers Cache API -------------------------------------------------------
    def _select_rows(self, rows: torch.Tensor) -> None:
        self.planner.finish_prefill(self)
        for layer in self.layers:
            layer.select_rows(rows)
        if self.prefix is not None:
            self.prefix.select_rows(rows)
        self.planner.select_rows(self, rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length():
            self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length():
            self._select_rows(torch.as_tensor(indices, device=self.layers[0].device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length():
            self._select_rows(torch.arange(self.rows, device=self.layers[0].device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        self.planner.finish_prefill(self)
        super().crop(tokens_to_remove)
        self.planner.cropped()

    # ---- accounting ---------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of keys and values held (stored tokens only; a shared prefix counted once)."""
        own = sum(layer.kv_bytes() for layer in self.layers)
        return own + (0 if self.prefix is None else self.prefix.nbytes())

    def unshared_kv_bytes(self) -> int:
        """Bytes an ordinary cache (transformers' DynamicCache) would hold for the same batch:
        every row's keys and values over all columns, prefix and padding included."""
        total = 0
        for layer in self.layers:
            if layer.key_buffer.storage is not None:
                keys = layer.key_buffer.view()
                row_token_bytes = keys.shape[1] * keys.shape[3] * keys.element_size() * 2
                total += keys.shape[0] * layer.get_seq_length() * row_token_bytes
        return total

    def reserved_bytes(self) -> int:
        """Bytes allocated for the rows' own KV and selection metadata (spare capacity included)."""
        return sum(buffer.reserved_bytes() for layer in self.layers for buffer in layer.buffers)

    def label_bytes(self) -> int:
        """Bytes of the selection metadata: label caches (codes, scales, zeros) or Quest page bounds."""
        return sum(layer.policy.nbytes() for layer in self.layers if layer.policy is not None)
