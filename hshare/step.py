"""What one decode step decides, shared by every layer (HShare sections 4.2-4.3).

The host decides the step's *kind* from what it knows without reading the device: the step
counter (query groups: a selection every ``query_group`` steps, HShare eq. 4 c), the KV size
(`HShareConfig.dense_fallback_mib`) and whether any layer is sparse. Kinds:

* ``"dense"``: every layer attends to all valid keys (no sparse layer, or the dense fallback);
* ``"select"``: sparse layers (re)select heavy tokens, source layers and heads only (the plan);
* ``"reuse"``: sparse layers reuse the heavy columns of the last selection (sink and local follow
  the current step).

Everything that depends on the rows' data is a device tensor built once per step by the first
layer (`DecodeStep.open`): the row windows (sink / middle / local geometry over the valid keys) and
the step's share of the work counters. The sharing plan (Algorithm 1) is built once, at the first
sparse step, and compiled to per-layer row and head index tensors (`LayerShare`). A step of one
kind therefore runs the same device work every time: it can be captured once as a CUDA graph and
replayed (`hshare.static_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hshare.config import HShareConfig
from hshare.counters import DecodeStats, WorkCounters
from hshare.planner import SharingPlan, build_plan, identity_plan
from hshare.selection import NO_TOKEN, RowWindows

STEP_KINDS = ("dense", "select", "reuse")


@dataclass
class LayerShare:
    """The compiled plan of one sparse layer at selection steps (built once per plan).

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
class DecodeStep:
    """Step-level state shared by all layers: the host schedule and the step's device tensors.

    Attributes:
        step: decode steps so far in this generation.
        kind: this step's kind (`STEP_KINDS`).
        last_selection: the step of the last selection (None: the next sparse step selects).
        windows: this step's `RowWindows` (sparse steps).
        valid: ``[B, n]`` key validity of this step's own columns.
        own_columns: ``[B, Hkv, n]`` the valid own columns (exact attention beside a shared prefix).
        plan: the sharing plan; shares: its per-layer compiled form.
        head_similarity, layer_similarity: the planner's evidence, per layer, until planned.
    """

    step: int = 0
    kind: str = "dense"
    last_selection: int | None = None
    windows: RowWindows | None = None
    valid: torch.Tensor | None = None
    own_columns: torch.Tensor | None = None
    plan: SharingPlan | None = None
    shares: dict[int, LayerShare] = field(default_factory=dict)
    head_similarity: dict[int, torch.Tensor] = field(default_factory=dict)
    layer_similarity: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def selecting(self) -> bool:
        return self.kind == "select"

    @property
    def dense_fallback(self) -> bool:
        return self.kind == "dense"

    def begin_prefill(self) -> None:
        """A prefill forward invalidates the plan and the last selection."""
        self.plan, self.shares, self.last_selection = None, {}, None

    def schedule(self, config: HShareConfig, counts: DecodeStats, sparse: bool, layer_kv_bytes: int,
                 device: torch.device) -> str:
        """Decide the kind of the next decode step (host only: no device read).

        Args:
            sparse: the model has sparse layers.
            layer_kv_bytes: bytes of one layer's own keys and values at this step (what dense
                attention reads; the dense fallback compares it with its threshold).
        """
        self.step += 1
        counts.decode_steps += 1
        if not sparse:
            self.kind = "dense"
        elif layer_kv_bytes < config.dense_fallback_bytes(device):  # too small for sparse to pay
            counts.dense_fallback_steps += 1
            self.kind, self.last_selection = "dense", None  # the next sparse step selects
        else:
            # Query groups follow one schedule for the whole batch (steps 1, 1 + a, ...), also while
            # every row is within the budget: a row's selections never depend on its batch mates.
            due = self.last_selection is None or self.step - self.last_selection >= config.query_group
            if due:
                self.last_selection = self.step
                counts.selection_steps += int(config.heavy > 0)
            self.kind = "select" if due and config.heavy > 0 else "reuse"
        return self.kind

    def open(self, config: HShareConfig, valid: torch.Tensor, work: WorkCounters, layers: int,
             prefix_tokens: tuple[torch.Tensor, torch.Tensor] | None, static: bool) -> None:
        """Build the step's device tensors (called by the first layer of the decode forward).

        Args:
            valid: ``[B, n]`` key validity of the decode query over the own columns.
            static: static shapes (a captured step): never read the device (`RowWindows.all_short`
                stays False; short rows are exact through their critical indices anyway).
        """
        self.valid, self.own_columns, self.windows = valid, None, None
        if self.kind == "dense":
            work.begin_step(valid.sum(), layers, prefix_tokens)
            return
        lookahead = config.query_group - 1 if self.selecting and config.group_lookahead else 0
        self.windows = RowWindows.build(valid, config.sink, config.local, config.budget, lookahead, sync=not static)
        work.begin_step(valid.sum(), layers, prefix_tokens, sparse_rows=~self.windows.short)

    def own_valid_columns(self, kv_heads: int) -> torch.Tensor:
        """``[B, Hkv, n]`` every valid own column of this step (``NO_TOKEN`` elsewhere), built once."""
        if self.own_columns is None:
            valid = self.valid
            columns = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
            own = torch.where(valid, columns, torch.full_like(columns, NO_TOKEN))
            self.own_columns = own[:, None].expand(-1, kv_heads, -1).contiguous()
        return self.own_columns

    # ---- the plan -----------------------------------------------------------------------
    def make_plan(self, config: HShareConfig, counts: DecodeStats, sparse_layers: list[int], num_layers: int,
                  sel_heads: int, batch: int, device: torch.device) -> None:
        """Build and compile the sharing plan from the prefill evidence (one host sync).

        Args:
            sel_heads: H_sel of this process (`HShareCache.set_heads`: a tensor-parallel rank's own
                selection heads), the size of the evidence's head dimensions.
        """
        if not config.shares_layers_or_heads:
            plan = identity_plan(num_layers, sel_heads, device)
        else:
            generator = torch.Generator().manual_seed(config.seed) if config.planner == "random" else None
            plan = build_plan(
                self.head_similarity, self.layer_similarity, sparse_layers, num_layers, sel_heads,
                config.layer_sharing, config.head_sharing, config.plan_scope == "sample", batch, device, generator,
            )
            counts.plans += 1
        self.head_similarity, self.layer_similarity = {}, {}
        self.compile_plan(plan, sparse_layers, sel_heads)

    def compile_plan(self, plan: SharingPlan, sparse_layers: list[int], sel_heads: int) -> None:
        """Turn the plan into per-layer row and head index tensors (one host sync per plan)."""
        self.plan = plan
        layer_source = plan.layer_source.cpu()
        head_source = plan.head_source.cpu()
        device = plan.layer_source.device
        heads = torch.arange(sel_heads)
        shares = {}
        for layer in sparse_layers:
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
        self.shares = shares
