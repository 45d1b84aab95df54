"""The per-`generate` cache: KV, selection metadata, the shared prefix, the step state, counters.

A fresh `HShareCache` is made for every ``generate`` call (`hshare.api` injects it), so batch
size, prompts and lengths may change freely between calls and nothing leaks. It is a transformers
`Cache` (generate, beams and pipelines use it as any other cache); its layers keep the whole KV
in growable buffers (no per-step ``torch.cat``). Sliding-window models keep full KV: the window is
enforced by the attention mask, so the sparse path never attends outside it.

Static shapes (`freeze`, used by `hshare.static_decode` on CUDA): buffers reserved at the
generation's final length (``reserve``: the prompt plus ``max_new_tokens`` - 1) are exposed whole, the
decode token is written at a column held in a device tensor and key validity comes from a device
tensor (`StaticColumns`), so every decode step of one kind has the same shapes and device work.

What a step decides lives in `hshare.step` (``cache.state``), the counters in `hshare.counters`
(``cache.stats``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hshare.buffer import GrowingBuffer
from hshare.channels import ChannelCalibration
from hshare.config import HShareConfig
from hshare.counters import DecodeStats, WorkCounters
from hshare.heads import HeadShard
from hshare.policy import SelectionPolicy
from hshare.prefill_metadata import PendingPrefill, complete
from hshare.prefix_store import PrefixStore
from hshare.step import DecodeStep


class HShareLayer(CacheLayerMixin):
    """One layer's KV (``[B, Hkv, n, d]`` views of growable buffers) and sparse-decode state.

    Attributes:
        policy: the layer's selection-policy metadata (`hshare.policy.SelectionPolicy`: a
            `LabelCache` or a `QuestPageCache`; sparse layers, after prefill).
        heavy: ``[B, H_sel, heavy]`` heavy columns of the last selection (query groups reuse them).
        keep: ``[B, H_sel, W, heavy]`` prefill keep-sets, the planner's evidence (until planned).
        pending: what the last prefill forward left for its metadata and evidence
            (`hshare.prefill_metadata`; None once `HShareCache.finish_prefill` built them).
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
        self._keys = GrowingBuffer(reserve)
        self._values = GrowingBuffer(reserve)
        self.policy: SelectionPolicy | None = None
        self.heavy: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None
        self.prefix_width = 0
        self.column: torch.Tensor | None = None
        self.pending: PendingPrefill | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.column is not None:  # static shapes: the decode token at the step's column
            self._keys.write(self.column, key_states)
            self._values.write(self.column, value_states)
            return self.keys, self.values
        self.keys = self._keys.append(key_states)
        self.values = self._values.append(value_states)
        return self.keys, self.values

    @property
    def buffers(self) -> list[GrowingBuffer]:
        """Every token buffer of the layer (KV, and the policy's metadata when it has buffers)."""
        return [self._keys, self._values, *getattr(self.policy, "buffers", ())]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.prefix_width + self._keys.length

    def get_max_length(self) -> int:
        return -1

    def select_rows(self, rows: torch.Tensor) -> None:
        """Reorder / select / repeat batch rows of everything this layer holds (the cache's beam and
        batch methods call this for every layer)."""
        self._keys.select_rows(rows)
        self._values.select_rows(rows)
        self.keys, self.values = self._keys.view(), self._values.view()
        if self.policy is not None:
            self.policy.select_rows(rows)
        if self.heavy is not None:
            self.heavy = self.heavy.index_select(0, rows.to(self.heavy.device))
        self.keep = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): accepted: a negative number of tokens to remove")
        length = self.get_seq_length() + tokens_to_remove - self.prefix_width
        if length < 0:
            raise ValueError(f"crop({tokens_to_remove}) would cut into the shared prefix ({self.prefix_width} tokens); "
                             f"accepted: at most {self._keys.length} tokens")
        self._keys.crop(length)
        self._values.crop(length)
        self.keys, self.values = self._keys.view(), self._values.view()
        if self.policy is not None:
            self.policy.crop(length)
        self.heavy = None  # selections may point past the cropped end: select again

    def reset(self) -> None:
        self.__init__(self.reserve)

    def kv_bytes(self) -> int:
        return self._keys.nbytes() + self._values.nbytes()


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
    """All state of one generation: KV, selection metadata, prefix, step state, counters.

    Head counts (``q_heads``, ``kv_heads``, ``sel_heads``: Hq, Hkv, H_sel) are those the attention
    function receives, set at the first prefill (`set_heads`): under tensor parallelism, the
    rank's own heads (`hshare.heads`); None before.

    Args:
        config: the validated `HShareConfig`.
        model_config: the model's transformers config.
        calibration: heavy channels from a calibration file, or None (dynamic per row).
        reserve: own columns per row to allocate at once (the prompt plus ``max_new_tokens`` - 1; 0 =
            grow as needed). Required for static shapes (`freeze`).
    """

    def __init__(self, config: HShareConfig, model_config, calibration: ChannelCalibration | None = None,
                 reserve: int = 0) -> None:
        self.num_layers = model_config.num_hidden_layers
        super().__init__(layers=[HShareLayer(reserve) for _ in range(self.num_layers)])
        self.config = config
        self.calibration = calibration
        self.reserve = reserve
        self.heads: HeadShard | None = None
        self.q_heads: int | None = None
        self.kv_heads: int | None = None
        self.sel_heads: int | None = None
        dense = set(config.dense_layers)
        self.sparse_layers = [i for i in range(self.num_layers) if i not in dense] if config.sparse else []
        self._sparse = set(self.sparse_layers)
        self.state = DecodeStep()
        self.counts = DecodeStats()  # the host-side counters (the device-side ones stay 0 here)
        self.work = WorkCounters(0)  # the device-side ones (sized by set_heads)
        self.prefix: PrefixStore | None = None
        self._prefix_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        self.static: StaticColumns | None = None
        self._static_buffers: list[GrowingBuffer] = []  # every token buffer a static step writes (`advance`)
        self.static_decode = None  # hshare.static_decode.StaticDecodeReport of the generate that filled it
        # Decided at the own prefill of a reserved cache: True when even the reserved final length stays
        # below the dense fallback, so every decode step is dense and no label is ever made or written.
        self.dense_throughout: bool | None = None
        # (source view's address, shape, strides; its copy): the key validity the sparse layers of the
        # running prefill forward share (`prefill_metadata.defer`); reset at each prefill
        self.prefill_valid: tuple[tuple, torch.Tensor] | None = None

    @property
    def stats(self) -> DecodeStats:
        """The generation's counters (`DecodeStats`), a fresh object at each read. The data-dependent
        counters live on the device during generation; reading them here is one host sync."""
        read, dense, sparse_steps = self.work.totals()
        return dataclasses.replace(self.counts, kv_rows_read=read, dense_kv_rows=dense, sparse_steps=sparse_steps)

    def count_scorings(self, scorings: int, policy: SelectionPolicy) -> None:
        """`scorings` (row, head) scorings of one layer by `policy` (host ints from shapes: no sync)."""
        self.counts.score_computations += scorings
        units = scorings * policy.scored_units()
        if policy.unit == "pages":
            self.counts.scored_pages += units
        else:
            self.counts.scored_tokens += units

    def set_heads(self, heads: HeadShard) -> None:
        """Size the per-head state from the heads the attention function receives (the first
        prefill; `hshare.heads.head_shard`). A calibration is narrowed to the rank's query heads."""
        self.heads = heads
        self.q_heads, self.kv_heads = heads.q_heads, heads.kv_heads
        self.sel_heads = heads.kv_heads if self.config.selection == "kv_head" else heads.q_heads
        self.work.kv_heads = heads.kv_heads
        if self.calibration is not None and heads.sharded:
            self.calibration = self.calibration.head_slice(heads.q_offset, heads.q_heads)

    def check_heads(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Every layer and forward must attend with the heads `set_heads` saw."""
        if (query.shape[1], key.shape[1]) != (self.q_heads, self.kv_heads):
            raise ValueError(f"layer {layer} attends with {query.shape[1]} query / {key.shape[1]} KV heads, the cache "
                             f"was sized for {self.heads.describe()} at its first prefill; accepted: the same heads "
                             "in every layer and forward of one generation")

    # ---- static shapes ------------------------------------------------------------------
    def freeze(self) -> StaticColumns:
        """Static-shape decode from now on (after prefill): every buffer is exposed whole (its
        reserved size), tokens are written at ``static.column``, validity is ``static.valid``."""
        self.finish_prefill()
        keys = self.layers[0]._keys.storage
        if keys is None or not self.reserve or keys.shape[2] != self.reserve:
            raise RuntimeError("static shapes need buffers reserved at the generation's final length "
                               f"(reserve={self.reserve}, prefilled storage {None if keys is None else tuple(keys.shape)})")
        device = keys.device
        # made now, not at the first step: made inside a capture, the graph would zero them at every replay
        self.work.on(device)
        self.static = StaticColumns(
            valid=torch.zeros(keys.shape[0], keys.shape[2], dtype=torch.bool, device=device),
            column=torch.zeros(1, dtype=torch.long, device=device),
        )
        for layer in self.layers:
            layer._keys.freeze()
            layer._values.freeze()
            if layer.policy is not None:
                layer.policy.freeze(self.reserve)
            layer.keys, layer.values = layer._keys.view(), layer._values.view()
            layer.column = self.static.column
        self._static_buffers = [buffer for layer in self.layers for buffer in layer.buffers
                                if buffer.storage is not None]
        return self.static

    def thaw(self) -> None:
        """Back to growing buffers and views of the stored tokens (generation goes on eagerly)."""
        self.static, self._static_buffers = None, []
        for layer in self.layers:
            layer._keys.thaw()
            layer._values.thaw()
            if layer.policy is not None:
                layer.policy.thaw(layer._keys.length)
            layer.column = None
            if layer._keys.storage is not None:
                layer.keys, layer.values = layer._keys.view(), layer._values.view()

    def set_reserve(self, reserve: int) -> None:
        """Reserve `reserve` own columns per row at the first allocation (before the own prefill)."""
        if self.layers[0]._keys.storage is not None:
            raise RuntimeError("set_reserve must come before the first token is cached")
        self.reserve, self.dense_throughout = reserve, None  # decided anew at the next own prefill
        for layer in self.layers:
            layer.reserve = reserve
            layer._keys.reserve = layer._values.reserve = reserve

    @property
    def own_length(self) -> int:
        """Own columns stored per row (prefix levels excluded)."""
        return self.layers[0]._keys.length

    def advance(self, tokens: int = 1) -> None:
        """Host bookkeeping of a static step's token (written on the device at ``static.column``): the
        length of every token buffer moves on. All were reserved at ``reserve`` columns, so one check
        covers them; the host time of this runs while the GPU waits for the step, so it is one loop
        over a list made at `freeze` (160 buffers at 32 layers)."""
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
        self._prefix_tokens = None
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

    def own_columns(self) -> torch.Tensor:
        """``[B, Hkv, n]`` every valid own column of this decode step (``NO_TOKEN`` elsewhere): the
        indices of exact attention over the own part next to a shared prefix (built once a step)."""
        return self.state.own_valid_columns(self.kv_heads)

    def prefix_tokens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Prefix-level tokens one layer's decode attention reads per KV head, and what the rows
        would read without sharing: ``(valid tokens summed over the groups that have rows, valid
        tokens summed over the rows' groups)``, int64 device scalars summed over the levels (built
        once per layout, with tensor ops only; None without a prefix)."""
        if self.prefix is None:
            return None
        if self._prefix_tokens is None:
            read = seen = torch.zeros((), dtype=torch.int64, device=device)
            for level in self.prefix.levels:
                row_group = level.row_group.to(device)
                member = row_group >= 0
                group = row_group.clamp(min=0)
                tokens = (torch.full((level.groups,), level.width, dtype=torch.int64, device=device)
                          if level.key_valid is None else level.key_valid.to(device).sum(-1))
                rows = torch.zeros(level.groups, dtype=torch.int64, device=device).scatter_add_(0, group, member.long())
                read = read + (tokens * (rows > 0)).sum()
                seen = seen + (tokens[group] * member).sum()
            self._prefix_tokens = (read, seen)
        return self._prefix_tokens

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.filling_prefix:
            return self.prefix.store(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ---- layer roles --------------------------------------------------------------------
    def is_sparse_layer(self, layer: int) -> bool:
        """Whether `layer` keeps selection metadata and may attend sparsely (never when `dense_throughout`)."""
        return layer in self._sparse and not self.dense_throughout

    @property
    def collects_evidence(self) -> bool:
        """Whether prefill records keep-sets (only when a greedy plan will use them)."""
        return bool(self.sparse_layers) and self.config.shares_layers_or_heads and self.config.planner == "greedy"

    def earlier_keep_sets(self, layer: int) -> list[torch.Tensor]:
        return [self.layers[i].keep for i in self.sparse_layers if i < layer and self.layers[i].keep is not None]

    # ---- steps --------------------------------------------------------------------------
    def finish_prefill(self) -> None:
        """Build the metadata and evidence the last prefill forward left to its sparse layers
        (`hshare.prefill_metadata.complete`; nothing when none is pending). The patched model calls
        it after each forward; every later use of the metadata calls it first."""
        for index, layer in enumerate(self.layers):
            if layer.pending is not None:
                complete(self, index)
        self.prefill_valid = None

    def begin_prefill(self) -> None:
        """A prefill forward (q_len > 1) invalidates the plan and selections of earlier steps."""
        self.finish_prefill()  # (also drops the last forward's shared validity)
        self.state.begin_prefill()
        for layer in self.layers:
            layer.heavy = None
        keys = self.layers[0]._keys.storage
        if self.dense_throughout is None and self.reserve and self.sparse_layers and keys is not None \
                and not self.filling_prefix:
            fallback = self.config.dense_fallback_bytes(keys.device)
            self.dense_throughout = self._layer_kv_bytes(keys.shape[0], self.reserve) < fallback

    def schedule_step(self, batch: int, columns: int, device: torch.device) -> str:
        """Decide the next decode step's kind on the host (`hshare.step.DecodeStep.schedule`) and
        build the sharing plan at the first sparse step (one host sync per plan).

        Args:
            columns: own columns of every row at this step (the new token included).
        """
        self.finish_prefill()
        state, config = self.state, self.config
        # dense throughout: no labels were made, so every step (one past an outgrown reserve too) is dense
        kv_bytes = 0 if self.dense_throughout else self._layer_kv_bytes(batch, columns)
        kind = state.schedule(config, self.counts, bool(self.sparse_layers), kv_bytes, device)
        if kind != "dense" and state.plan is None:
            state.make_plan(config, self.counts, self.sparse_layers, self.num_layers, self.sel_heads, batch, device)
            for layer in self.layers:
                layer.keep = None
        return kind

    def open_step(self, valid: torch.Tensor) -> None:
        """The step's device tensors (first layer of the decode forward; `DecodeStep.open`).

        Args:
            valid: ``[B, n]`` key validity of the decode query over the own columns.
        """
        self.state.open(self.config, valid, self.work, self.num_layers, self.prefix_tokens(valid.device),
                        static=self.static is not None)

    def begin_decode_step(self, valid: torch.Tensor) -> None:
        """An eager decode step: `schedule_step` from the shapes of `valid` ``[B, n]``, then `open_step`."""
        self.schedule_step(valid.shape[0], valid.shape[1], valid.device)
        self.open_step(valid)

    def _layer_kv_bytes(self, batch: int, columns: int) -> int:
        """Bytes of one layer's own keys and values at this step (what dense attention reads)."""
        keys = self.layers[0]._keys.storage
        return batch * columns * keys.shape[1] * keys.shape[3] * keys.element_size() * 2

    # ---- transformers Cache API -------------------------------------------------------
    def _select_rows(self, rows: torch.Tensor) -> None:
        self.finish_prefill()
        for layer in self.layers:
            layer.select_rows(rows)
        if self.prefix is not None:
            self.prefix.select_rows(rows)
            self._prefix_tokens = None
        if self.state.plan is not None and self.state.plan.per_sample:
            plan = self.state.plan.select_rows(rows.to(self.state.plan.layer_source.device))
            self.state.compile_plan(plan, self.sparse_layers, self.sel_heads)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length():
            self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length():
            self._select_rows(torch.as_tensor(indices, device=self.layers[0].device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length():
            batch = self.layers[0]._keys.storage.shape[0]
            self._select_rows(torch.arange(batch, device=self.layers[0].device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        self.finish_prefill()
        super().crop(tokens_to_remove)
        self.state.last_selection = None

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
            if layer._keys.storage is not None:
                keys = layer._keys.view()
                row_token_bytes = keys.shape[1] * keys.shape[3] * keys.element_size() * 2
                total += keys.shape[0] * layer.get_seq_length() * row_token_bytes
        return total

    def reserved_bytes(self) -> int:
        """Bytes allocated for the rows' own KV and selection metadata (spare capacity included)."""
        return sum(buffer.reserved_bytes() for layer in self.layers for buffer in layer.buffers)

    def label_bytes(self) -> int:
        """Bytes of the selection metadata: label caches (codes, scales, zeros) or Quest page bounds."""
        return sum(layer.policy.nbytes() for layer in self.layers if layer.policy is not None)
