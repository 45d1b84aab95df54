"""Work counters of one generation: what the decode steps computed and read (`DecodeStats`).

Host integers where the work is known from the schedule and the plan (steps, scorings, scored
tokens / pages); device tensors where it is data (`WorkCounters`: K/V rows read, sparse steps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch


@dataclass
class DecodeStats:
    """Counters of one generation (what sharing saves is visible here), all exact integers.

    The attention-cost counters turn into cost ratios: ``kv_rows_read / dense_kv_rows`` is the
    share of dense attention's KV reads a config does, and ``scored_tokens`` (labels: x the label
    bytes per token) or ``scored_pages`` (Quest: x 2 x d key elements per page) the selection work.
    All count decode steps only (prefill, sparse or not, is not counted).

    Attributes:
        decode_steps: decode forward passes.
        sparse_steps: decode steps where at least one row attended sparsely (more valid keys
            than the budget N_c).
        dense_fallback_steps: decode steps run densely because the KV was too small for sparse
            attention to pay (`HShareConfig.runtime.dense_fallback_mib`).
        selection_steps: decode steps that (re)selected critical tokens (query groups).
        score_computations: (row, layer, selection head) scorings done (label or page scores) of every
            cached column.
        refinements: (row, layer, selection head) candidate-set refinements done (`SharingConfig.candidates`):
            scorings of a shared candidate set only.
        plans: sharing plans built (one per generate when layers or heads share).
        scored_tokens: tokens whose approximate score was computed (labels policy): summed over
            scorings, the label-cache length n of the layer at that step (every cached own column
            of the row is scored, left padding included), and over refinements the C candidates.
        scored_pages: the same for the Quest policy: summed over scorings, the page slots of the
            layer's page cache at that step.
        scored_keys: candidate key rows scored by their exact logit (``SharingConfig.refine_by =
            "keys"``): C per scoring (a selecting head ranks its candidates) and per refinement.
        kv_rows_read: K/V token rows read by decode attention, summed over (row, layer, KV-head
            reading): a dense step or layer reads each row's valid keys x Hkv; a sparse layer reads
            the valid (not -1) critical indices x the heads reading them (per-KV-head selection:
            Hkv readings of N_c; per-query-head selection: Hq readings); a shared-prefix level is
            read once per group that has rows (its valid tokens x Hkv, for all rows of the group).
        dense_kv_rows: what dense attention without a shared prefix reads at the same steps: every
            row's valid keys (prefix levels included) x Hkv x layers.

    ``sparse_steps`` and the two KV counters are data (they depend on the rows' valid keys): they
    are accumulated on the device (`WorkCounters`: no host sync in a decode step, so a step can be
    captured as a CUDA graph) and converted when ``cache.stats`` is read; the others are known
    on the host from the step schedule and the plan.
    """

    decode_steps: int = 0
    sparse_steps: int = 0
    dense_fallback_steps: int = 0
    selection_steps: int = 0
    score_computations: int = 0
    refinements: int = 0
    plans: int = 0
    scored_tokens: int = 0
    scored_pages: int = 0
    scored_keys: int = 0
    kv_rows_read: int = 0
    dense_kv_rows: int = 0


@dataclass
class WorkTotals:
    """Work counters of several generations (sums of `HShareCache.stats` fields: an `HShareLM`'s, a fidelity
    config's), and what their sharing plans share.

    Attributes:
        generate_calls: batches generated.
        counters: field name of `DecodeStats` -> sum over the batches.
        plan_totals: `SharingPlan.summary` name -> sum over the batches that made a plan (`planned`).
    """

    generate_calls: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    plan_totals: dict[str, float] = field(default_factory=dict)
    planned: int = 0

    def add(self, stats: Any, plan: dict[str, float] | None = None) -> None:
        """One batch's `HShareCache.stats` and, where it made one, its plan's summary
        (`StepPlanner.sharing_summary`)."""
        self.generate_calls += 1
        for name, value in dataclasses.asdict(stats).items():
            self.counters[name] = self.counters.get(name, 0) + int(value)
        if plan:
            self.planned += 1
            for name, value in plan.items():
                self.plan_totals[name] = self.plan_totals.get(name, 0.0) + float(value)

    def plan_mean(self) -> dict[str, float]:
        """The mean of the batches' plan summaries (empty: no batch made a plan)."""
        return {name: total / self.planned for name, total in self.plan_totals.items()}

    def as_dict(self) -> dict[str, int]:
        return {"generate_calls": self.generate_calls, **self.counters}

    @classmethod
    def summed(cls, parts: Iterable["WorkTotals"]) -> "WorkTotals":
        """The sum of several totals (e.g. one per data-parallel rank): counters and plan summaries."""
        total = cls()
        for part in parts:
            total.generate_calls += part.generate_calls
            total.planned += part.planned
            for name, value in part.counters.items():
                total.counters[name] = total.counters.get(name, 0) + value
            for name, value in part.plan_totals.items():
                total.plan_totals[name] = total.plan_totals.get(name, 0.0) + value
        return total


_KV_ROWS_READ, _DENSE_KV_ROWS, _SPARSE_STEPS = 0, 1, 2  # slots of the WorkCounters tensors


class WorkCounters:
    """The device side of `DecodeStats`: K/V rows read and sparse steps, without host syncs.

    Each decode step adds, once, what dense attention reads (``begin_step``: the rows' valid keys,
    a device scalar, x Hkv x layers), what the prefix levels cost, and whether any row is longer
    than the budget. A dense step (every layer reads every valid own key) adds its reads there too,
    in one kernel; in a sparse step each layer adds what it read: every valid own key
    (`add_dense_layer`) or the valid entries of its critical indices (`rows_read`). One int64 ``[3]`` tensor per device,
    updated in place (a captured step updates it on every replay); `totals` syncs once.
    """

    def __init__(self) -> None:
        self.kv_heads = 0  # this step: Hkv, the KV heads a dense reading reads each valid key from
        self.work: dict[torch.device, torch.Tensor] = {}
        self.own_keys: torch.Tensor | None = None  # this step: valid own keys of all rows (device scalar)

    def on(self, device: torch.device) -> torch.Tensor:
        """The ``[3]`` int64 counters on `device` (made at the first use; static decode makes them
        before any capture: made inside one, the graph would zero them at every replay)."""
        work = self.work.get(device)
        if work is None:
            work = self.work[device] = torch.zeros(3, dtype=torch.int64, device=device)
        return work

    def begin_step(self, own_keys: torch.Tensor, layers: int, kv_heads: int,
                   prefix_tokens: tuple[torch.Tensor, torch.Tensor] | None,
                   sparse_rows: torch.Tensor | None = None) -> None:
        """A decode step starts.

        Args:
            own_keys: valid own keys summed over the rows (int64 device scalar).
            layers: the model's layers (each one attends once per step).
            kv_heads: Hkv, the KV heads a dense reading reads each valid key from.
            prefix_tokens: None, or the prefix levels' ``(valid tokens summed over the groups that
                have rows, valid tokens summed over the rows' groups)`` (device scalars).
            sparse_rows: ``[B]`` bool, rows attended sparsely at this step (None = a dense step: its
                reads are counted here, and its layers add nothing).
        """
        self.own_keys, self.kv_heads = own_keys, kv_heads
        work = self.on(own_keys.device)
        work[_DENSE_KV_ROWS].add_(own_keys, alpha=layers * self.kv_heads)
        if sparse_rows is None:
            work[_KV_ROWS_READ].add_(own_keys, alpha=layers * self.kv_heads)
        if prefix_tokens is not None:
            work[_KV_ROWS_READ].add_(prefix_tokens[0].to(work.device), alpha=layers * self.kv_heads)
            work[_DENSE_KV_ROWS].add_(prefix_tokens[1].to(work.device), alpha=layers * self.kv_heads)
        if sparse_rows is not None:
            work[_SPARSE_STEPS].add_(sparse_rows.any())

    def add_dense_layer(self) -> None:
        """A dense layer of a sparse step read every valid own key of every row, from every KV head."""
        self.on(self.own_keys.device)[_KV_ROWS_READ].add_(self.own_keys, alpha=self.kv_heads)

    def rows_read(self, device: torch.device) -> torch.Tensor:
        """``[1]`` view of the K/V-rows-read counter on `device`: a sparse layer's critical indices
        add their valid entries to it as they are built (`hshare.kernels.critical_indices`)."""
        return self.on(device)[_KV_ROWS_READ:_KV_ROWS_READ + 1]

    def totals(self) -> tuple[int, int, int]:
        """``(kv_rows_read, dense_kv_rows, sparse_steps)`` as ints (a host sync)."""
        sums = [0, 0, 0]
        for work in self.work.values():
            sums = [a + b for a, b in zip(sums, work.tolist())]
        return sums[0], sums[1], sums[2]
