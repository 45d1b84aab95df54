"""The per-`generate` cache: KV, labels, sharing plan, selections and counters (all state).

A fresh `HShareCache` is made for every ``generate`` call (`hshare.api` injects it), so batch
size, prompts and lengths may change freely between calls and nothing leaks. It is a transformers
`Cache` (generate, beams and pipelines use it as any other cache); its layers keep the whole KV
in growable buffers (no per-step ``torch.cat``). Sliding-window models keep full KV: the window is
enforced by the attention mask, so the sparse path never attends outside it.

Work counters (`DecodeStats`, ``cache.stats``): host integers where the work is known from shapes
(steps, scorings, scored tokens / pages), device tensors for the K/V rows read (`WorkCounters`: no
host sync in a decode step; reading ``cache.stats`` syncs once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hshare.buffer import GrowingBuffer
from hshare.channels import ChannelCalibration
from hshare.config import HShareConfig
from hshare.planner import SharingPlan, build_plan, identity_plan
from hshare.policy import SelectionPolicy
from hshare.prefix_store import PrefixStore
from hshare.selection import NO_TOKEN, RowWindows


class HShareLayer(CacheLayerMixin):
    """One layer's KV (``[B, Hkv, n, d]`` views of growable buffers) and sparse-decode state.

    Attributes:
        policy: the layer's selection-policy metadata (`hshare.policy.SelectionPolicy`: a
            `LabelCache` or a `QuestPageCache`; sparse layers, after prefill).
        heavy: ``[B, H_sel, heavy]`` heavy columns of the last selection (query groups reuse them).
        keep: ``[B, H_sel, W, heavy]`` prefill keep-sets, the planner's evidence (until planned).
        prefix_width: columns held by the cache's shared-prefix store before this layer's own
            columns (counted in the sequence length transformers sees).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self) -> None:
        super().__init__()
        self._keys = GrowingBuffer()
        self._values = GrowingBuffer()
        self.policy: SelectionPolicy | None = None
        self.heavy: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None
        self.prefix_width = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._keys.append(key_states)
        self.values = self._values.append(value_states)
        return self.keys, self.values

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
        self.__init__()

    def kv_bytes(self) -> int:
        return self._keys.nbytes() + self._values.nbytes()


@dataclass
class DecodeStats:
    """Counters of one generation (what sharing saves is visible here), all exact integers.

    The attention-cost counters turn into cost ratios: ``kv_rows_read / dense_kv_rows`` is the
    share of dense attention's KV reads a config does, and ``scored_tokens`` (labels: x the label
    bytes per token) or ``scored_pages`` (Quest: x 2 x d key elements per page) the selection work.
    All count decode steps only (prefill, sparse or not, is not counted).

    Attributes:
        decode_steps: decode forward passes.
        sparse_steps: decode steps where at least one row attended sparsely.
        dense_fallback_steps: decode steps run densely because the KV was too small for sparse
            attention to pay (`HShareConfig.dense_fallback_mib`).
        selection_steps: decode steps that (re)selected critical tokens (query groups).
        score_computations: (row, layer, selection head) scorings done (label or page scores).
        plans: sharing plans built (one per generate when layers or heads share).
        scored_tokens: tokens whose approximate score was computed (labels policy): summed over
            scorings, the label-cache length n of the layer at that step (every cached own column
            of the row is scored, left padding included).
        scored_pages: the same for the Quest policy: summed over scorings, the page slots of the
            layer's page cache at that step.
        kv_rows_read: K/V token rows read by decode attention, summed over (row, layer, KV-head
            reading): a dense step or layer reads each row's valid keys x Hkv; a sparse layer reads
            the valid (not -1) critical indices x the heads reading them (per-KV-head selection:
            Hkv readings of N_c; per-query-head selection: Hq readings); a shared-prefix level is
            read once per group that has rows (its valid tokens x Hkv, for all rows of the group).
        dense_kv_rows: what dense attention without a shared prefix reads at the same steps: every
            row's valid keys (prefix levels included) x Hkv x layers.

    The two KV counters are accumulated on the device (`HShareCache` adds tensors to a small
    int64 tensor: no host sync in a decode step) and converted when ``cache.stats`` is read.
    """

    decode_steps: int = 0
    sparse_steps: int = 0
    dense_fallback_steps: int = 0
    selection_steps: int = 0
    score_computations: int = 0
    plans: int = 0
    scored_tokens: int = 0
    scored_pages: int = 0
    kv_rows_read: int = 0
    dense_kv_rows: int = 0


_KV_ROWS_READ, _DENSE_KV_ROWS = 0, 1  # slots of the WorkCounters tensors


class WorkCounters:
    """The device side of `DecodeStats`: K/V rows read, accumulated without host syncs.

    Each decode step adds, once, what dense attention reads (``begin_step``: the rows' valid keys,
    a device scalar, x Hkv x layers) and what the prefix levels cost; the layers that read every
    valid own key are counted on the host as they run and added once per step (`flush`: one
    tensor op); sparse layers add the valid count of their critical indices (`add_indices`). One
    int64 ``[2]`` tensor per device; `totals` syncs once.

    Args:
        kv_heads: Hkv, the KV heads a dense reading reads each valid key from.
    """

    def __init__(self, kv_heads: int) -> None:
        self.kv_heads = kv_heads
        self.work: dict[torch.device, torch.Tensor] = {}
        self.own_keys: torch.Tensor | None = None  # this step: valid own keys of all rows (device scalar)
        self.dense_layers = 0  # layers of this step that read every valid own key (host count)

    def _on(self, device: torch.device) -> torch.Tensor:
        work = self.work.get(device)
        if work is None:
            work = self.work[device] = torch.zeros(2, dtype=torch.int64, device=device)
        return work

    def flush(self) -> None:
        """Add the dense readings of the current step (one tensor op per step)."""
        if self.own_keys is not None and self.dense_layers:
            self._on(self.own_keys.device)[_KV_ROWS_READ].add_(self.own_keys, alpha=self.dense_layers * self.kv_heads)
        self.dense_layers = 0

    def begin_step(self, own_keys: torch.Tensor, layers: int, prefix_tokens: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> None:
        """A decode step starts.

        Args:
            own_keys: valid own keys summed over the rows (int64 device scalar).
            layers: the model's layers (each one attends once per step).
            prefix_tokens: None, or the prefix levels' ``(valid tokens summed over the groups that
                have rows, valid tokens summed over the rows' groups)`` (device scalars).
        """
        self.flush()
        self.own_keys = own_keys
        work = self._on(own_keys.device)
        work[_DENSE_KV_ROWS].add_(own_keys, alpha=layers * self.kv_heads)
        if prefix_tokens is not None:
            work[_KV_ROWS_READ].add_(prefix_tokens[0].to(work.device), alpha=layers * self.kv_heads)
            work[_DENSE_KV_ROWS].add_(prefix_tokens[1].to(work.device), alpha=layers * self.kv_heads)

    def add_dense_layer(self) -> None:
        """A layer of this step read every valid own key of every row, from every KV head."""
        self.dense_layers += 1

    def add_indices(self, indices: torch.Tensor) -> None:
        """A layer read the valid entries of its critical indices ``[B, H_sel, N_c]`` (-1 = none)."""
        self._on(indices.device)[_KV_ROWS_READ].add_((indices >= 0).sum())

    def totals(self) -> tuple[int, int]:
        """``(kv_rows_read, dense_kv_rows)`` as ints (a host sync)."""
        self.flush()
        read = dense = 0
        for work in self.work.values():
            r, d = work.tolist()
            read, dense = read + r, dense + d
        return read, dense


@dataclass
class LayerShare:
    """The compiled plan of one sparse layer at selection steps (host-side, built once).

    Attributes:
        select_rows: rows for which this layer selects (None = all rows; empty = none).
        copy_groups: ``(source layer, rows or None = all)`` whose heavy columns this layer copies.
        source_heads: ``[P, n_src]`` selection heads that compute scores.
        head_slot: ``[P, H_sel]`` position in `source_heads` of each head's source.
        all_heads: every head is a source (no head sharing): no head gathers needed.
    """

    select_rows: torch.Tensor | None
    copy_groups: list[tuple[int, torch.Tensor | None]]
    source_heads: torch.Tensor
    head_slot: torch.Tensor
    all_heads: bool


@dataclass
class DecodeState:
    """Step-level state shared by all layers."""

    step: int = 0
    last_selection: int | None = None
    selecting: bool = False
    windows: RowWindows | None = None
    dense_fallback: bool = False
    valid: torch.Tensor | None = None
    own_columns: torch.Tensor | None = None
    plan: SharingPlan | None = None
    shares: dict[int, LayerShare] = field(default_factory=dict)
    head_similarity: dict[int, torch.Tensor] = field(default_factory=dict)
    layer_similarity: dict[int, torch.Tensor] = field(default_factory=dict)


class HShareCache(Cache):
    """All state of one generation: KV, labels, plan, selections, counters.

    Args:
        config: the validated `HShareConfig`.
        model_config: the model's transformers config.
        calibration: heavy channels from a calibration file, or None (dynamic per row).
    """

    def __init__(self, config: HShareConfig, model_config, calibration: ChannelCalibration | None = None) -> None:
        self.num_layers = model_config.num_hidden_layers
        super().__init__(layers=[HShareLayer() for _ in range(self.num_layers)])
        self.config = config
        self.calibration = calibration
        self.q_heads = model_config.num_attention_heads
        self.kv_heads = model_config.num_key_value_heads
        self.sel_heads = self.kv_heads if config.selection == "kv_head" else self.q_heads
        dense = set(config.dense_layers)
        self.sparse_layers = [i for i in range(self.num_layers) if i not in dense] if config.sparse else []
        self._sparse = set(self.sparse_layers)
        self.state = DecodeState()
        self.counts = DecodeStats()  # the host-side counters (kv_rows_read, dense_kv_rows stay 0 here)
        self.work = WorkCounters(self.kv_heads)  # the device-side ones
        self.prefix: PrefixStore | None = None
        self._prefix_tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def stats(self) -> DecodeStats:
        """The generation's counters (`DecodeStats`), a fresh object at each read. The K/V row
        counters live on the device during generation; reading them here is one host sync."""
        read, dense = self.work.totals()
        return dataclasses.replace(self.counts, kv_rows_read=read, dense_kv_rows=dense)

    def count_scorings(self, scorings: int, policy: SelectionPolicy) -> None:
        """`scorings` (row, head) scorings of one layer by `policy` (host ints from shapes: no sync)."""
        self.counts.score_computations += scorings
        units = scorings * policy.scored_units()
        if policy.unit == "pages":
            self.counts.scored_pages += units
        else:
            self.counts.scored_tokens += units

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
        state = self.state
        if state.own_columns is None:
            valid = state.valid
            columns = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
            own = torch.where(valid, columns, torch.full_like(columns, NO_TOKEN))
            state.own_columns = own[:, None].expand(-1, self.kv_heads, -1).contiguous()
        return state.own_columns

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
        return layer in self._sparse

    @property
    def collects_evidence(self) -> bool:
        """Whether prefill records keep-sets (only when a greedy plan will use them)."""
        return bool(self.sparse_layers) and self.config.shares_layers_or_heads and self.config.planner == "greedy"

    def earlier_keep_sets(self, layer: int) -> list[torch.Tensor]:
        return [self.layers[i].keep for i in self.sparse_layers if i < layer and self.layers[i].keep is not None]

    # ---- steps --------------------------------------------------------------------------
    def begin_prefill(self) -> None:
        """A prefill forward (q_len > 1) invalidates the plan and selections of earlier steps."""
        self.state.plan = None
        self.state.shares = {}
        self.state.last_selection = None
        for layer in self.layers:
            layer.heavy = None

    def begin_decode_step(self, valid: torch.Tensor) -> None:
        """Called once per decode forward (first layer): row windows, plan, selection due.

        Args:
            valid: ``[B, n]`` key validity of the decode query.
        """
        state, config = self.state, self.config
        state.step += 1
        self.counts.decode_steps += 1
        state.valid, state.own_columns = valid, None
        self.work.begin_step(valid.sum(), self.num_layers, self.prefix_tokens(valid.device))
        if not self.sparse_layers:
            state.windows, state.selecting = None, False
            return
        state.dense_fallback = self._layer_kv_bytes(valid) < config.dense_fallback_bytes(valid.device)
        if state.dense_fallback:  # too small for sparse to pay: exact dense; the next sparse step selects
            self.counts.dense_fallback_steps += 1
            state.windows, state.selecting, state.last_selection = None, False, None
            return
        if state.plan is None:
            self._plan(batch=valid.shape[0], device=valid.device)
        # Query groups follow one schedule for the whole batch (steps 1, 1 + a, ...), also while
        # every row is within the budget: a row's selections never depend on its batch mates.
        due = state.last_selection is None or state.step - state.last_selection >= config.query_group
        state.selecting = bool(due and config.heavy > 0)
        if due:
            state.last_selection = state.step
            self.counts.selection_steps += int(config.heavy > 0)
        lookahead = config.query_group - 1 if state.selecting and config.group_lookahead else 0
        state.windows = RowWindows.build(valid, config.sink, config.local, config.budget, lookahead)
        self.counts.sparse_steps += int(not state.windows.all_short)

    def _layer_kv_bytes(self, valid: torch.Tensor) -> int:
        """Bytes of one layer's own keys and values at this step (what dense attention reads)."""
        keys = self.layers[self.sparse_layers[0]]._keys.storage
        return valid.shape[0] * valid.shape[1] * keys.shape[1] * keys.shape[3] * keys.element_size() * 2

    # ---- the plan -----------------------------------------------------------------------
    def _plan(self, batch: int, device: torch.device) -> None:
        config, state = self.config, self.state
        if not config.shares_layers_or_heads:
            plan = identity_plan(self.num_layers, self.sel_heads, device)
        else:
            generator = torch.Generator().manual_seed(config.seed) if config.planner == "random" else None
            plan = build_plan(
                state.head_similarity, state.layer_similarity, self.sparse_layers, self.num_layers, self.sel_heads,
                config.layer_sharing, config.head_sharing, config.plan_scope == "sample", batch, device, generator,
            )
            self.counts.plans += 1
        state.head_similarity, state.layer_similarity = {}, {}
        for layer in self.layers:
            layer.keep = None
        self._compile_plan(plan)

    def _compile_plan(self, plan: SharingPlan) -> None:
        """Turn the plan into per-layer row and head lists (one host sync per generate)."""
        state = self.state
        state.plan = plan
        layer_source = plan.layer_source.cpu()
        head_source = plan.head_source.cpu()
        device = plan.layer_source.device
        heads = torch.arange(self.sel_heads)
        shares = {}
        for layer in self.sparse_layers:
            sources = layer_source[:, layer]  # [P]
            if plan.per_sample:
                mine = (sources == layer).nonzero().flatten()
                select_rows = mine.to(device) if len(mine) < len(sources) else None
                copy_groups = [
                    (int(src), (sources == src).nonzero().flatten().to(device))
                    for src in sources.unique().tolist() if src != layer
                ]
            else:
                own = int(sources[0]) == layer
                select_rows = None if own else torch.zeros(0, dtype=torch.long, device=device)
                copy_groups = [] if own else [(int(sources[0]), None)]
            head_src = head_source[layer]  # [P, H]
            is_source = head_src == heads  # [P, H]
            source_heads = heads.expand_as(head_src)[is_source].reshape(len(head_src), -1)  # same count per row
            slot = torch.searchsorted(source_heads.contiguous(), head_src.contiguous())
            shares[layer] = LayerShare(
                select_rows=select_rows,
                copy_groups=copy_groups,
                source_heads=source_heads.to(device),
                head_slot=slot.to(device),
                all_heads=bool(is_source.all()),
            )
        state.shares = shares

    # ---- transformers Cache API -------------------------------------------------------
    def _select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_rows(rows)
        if self.prefix is not None:
            self.prefix.select_rows(rows)
            self._prefix_tokens = None
        if self.state.plan is not None and self.state.plan.per_sample:
            self._compile_plan(self.state.plan.select_rows(rows.to(self.state.plan.layer_source.device)))

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

    def label_bytes(self) -> int:
        """Bytes of the selection metadata: label caches (codes, scales, zeros) or Quest page bounds."""
        return sum(layer.policy.nbytes() for layer in self.layers if layer.policy is not None)
