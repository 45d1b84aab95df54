"""One decode step, planned once before the model's layers run and then run by every layer.

The split is FlashInfer's ``plan()`` / ``run()``:

* `StepPlanner.plan` (host only, no device read) decides the step's *kind* from the step counter
  (query groups: a selection every ``query_group`` steps, HShare eq. 4 c), what a sparse step would
  save over a dense one (`StepPlanner.sparse_pays`) and whether any layer is sparse, and builds the sharing plan
  (Algorithm 1) at the first sparse step. Kinds:

  - ``"dense"``: every layer attends to all valid keys (no sparse layer, or the dense fallback);
  - ``"select"``: sparse layers (re)select heavy tokens, source layers and heads only (the plan);
  - ``"reuse"``: sparse layers reuse the heavy columns of the last selection (sink and local follow
    the current step).

* `StepPlanner.open` builds what depends on the rows' data as device tensors, once for all layers:
  the row windows (sink / middle / local geometry over the valid keys), the own columns beside a
  shared prefix, the step's share of the work counters. The result, a frozen `DecodeStep`, is all
  the registered attention function reads about the step (`hshare.attention`).

Who calls them: a forward pre-hook on the model's decoder (`hshare.api`) begins every forward
(`StepPlanner.begin_forward`): a prefill resets the schedule, an eager decode step is planned and
opened there. Static-shape decode (`hshare.static_decode`) plans on the host
(`StepPlanner.begin_static_step`) and the same pre-hook opens the step inside the captured graph
from the cache's device validity, so a replay rebuilds the device half; a step of one kind therefore
runs the same device work every time. The model's forward hook ends every forward
(`StepPlanner.end_forward`): the prefill's selection metadata is built once the forward's
activations are freed (`hshare.prefill_metadata`), and the step's scorings are counted on the host.

The planner also keeps what spans steps of one generation: the schedule, the plan and its per-layer
compiled form (`LayerShare`), the planner's evidence until the plan is built, and the counters
(`hshare.counters`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hshare import prefill_metadata
from hshare.config import HShareConfig
from hshare.counters import DecodeStats, WorkCounters
from hshare.planner import SharingPlan, build_plan, identity_plan
from hshare.selection import NO_TOKEN, RowWindows, own_key_validity

if TYPE_CHECKING:
    from hshare.cache import HShareCache

STEP_KINDS = ("dense", "select", "reuse")


@dataclass(frozen=True)
class LayerShare:
    """The compiled plan of one sparse layer at selection steps (built once per plan).

    Attributes:
        select_rows: rows for which this layer selects (None = all rows; empty = none).
        copy_groups: ``(source layer, rows or None = all)`` whose heavy columns this layer copies.
        source_heads: ``[P, n_src]`` selection heads that compute scores.
        head_slot: ``[P, H_sel]`` position in `source_heads` of each head's source.
        copy_heads: ``[P, H_sel - n_src]`` the heads that copy another (candidate-set refinement refines
            their source's candidates).
        all_heads: every head is a source (no head sharing): no head gathers needed.
    """

    select_rows: torch.Tensor | None
    copy_groups: tuple[tuple[int, torch.Tensor | None], ...]
    source_heads: torch.Tensor
    head_slot: torch.Tensor
    copy_heads: torch.Tensor
    all_heads: bool

    def scorings(self, batch: int) -> int:
        """(row, selection head) scorings this layer computes at a selection step of `batch` rows."""
        rows = batch if self.select_rows is None else len(self.select_rows)
        return rows * self.source_heads.shape[1]

    def refinements(self, batch: int) -> int:
        """(row, selection head) candidate refinements this layer computes at a selection step of `batch`
        rows (`SharingConfig.candidates`): the copying heads of its selecting rows, every head of its
        copying rows."""
        rows = batch if self.select_rows is None else len(self.select_rows)
        return rows * self.copy_heads.shape[1] + (batch - rows) * (self.source_heads.shape[1] + self.copy_heads.shape[1])


@dataclass(frozen=True)
class StepPlan:
    """The host half of a decode step (`StepPlanner.plan`).

    Attributes:
        kind: one of `STEP_KINDS`.
        shares: sparse layer -> its compiled plan (empty for a dense step).
        lookahead: ranks a selection step's `RowWindows.selectable` reaches into the local window.
    """

    kind: str
    shares: dict[int, LayerShare]
    lookahead: int = 0


@dataclass(frozen=True)
class DecodeStep:
    """What every layer of one decode forward runs (`StepPlanner.open`); nothing in it changes
    during the forward.

    Attributes:
        kind: one of `STEP_KINDS`.
        shares: sparse layer -> its compiled plan (`LayerShare`; empty for a dense step).
        valid: ``[B, n]`` key validity of the decode query over the own columns (static shapes: every
            reserved column, those not yet written False).
        windows: the rows' `RowWindows` (sparse steps; None for a dense step).
        own_columns: ``[B, Hkv, n]`` every valid own column (``NO_TOKEN`` elsewhere): exact attention
            over the own part beside a shared prefix (None without a prefix).
    """

    kind: str
    shares: dict[int, LayerShare]
    valid: torch.Tensor
    windows: RowWindows | None
    own_columns: torch.Tensor | None

    @property
    def selecting(self) -> bool:
        return self.kind == "select"

    @property
    def dense(self) -> bool:
        return self.kind == "dense"


@dataclass
class StepPlanner:
    """The decode schedule of one generation, and what the steps did.

    Args:
        config: the validated `HShareConfig`.
        num_layers: the model's layers.
        sliding_window: the window every layer applies (keys older than it are invalid), or None.

    Attributes:
        sparse_layers: layers that may attend sparsely (all but ``config.sharing.dense_layers``).
        step: decode steps so far; last_selection: the step of the last selection (None: the next
            sparse step selects).
        sharing: the sharing plan (Algorithm 1); shares: its per-layer compiled form; every_head: ``[1, H_sel]``
            the selection heads in order (the heads of a refinement of every head in place).
        dense_throughout: decided after the own prefill of a reserved cache: True when even the
            reserved final length stays below the dense fallback, so every decode step is dense and
            no selection metadata is ever built.
        head_similarity, layer_similarity, keep: the planner's evidence per sparse layer (prefill
            keep-sets), until the plan is built; half_similarity: ``(head, layer)`` similarities of the even and
            of the odd evidence rows (`build_plan`'s halves; filled under a scoring budget only).
        pending: what each sparse layer's last prefill left for its metadata (`hshare.prefill_metadata`).
        prefill_valid: the key validity the sparse layers of the running prefill forward share.
        counts: the host counters; work: the device ones (`hshare.counters`).
        decision: why the last decode step (or the own prefill's `dense_throughout`) chose dense or sparse
            (`sparse_pays`), with its numbers.
        forward: what the running forward is, ``"prefill"`` or ``"decode"`` (None between forwards: the
            attention function refuses to run an unplanned forward).
        current: the step the layers of the running (or last) decode forward read.
        planned: the running decode forward's plan (static shapes open it inside their graph).
    """

    config: HShareConfig
    num_layers: int
    sliding_window: int | None = None
    sparse_layers: list[int] = field(init=False)
    step: int = 0
    last_selection: int | None = None
    sharing: SharingPlan | None = None
    shares: dict[int, LayerShare] = field(default_factory=dict)
    every_head: torch.Tensor | None = None
    dense_throughout: bool | None = None
    head_similarity: dict[int, torch.Tensor] = field(default_factory=dict)
    layer_similarity: dict[int, torch.Tensor] = field(default_factory=dict)
    keep: dict[int, torch.Tensor] = field(default_factory=dict)
    half_similarity: tuple[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]], ...] = field(
        default_factory=lambda: (({}, {}), ({}, {})))
    pending: dict[int, prefill_metadata.PendingPrefill] = field(default_factory=dict)
    prefill_valid: tuple[tuple, torch.Tensor] | None = None
    counts: DecodeStats = field(default_factory=DecodeStats)
    work: WorkCounters = field(default_factory=WorkCounters)
    forward: str | None = None
    decision: str = ""
    current: DecodeStep | None = None
    planned: StepPlan | None = None
    _select_scorings: tuple[int, int, int, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        dense = set(self.config.sharing.dense_layers)
        self.sparse_layers = [i for i in range(self.num_layers) if i not in dense] if self.config.sparse else []
        self._sparse = frozenset(self.sparse_layers)

    def sharing_summary(self) -> dict[str, float]:
        """What the sharing plan shares (`SharingPlan.summary` over the sparse layers); empty without a plan."""
        return {} if self.sharing is None else self.sharing.summary(self.sparse_layers)

    # ---- layer roles --------------------------------------------------------------------

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` keeps selection metadata and may attend sparsely."""
        return layer in self._sparse and not self.dense_throughout

    @property
    def collects_evidence(self) -> bool:
        """Whether prefill records keep-sets (only when a greedy plan will use them)."""
        return (bool(self.sparse_layers) and self.config.sharing.shares_layers_or_heads
                and self.config.planner.method != "random")

    def earlier_keep_sets(self, layer: int) -> list[torch.Tensor]:
        return [self.keep[i] for i in self.sparse_layers if i < layer and i in self.keep]

    # ---- a forward begins and ends --------------------------------------------------------
    def begin_forward(self, cache: HShareCache, query_length: int, attention_mask: torch.Tensor | None) -> None:
        """Before layer 0 of a forward over `cache` (the decoder's forward pre-hook, `hshare.api`): a prefill
        (more than one query, the rows' first own token, or a shared-prefix fill) resets the schedule; a
        decode step is planned and opened over the forward's mask. A static-shape step, planned on the host
        by `begin_static_step`, is opened over the cache's device validity (inside a captured graph).

        Args:
            attention_mask: the forward's mask: generate's 2-D ``[B, columns]`` (its last own columns
                are the rows' own ones), a 4-D ``[B, 1, q, columns]`` mask, or None (all valid).
        """
        if cache.static is not None and self.forward == "decode" and self.planned is not None:
            self.open(cache, self.planned, cache.static.valid)
            return
        if query_length != 1 or not cache.own_length or cache.filling_prefix:
            self.begin_prefill(cache)
            self.forward = "prefill"
            return
        self.forward = "decode"
        self.planned = self.plan(cache, cache.rows, cache.own_length + 1)
        valid = own_key_validity(attention_mask, cache.rows, cache.own_length + 1, self.sliding_window,
                                 cache.storage_device)
        self.open(cache, self.planned, valid)

    def begin_static_step(self, cache: HShareCache) -> StepPlan:
        """A static-shape decode step (`hshare.static_decode`), planned on the host before its token is
        stored; `begin_forward` opens it inside the step's graph."""
        self.forward = "decode"
        self.planned = self.plan(cache, cache.rows, cache.own_length + 1)
        return self.planned

    def end_forward(self, cache: HShareCache) -> None:
        """After a forward: the prefill's selection metadata (built now that the forward's activations
        are freed) and the host count of a selection step's scorings (a replayed graph ran no Python)."""
        self.finish_prefill(cache)
        if self.planned is not None and self.planned.kind != "dense":
            self._count_scorings(cache, self.planned)
        self.planned, self.forward = None, None

    def begin_prefill(self, cache: HShareCache) -> None:
        """A prefill forward invalidates the plan and the selections of earlier steps."""
        self.finish_prefill(cache)
        self.sharing, self.shares, self.last_selection, self.current, self.planned = None, {}, None, None, None
        self.every_head = None
        cache.drop_selections()

    def finish_prefill(self, cache: HShareCache) -> None:
        """Build what the last prefill forward left to its sparse layers (nothing when none is pending).
        After the own prefill of a reserved cache, first decide `dense_throughout`: then no metadata is
        built and the layers' policies are dropped."""
        if (self.dense_throughout is None and cache.reserve and self.sparse_layers and cache.own_length
                and not cache.filling_prefix):  # a reserved cache decodes with static shapes: as CUDA graphs
            self.dense_throughout = not self.sparse_pays(cache, cache.rows, cache.reserve, graphs=True)
            if self.dense_throughout:
                self.pending = {}
                cache.drop_policies()
        for layer in sorted(self.pending):
            prefill_metadata.complete(cache, self, layer)
        self.prefill_valid = None

    # ---- plan ---------------------------------------------------------------------------
    def plan(self, cache: HShareCache, batch: int, columns: int) -> StepPlan:
        """Decide the next decode step (host only: no device read) and build the sharing plan at the first
        sparse step (one host sync per plan).

        Args:
            batch: rows; columns: own columns of every row at this step (the new token included).
        """
        self.finish_prefill(cache)
        config, counts = self.config, self.counts
        self.step += 1
        counts.decode_steps += 1
        if not self.sparse_layers:
            return StepPlan("dense", {})
        if self.dense_throughout or not self.sparse_pays(cache, batch, columns, graphs=cache.static is not None):
            counts.dense_fallback_steps += 1
            self.last_selection = None  # the next sparse step selects
            return StepPlan("dense", {})
        # Query groups follow one schedule for the whole batch (steps 1, 1 + a, ...), also while every
        # row is within the budget: a row's selections never depend on its batch mates.
        due = self.last_selection is None or self.step - self.last_selection >= config.sharing.query_group
        if due:
            self.last_selection = self.step
            counts.selection_steps += int(config.budget.heavy > 0)
        if self.sharing is None:
            self._make_plan(cache, batch)
        selecting = due and config.budget.heavy > 0
        lookahead = config.sharing.query_group - 1 if selecting and config.sharing.lookahead else 0
        return StepPlan("select" if selecting else "reuse", self.shares, lookahead)

    def sparse_pays(self, cache: HShareCache, rows: int, columns: int, graphs: bool) -> bool:
        """Whether a sparse step saves enough reads to pay for its selection, gather and launches: the K/V bytes
        one layer would not read, ``rows x (columns - N_c) x`` K/V bytes per token, against
        `HShareConfig.sparse_min_saved_bytes` for this device, the policy and steps replayed as CUDA graphs or
        run eagerly. Saved bytes grow with the columns, so a length that does not pay never paid before it.
        The decision and its numbers are kept in `decision`."""
        config = self.config
        saved = config.sparse_saved_bytes(rows, columns, cache.layer_kv_bytes(1, 1))
        needed = config.sparse_min_saved_bytes(cache.storage_device, graphs)
        pays = saved >= needed
        extra, policy = config.policy.selection_min_saved_mib, ""
        if extra and config.runtime.dense_fallback_mib is None and needed:
            policy = f", of which {extra:g} for {config.policy.name}'s selection"
        self.decision = (f"{'sparse' if pays else 'dense'}: a sparse step saves {saved / 2**20:.1f} MiB of K/V reads "
                         f"per layer ({rows} rows x ({columns} - {config.budget.total}) columns), "
                         f"{'>=' if pays else '<'} {needed / 2**20:g} MiB{policy} "
                         f"({'CUDA graphs' if graphs else 'eager'})")
        return pays

    def open(self, cache: HShareCache, plan: StepPlan, valid: torch.Tensor) -> DecodeStep:
        """Build the step's device tensors from the own columns' validity ``[B, n]`` and make it the
        current step. Static shapes (``cache.static``) never read the device (`RowWindows.all_short`
        stays False; short rows are exact through their critical indices anyway)."""
        config, static = self.config, cache.static is not None
        own_keys = valid.sum()
        prefix_tokens = None if cache.prefix is None else cache.prefix.read_tokens(valid.device)
        windows = None
        if plan.kind == "dense":
            self.work.begin_step(own_keys, self.num_layers, cache.kv_heads, prefix_tokens)
        else:
            windows = RowWindows.build(valid, config.budget.sink, config.budget.local, config.budget.total, plan.lookahead,
                                       sync=not static)
            self.work.begin_step(own_keys, self.num_layers, cache.kv_heads, prefix_tokens, sparse_rows=~windows.short)
        own_columns = None
        if cache.prefix is not None:
            columns = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
            own = torch.where(valid, columns, torch.full_like(columns, NO_TOKEN))
            own_columns = own[:, None].expand(-1, cache.kv_heads, -1).contiguous()
        self.current = DecodeStep(plan.kind, plan.shares, valid, windows, own_columns)
        return self.current

    def _make_plan(self, cache: HShareCache, batch: int) -> None:
        """Build and compile the sharing plan from the prefill evidence (one host sync)."""
        config = self.config
        if not config.sharing.shares_layers_or_heads:
            plan = identity_plan(self.num_layers, cache.sel_heads, cache.storage_device)
        else:
            generator = torch.Generator().manual_seed(config.planner.seed) if config.planner.method == "random" else None
            auto = config.planner.method == "auto"
            plan = build_plan(
                self.head_similarity, self.layer_similarity, self.sparse_layers, self.num_layers, cache.sel_heads,
                config.sharing.layer, config.sharing.head, config.planner.scope == "sample", batch, cache.storage_device,
                generator, config.planner.similarity if auto and config.planner.scorings is None else None,
                config.planner.scorings, cache.heads.mean_over_ranks,
                self.half_similarity if any(self.half_similarity[1]) else None,
            )
            self.counts.plans += 1
        self.head_similarity, self.layer_similarity, self.keep = {}, {}, {}
        self.half_similarity = (({}, {}), ({}, {}))
        self._compile(plan, cache.sel_heads)

    def _compile(self, plan: SharingPlan, sel_heads: int) -> None:
        """Turn the plan into per-layer row and head index tensors (one host sync per plan)."""
        self.sharing = plan
        layer_source = plan.layer_source.cpu()
        head_source = plan.head_source.cpu()
        device = plan.layer_source.device
        heads = torch.arange(sel_heads)
        shares = {}
        for layer in self.sparse_layers:
            sources = layer_source[:, layer]  # [P]
            if plan.per_sample:
                mine = (sources == layer).nonzero().flatten()
                select_rows = mine.to(device) if len(mine) < len(sources) else None
                copy_groups = tuple(
                    (int(src), (sources == src).nonzero().flatten().to(device))
                    for src in sources.unique().tolist() if src != layer
                )
            else:
                own = int(sources[0]) == layer
                select_rows = None if own else torch.zeros(0, dtype=torch.long, device=device)
                copy_groups = () if own else ((int(sources[0]), None),)
            head_src = head_source[layer]  # [P, H]
            is_source = head_src == heads  # [P, H]
            source_heads = heads.expand_as(head_src)[is_source].reshape(len(head_src), -1)  # same count per row
            slot = torch.searchsorted(source_heads.contiguous(), head_src.contiguous())
            copy_heads = heads.expand_as(head_src)[~is_source].reshape(len(head_src), -1)
            shares[layer] = LayerShare(
                select_rows=select_rows,
                copy_groups=copy_groups,
                source_heads=source_heads.to(device),
                head_slot=slot.to(device),
                copy_heads=copy_heads.to(device),
                all_heads=bool(is_source.all()),
            )
        self.shares = shares
        self.every_head = heads[None].to(device)  # [1, H_sel]: a refinement of every head in place
        self._select_scorings = None  # (rows, scorings and refinements of a selection step, refinements of a
        # reuse step), summed at the first sparse step

    def _count_scorings(self, cache: HShareCache, plan: StepPlan) -> None:
        """Host counters of a sparse step: (row, layer, head) scorings and candidate refinements, and the
        units they scored, in the policy's own unit (`SelectionPolicy.unit`; a scoring scores
        `SelectionPolicy.scored_units` after the step's token, the same for every sparse layer, plus its C
        candidates again with `SharingConfig.candidates` (`hshare.refine.select_candidates`), or its top C or
        heavy with `SharingConfig.successors`; a refinement C units, or every unit for a policy without
        `SelectionPolicy.candidate_scores`). O(1): the work of a step of each kind is summed per plan."""
        rows, count = cache.rows, self.config.candidate_count
        if self._select_scorings is None or self._select_scorings[0] != rows:
            shares = plan.shares.values()
            self._select_scorings = (rows, sum(share.scorings(rows) for share in shares),
                                     sum(share.refinements(rows) for share in shares) if count else 0,
                                     rows * cache.sel_heads * len(plan.shares)
                                     if count and self.config.sharing.refine_steps else 0)
        if plan.kind == "select":
            scorings, refinements = self._select_scorings[1:3]
        else:
            scorings, refinements = 0, self._select_scorings[3]
        if not scorings and not refinements:
            return
        policy = cache.layers[self.sparse_layers[0]].policy
        units = policy.scored_units()
        self.counts.score_computations += scorings
        self.counts.refinements += refinements
        # a scoring scores every unit; with candidates, a policy that scores them alone picks the selecting
        # head's heavy among its C by scoring them again; with successors, ranking its top C (or heavy) scores
        # what `SelectionPolicy.successor_rescorings` says; a refinement scores C (or every unit).
        # refine_by "keys": a selecting head's C and each refinement's C are key rows (`scored_keys`) instead
        sharing = self.config.sharing
        by_keys = sharing.refine_by == "keys"
        if sharing.successors:
            again = policy.successor_rescorings(count or self.config.budget.heavy)
        else:
            again = count if policy.scores_candidates and not by_keys else 0
        scored = scorings * (units + again)
        if by_keys:
            self.counts.scored_keys += (scorings + refinements) * count
        else:
            scored += refinements * (count if policy.scores_candidates else units)
        if policy.unit == "pages":
            self.counts.scored_pages += scored
        else:
            self.counts.scored_tokens += scored

    # ---- storage changes ------------------------------------------------------------------
    def select_rows(self, cache: HShareCache, rows: torch.Tensor) -> None:
        """Batch rows were reordered / selected / repeated (beam search): a per-sample plan follows them."""
        if self.sharing is not None and self.sharing.per_sample:
            self._compile(self.sharing.select_rows(rows.to(self.sharing.layer_source.device)), cache.sel_heads)

    def cropped(self) -> None:
        """Columns were removed: selections may point past the end, the next sparse step selects."""
        self.last_selection = None

    # ---- counters -----------------------------------------------------------------------
    def stats(self) -> DecodeStats:
        """The generation's counters; the data-dependent ones are read from the device (one host sync)."""
        read, dense, sparse_steps = self.work.totals()
        return dataclasses.replace(self.counts, kv_rows_read=read, dense_kv_rows=dense, sparse_steps=sparse_steps)
