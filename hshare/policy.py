"""Selection policies: what metadata a sparse layer keeps, and how it scores tokens for a query.

A policy is that small (as TensorRT-LLM's sparse-attention "prediction module + auxiliary memory
pool", or kvpress's ``ScorerPress.score()``): everything else is shared by all policies and lives
elsewhere: the sink / local windows and the middle-window top-k (`hshare.selection`), the planner's
evidence and plan (`hshare.planner`, `hshare.attention`), head / layer / query sharing, padding,
critical indices and gather attention (`hshare.kernels`), sparse prefill (`hshare.sparse_prefill`).

`SelectionPolicy` owns the storage mechanics once: a policy declares its metadata buffers (token
buffers, one slot per cached column, or buffers of slots that each cover several columns, such as
Quest's pages) and its per-row tensors, and the base class grows, freezes, thaws, reorders, crops
and measures them. A policy implements only what is its own: how metadata is made from new keys
(`SelectionPolicy.add_keys`, and `SelectionPolicy.write` for static shapes), how it scores
(`decode_scores`, `score_query` / `prefill_scores`), how it is made at a layer's first prefill
(`from_prefill`), what one scoring counts (`unit`) and its options: its section of the config
(`config_class`, a `hshare.config.PolicyConfig` of its own, which validates and describes them).

Policies register by name (`register_policy`); ``HShareConfig.policy.name`` names one and `new_policy`
looks it up. Each lives in one module: `hshare.labels` (``"labels"``), `hshare.quest`
(``"quest"``), `hshare.loki` (``"loki"``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from hshare.buffer import GrowingBuffer
from hshare.config import ConfigError, HShareConfig, PolicyConfig
from hshare.kernels import NO_TOKEN, CriticalWindows, in_window, select_heavy, with_critical, with_successors
from hshare.kernels.selection_heads import columns_into, kv_heads_read, pick_heads, refine_into, walk_into

if TYPE_CHECKING:
    from hshare.heads import HeadShard

SCORED_UNITS = ("tokens", "pages")  # the `hshare.counters.DecodeStats` counters scored_tokens, scored_pages


class SelectionPolicy(ABC):
    """One sparse layer's selection metadata and scorer.

    Shapes: B rows, Hq query heads, Hkv KV heads, H_sel selection heads (Hkv or Hq, the config's
    ``selection``; selection head s reads KV head ``s * Hkv // H_sel`` and stands for the query heads
    ``[s * Hq // H_sel, (s + 1) * Hq // H_sel)``), n cached columns, d head dim. Scores are only ever
    *ranked* (top-k over the middle window): any key whose order is the policy's preference will do.

    What a subclass declares (class attributes):
        name: the registered name (set by `register_policy`).
        unit: what one (row, layer, head) scoring scores, one of `SCORED_UNITS` (the
            `hshare.counters.DecodeStats` counter ``scored_tokens`` or ``scored_pages``).
        config_class: the policy's section of the config, a `hshare.config.PolicyConfig` subclass of its
            own (``config.policy`` is an instance; `register_policy` gives it the policy's name).
        column_buffers: names of its `GrowingBuffer` attributes of ``[B, H, n, ...]`` metadata, one
            slot per cached column. The base class makes them (reserved at the reserve), and
            `buffers` hands them to the cache, which advances their lengths at static steps.
        tokens_last_buffers: those of its column buffers stored tokens last in memory
            (`GrowingBuffer` ``tokens_last``: a kernel reading one channel of many columns reads coalesced).
        slot_buffers: names of its `GrowingBuffer` attributes whose slots each cover several
            columns (Quest's pages); `slots` maps a column count to their slot count.
        row_tensors: names of ``[B, ...]`` tensor attributes, one entry per row (None until set),
            reordered with the rows.
        row_or_shared_tensors: names of ``[P, ...]`` tensor attributes, P = B (one entry per row,
            reordered with the rows) or 1 (shared by all rows, kept).

    What the base class keeps: ``sel_heads`` (H_sel), ``kv_heads`` (Hkv), `length` (columns the
    metadata covers) and ``frozen_width`` (the reserved columns while static shapes are on, else
    None). `supports_static` is True exactly when the subclass implements `write`, `scores_candidates`
    exactly when it implements `candidate_scores` (then a refinement scores C units, else every one).

    What a subclass may override to go faster, keeping the contract: `decode_heavy` (score and select a
    selection step's heavy columns in one pass: the labels' fused top-k, Quest's selection from page
    scores; into the `out` buffer it is given where that fits) and `candidate_heavy` (the same over a
    refinement's candidates).
    """

    name: ClassVar[str] = ""
    unit: ClassVar[str] = "tokens"
    config_class: ClassVar[type[PolicyConfig]] = PolicyConfig
    column_buffers: ClassVar[tuple[str, ...]] = ()
    tokens_last_buffers: ClassVar[tuple[str, ...]] = ()
    slot_buffers: ClassVar[tuple[str, ...]] = ()
    row_tensors: ClassVar[tuple[str, ...]] = ()
    row_or_shared_tensors: ClassVar[tuple[str, ...]] = ()
    supports_static: ClassVar[bool] = False
    scores_candidates: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.supports_static = cls.write is not SelectionPolicy.write
        cls.scores_candidates = cls.candidate_scores is not SelectionPolicy.candidate_scores
        if not set(cls.tokens_last_buffers) <= set(cls.column_buffers):
            raise TypeError(f"{cls.__name__} declares tokens_last_buffers {cls.tokens_last_buffers} that are not among "
                            f"its column_buffers {cls.column_buffers}; accepted: a subset of column_buffers")
        if cls.slot_buffers and cls.slots is SelectionPolicy.slots:
            raise TypeError(f"{cls.__name__} declares slot_buffers {cls.slot_buffers} but no slots(columns); "
                            "accepted: a slots() override mapping columns to slots, or column_buffers only")

    def __init__(self, sel_heads: int, kv_heads: int, reserve: int = 0) -> None:
        """Args:
            reserve: columns to allocate at the first allocation (the generation's final length)."""
        self.sel_heads = sel_heads
        self.kv_heads = kv_heads
        self.frozen_width: int | None = None
        self._length = 0
        for name in self.column_buffers:
            setattr(self, name, GrowingBuffer(reserve, tokens_last=name in self.tokens_last_buffers))
        for name in self.slot_buffers:
            setattr(self, name, GrowingBuffer(self.slots(reserve)))

    # ---- what a policy implements ---------------------------------------------------------
    @classmethod
    @abstractmethod
    def from_prefill(cls, config: HShareConfig, model_state: Any, layer: int,
                     query: torch.Tensor, new_keys: torch.Tensor, new_valid: torch.Tensor, kv_heads: int,
                     reserve: int) -> SelectionPolicy:
        """An empty policy for one sparse layer, made at its first prefill (`new_policy`'s arguments)."""

    @classmethod
    def model_state(cls, config: HShareConfig, model_config) -> Any:
        """What the policy knows of the model before any prompt, resolved once when the model is patched
        (labels: a heavy-channel calibration), or None. The cache holds it opaquely and hands it to
        `from_prefill`."""
        return None

    @classmethod
    def state_for_heads(cls, state: Any, heads: HeadShard) -> Any:
        """`state` for the heads one process attends with (`hshare.heads.HeadShard`: a tensor-parallel
        rank's slice); the default keeps it as it is."""
        return state

    @abstractmethod
    def add_keys(self, new_keys: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Make and store the metadata of new keys ``[B, Hkv, t, d]``, t >= 1, at columns
        ``[length, length + t)``; `valid` ``[B, t]`` marks real tokens (None = all). Called by `append`,
        which then counts the columns."""

    @abstractmethod
    def score_query(self, query: torch.Tensor) -> torch.Tensor:
        """What `prefill_scores` reads of W query rows ``[B, Hq, W, d]``: the queries themselves, or
        less (labels: their heavy channels). The planner's evidence keeps this across a prefill
        forward, so the smaller it is, the less the prefill's peak memory holds."""

    @abstractmethod
    def prefill_scores(self, query: torch.Tensor) -> torch.Tensor:
        """Token scores ``[B, H_sel, W, n]`` for W query rows given as `score_query` made them (the
        planner's evidence, sparse prefill)."""

    @abstractmethod
    def decode_scores(self, query: torch.Tensor, rows: torch.Tensor | None = None,
                      heads: torch.Tensor | None = None) -> torch.Tensor:
        """Token scores ``[B', H', n]`` for the decode query ``[B, Hq, d]`` of rows ``[B']`` (None =
        all) and selection heads ``[B' or 1, H']`` (None = all H_sel): only those are computed."""

    def decode_heavy(self, query: torch.Tensor, selectable: torch.Tensor, heavy: int, rows: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The heavy columns ``[B', H', heavy]`` of a selection step: the `heavy` best `decode_scores` of the
        selectable window ``[B', n]`` (bool) of rows ``[B']`` (None = all) and selection heads ``[B' or 1, H']``
        (None = all), ``NO_TOKEN`` where the window is short (`kernels.select_heavy`'s contract: the set is
        the contract, not the order); written into `out` where it fits them (`selection_heads.column_buffer`: a
        layer's kept buffer), else a new tensor. A policy that can score and select in one pass overrides it."""
        return columns_into(select_heavy(self.decode_scores(query, rows, heads), selectable[:, None], heavy), out)

    def decode_heavy_successors(self, query: torch.Tensor, selectable: torch.Tensor, heavy: int,
                                rows: torch.Tensor | None = None, heads: torch.Tensor | None = None, top: int = 0,
                                head_slot: torch.Tensor | None = None,
                                out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_heavy` with successors (`SharingConfig.successors`): ``(taken, best)``, ``[B', H', heavy]`` the
        `heavy` best columns walked in rank order, each taken with the column after it, until `heavy` are
        taken, and ``[B', H', top]`` the best `top` of them, both ascending (`kernels.with_successors`).
        With `head_slot` ``[P, H_sel]`` (each selection head's slot among the source heads `heads`): every
        selection head's ``[B', H_sel, ...]``, each its source's (`per_head`); written into `out` ``(taken, best)``
        where its tensors fit (`selection_heads.walk_into`). Ranking them scores them again (`candidate_scores`:
        `heavy` units) where the policy scores candidates alone; otherwise one score tensor serves both. A policy
        whose kernels write every head's entries overrides it."""
        if self.scores_candidates:
            best = self.decode_heavy(query, selectable, heavy, rows, heads)
            taken, best = with_successors(best, self.candidate_scores(query, best, rows, heads), selectable, top)
        else:
            scores = self.decode_scores(query, rows, heads)
            best = select_heavy(scores, selectable[:, None], heavy)
            taken, best = with_successors(best, scores.gather(-1, best.clamp(min=0)), selectable, top)
        return walk_into(taken, best, head_slot, out)

    def successor_rescorings(self, walked: int) -> int:
        """Units that `decode_heavy_successors` scores again a (row, head) to rank its `walked` top columns: all of
        them where the policy scores candidates alone (its selection keeps no scores), else none. A policy whose
        selection hands its scores to the walk overrides it."""
        return walked if self.scores_candidates else 0

    def candidate_scores(self, query: torch.Tensor, columns: torch.Tensor, rows: torch.Tensor | None = None,
                         heads: torch.Tensor | None = None) -> torch.Tensor:
        """Scores ``[B', H', C]`` of candidate columns ``[B', H', C]`` (negative entries: any value, the caller
        masks them) for the decode query ``[B, Hq, d]`` of rows ``[B']`` (None = all) and selection heads
        ``[B' or 1, H']`` (None = all H_sel): candidate-set refinement (`SharingConfig.candidates`). Ranked as
        `decode_scores` ranks the same columns. The default scores every column and gathers the candidates
        (correct, not cheaper: the counters then count every unit); a policy that reads only the
        candidates' metadata overrides it (`scores_candidates`)."""
        return self.decode_scores(query, rows, heads).gather(-1, columns.clamp(min=0))

    def candidate_heavy(self, query: torch.Tensor, candidates: torch.Tensor, window: torch.Tensor, heavy: int,
                        rows: torch.Tensor | None = None, heads: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, critical: CriticalWindows | None = None
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The heavy columns ``[B', H', heavy]`` of a refinement: the `heavy` best candidates ``[B', H', C]``
        (valid columns, a selection's; negative entries: none) that lie in the row's window, given by its column
        bounds ``[B', 2]`` (``[start, end)``, `RowWindows.middle_bounds`; `kernels.in_window`), by this query's own
        `candidate_scores`, for the decode query ``[B, Hq, d]`` of rows ``[B']`` (None = all) and selection
        heads ``[B' or 1, H']`` (None = all); ``NO_TOKEN`` where fewer are allowed. The set is the contract.
        With `out` ``[B', H_sel, heavy]`` (and `heads`), `candidates` are every selection head's
        ``[B', H_sel, C]``: the heads refine their own and write their rows of `out` in place (returned).
        With `critical` (the step's windows, where every row and selection head refines):
        ``(columns, critical.indices(columns))``, the decode's critical indices too.
        A policy that scores and selects candidates in one pass overrides it."""
        def refine(own: torch.Tensor) -> torch.Tensor:
            allowed = in_window(own, window)
            return top_candidates(self.candidate_scores(query, own, rows, heads), own, allowed, heavy)

        return with_critical(refine(candidates) if out is None else refine_into(out, candidates, heads, refine),
                             critical)

    def write(self, column: torch.Tensor, keys: torch.Tensor) -> None:
        """Static shapes: the metadata of the key at the column held in the ``[1]`` int64 device
        tensor `column`, read from the layer's whole key buffer `keys` ``[B, Hkv, n, d]`` and written
        in place, with no host value involved (a captured step writes where the replayed step is).
        Policies that implement it support static-shape decode (`supports_static`)."""
        raise NotImplementedError(f"the {self.name!r} selection policy has no static-shape write; "
                                  "static decode needs a policy with supports_static")

    def slots(self, columns: int) -> int:
        """Slots of the `slot_buffers` that hold the metadata of `columns` columns (a policy with
        slot buffers implements it)."""
        raise NotImplementedError(f"{type(self).__name__} has no slot buffers")

    # ---- storage mechanics, owned here --------------------------------------------------------
    @property
    def length(self) -> int:
        """Cached columns the metadata covers (static shapes: every reserved column, which the
        scores cover)."""
        return self._length if self.frozen_width is None else self.frozen_width

    @property
    def buffers(self) -> tuple[GrowingBuffer, ...]:
        """The column buffers (one slot per cached column): the cache advances their lengths at
        static steps and counts their reserved bytes."""
        return tuple(getattr(self, name) for name in self.column_buffers)

    def _all_buffers(self) -> list[tuple[GrowingBuffer, Callable[[int], int], str]]:
        """Every metadata buffer with its map from columns to slots and the name of its slots."""
        return ([(getattr(self, name), _columns, "columns") for name in self.column_buffers]
                + [(getattr(self, name), self.slots, "slots") for name in self.slot_buffers])

    def append(self, new_keys: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add the metadata of new keys ``[B, Hkv, t, d]`` (columns ``[length, length + t)``, written
        in place: `add_keys`); `valid` ``[B, t]`` marks real tokens (None = all)."""
        tokens = new_keys.shape[2]
        if tokens:
            self.add_keys(new_keys, valid)
        self._length += tokens

    def scored_units(self) -> int:
        """Units (`unit`) one (row, head) decode scoring computes now: every slot of the first
        metadata buffer (padding included; static shapes: every reserved slot)."""
        buffers = self._all_buffers()
        if not buffers:
            raise NotImplementedError(f"{type(self).__name__} declares no metadata buffers; accepted: "
                                      "column_buffers or slot_buffers, or a scored_units() override")
        view = buffers[0][0].view()
        return 0 if view is None else view.shape[2]

    def nbytes(self) -> int:
        """Bytes of the metadata buffers' stored slots (not of spare capacity, nor of the per-row
        tensors)."""
        return sum(buffer.nbytes() for buffer, _, _ in self._all_buffers())

    def freeze(self, width: int) -> None:
        """Static shapes from now on: the metadata of `width` own columns per row (the reserve) is
        exposed whole and written in place (`write`); the scores cover every reserved column."""
        for buffer, slots, kind in self._all_buffers():
            if buffer.storage is not None and buffer.capacity < slots(width):
                raise RuntimeError(f"{self.name} reserved for {buffer.capacity} {kind}, static decode needs "
                                   f"{slots(width)}")
        for buffer, _, _ in self._all_buffers():
            buffer.freeze()
        self.frozen_width = width

    def thaw(self, length: int) -> None:
        """Back to growing metadata after static steps wrote the columns up to `length`."""
        for buffer, slots, _ in self._all_buffers():
            buffer.thaw()
            if buffer.storage is not None:
                buffer.length = slots(length)
        self.frozen_width = None
        self._length = length

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows (beam search, ``batch_select_indices``)."""
        for buffer, _, _ in self._all_buffers():
            buffer.select_rows(rows)
        self.map_row_state(lambda name, tensor: tensor.index_select(0, rows.to(tensor.device))
                           if name in self.row_tensors or tensor.shape[0] > 1 else tensor)

    def map_row_state(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Replace each row tensor that is set (`row_tensors`, `row_or_shared_tensors`) by ``fn(name, tensor)``."""
        for name in self.row_tensors + self.row_or_shared_tensors:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(name, tensor))

    def crop(self, length: int) -> None:
        """Keep the metadata of the first `length` columns (slot buffers: the slots they reach)."""
        self._length = max(0, min(self._length, length))
        for buffer, slots, _ in self._all_buffers():
            buffer.crop(slots(self._length))

    # ---- helpers for scorers --------------------------------------------------------------
    @staticmethod
    def selection_heads(config: HShareConfig, query: torch.Tensor, kv_heads: int) -> int:
        """H_sel for prefill queries ``[B, Hq, T, d]``: Hkv (``selection="kv_head"``) or Hq."""
        return kv_heads if config.planner.selection == "kv_head" else query.shape[1]

    @staticmethod
    def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
        """What scores are summed in: float64 for float64 inputs, else float32."""
        return torch.float64 if dtype == torch.float64 else torch.float32

    def group_query_heads(self, query: torch.Tensor) -> torch.Tensor:
        """Queries ``[B, Hq, Q, d]`` by selection head: ``[B, H_sel, Hq // H_sel, Q, d]`` (a view)."""
        batch, q_heads, steps, dim = query.shape
        return query.reshape(batch, self.sel_heads, q_heads // self.sel_heads, steps, dim)

    def pick_selection_heads(self, tensor: torch.Tensor, rows: torch.Tensor | None = None,
                             heads: torch.Tensor | None = None) -> torch.Tensor:
        """A per-selection-head tensor ``[B, H_sel, ...]`` at rows ``[B']`` (None = all) and heads
        ``[B' or 1, H']`` (None = all): ``[B', H', ...]`` (`kernels.selection_heads.pick_heads`)."""
        return pick_heads(tensor, rows, heads)

    def per_selection_head(self, tensor: torch.Tensor, rows: torch.Tensor | None = None,
                           heads: torch.Tensor | None = None) -> torch.Tensor:
        """A per-KV-head tensor ``[B, Hkv, ...]`` as the selection heads read it, at rows ``[B']``
        (None = all) and heads ``[B' or 1, H']`` (None = all H_sel): ``[B', H', ...]``
        (`kernels.selection_heads.kv_heads_read`)."""
        return kv_heads_read(tensor, self.sel_heads, rows, heads)


def top_candidates(scores: torch.Tensor, candidates: torch.Tensor, allowed: torch.Tensor, heavy: int) -> torch.Tensor:
    """The columns ``[..., heavy]`` of the `heavy` best-scored allowed candidates (scores, candidates, allowed:
    ``[..., C]``), ``NO_TOKEN`` where fewer are allowed (`kernels.select_heavy` over candidate positions)."""
    position = select_heavy(scores, allowed, heavy)
    return torch.where(position >= 0, candidates.gather(-1, position.clamp(min=0)), torch.full_like(position, NO_TOKEN))


def _columns(columns: int) -> int:
    """The slots of a column buffer: one per column."""
    return columns


_REGISTRY: dict[str, type[SelectionPolicy]] = {}


def register_policy(name: str) -> Callable[[type[SelectionPolicy]], type[SelectionPolicy]]:
    """Class decorator: the `SelectionPolicy` subclass is the policy ``HShareConfig.policy.name = name``, and
    its `SelectionPolicy.config_class` that policy's section of the config."""
    def register(cls: type[SelectionPolicy]) -> type[SelectionPolicy]:
        if not (isinstance(cls, type) and issubclass(cls, SelectionPolicy)):
            raise TypeError(f"register_policy({name!r}) decorates {cls!r}; accepted: a SelectionPolicy subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"selection policy {name!r} is registered twice: {_REGISTRY[name].__qualname__} and "
                             f"{cls.__qualname__}; accepted: one class per name")
        if cls.unit not in SCORED_UNITS:
            raise ValueError(f"{cls.__qualname__}.unit = {cls.unit!r}; accepted: {', '.join(map(repr, SCORED_UNITS))}")
        options = cls.config_class
        if options is PolicyConfig or options.name not in ("", name):
            raise TypeError(f"{cls.__qualname__}.config_class = {options.__qualname__}; accepted: a PolicyConfig "
                            "subclass of the policy's own")
        cls.name = options.name = name
        _REGISTRY[name] = cls
        return cls
    return register


def policy_names() -> tuple[str, ...]:
    """The registered policies' names, in registration order."""
    return tuple(_REGISTRY)


def policy_class(name: str) -> type[SelectionPolicy]:
    """The policy registered as `name`; `ConfigError` naming the registered ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown selection policy {name!r}; accepted: "
                          f"{', '.join(map(repr, policy_names()))}") from None


def new_policy(config: HShareConfig, model_state: Any, layer: int, query: torch.Tensor,
               new_keys: torch.Tensor, new_valid: torch.Tensor, kv_heads: int, reserve: int = 0) -> SelectionPolicy:
    """An empty policy of ``config.policy.name`` for one sparse layer, made at its first prefill
    (`SelectionPolicy.from_prefill`).

    Args:
        model_state: the policy's `SelectionPolicy.model_state` (labels: a calibration, or None: chosen per row).
        reserve: columns to allocate at once (the generation's final length).
        query: ``[B, Hq, T, d]`` the prefill queries; new_keys: ``[B, Hkv, T, d]`` their keys;
            new_valid: ``[B, T]`` validity of those keys (what a policy made from the prompt reads).
    """
    return policy_class(config.policy.name).from_prefill(config, model_state, layer, query, new_keys, new_valid,
                                                    kv_heads, reserve)


# Each module registers its policy when imported (after the base class above is defined).
from hshare import labels, loki, quest  # noqa: E402,F401
