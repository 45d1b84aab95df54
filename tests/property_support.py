"""Support of the property tests (`tests/test_properties.py`): hypothesis profiles, tiny models,
prompt batches (padding patterns, shared-prefix structures), brute-force oracles written
independently of the library, in-situ invariant checks, and the expected work counters.

Profiles (registered and loaded on import, before any ``@settings`` is built):

* ``ci``: derandomized (the same examples on every run), the default and what ``CI=true`` gets;
* ``local``: about ten times the examples, random (``HYPOTHESIS_PROFILE=local``).

Each property asks `examples(name)` for its count under the active profile: the expensive
model-level properties get few examples, the cheap function-level ones many.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass, field
from unittest import mock

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hshare import compat

NO_TOKEN = -1
VOCAB = 160
PAD = 0

# ---- profiles -----------------------------------------------------------------------------------
# examples per property: (ci, local). ci sums to >= 200 and runs in well under 3 minutes on 2 cores.
EXAMPLES = {
    "windows": (150, 1500),
    "gather_twin": (60, 600),
    "labels": (40, 400),
    "prefix_detection": (50, 500),
    "triton_gather": (10, 60),
    "triton_critical": (10, 60),
    "triton_labels": (6, 40),
    "triton_candidates": (6, 40),
    "model_exact": (60, 400),
    "model_invariants": (100, 600),
    "model_rows_alone": (20, 150),
    "model_static_shapes": (20, 300),
}

_COMMON = dict(
    deadline=None,
    database=None,  # no .hypothesis/ folder in the work tree; a failure prints its reproduction blob
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("local", derandomize=False, **_COMMON)


def active_profile() -> str:
    """``HYPOTHESIS_PROFILE`` if set (``local`` or ``ci``), else ``ci`` (also under ``CI=true``)."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if name not in ("ci", "local"):
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r} is unknown; accepted: ci, local")
    return name


PROFILE = active_profile()
settings.load_profile(PROFILE)


def examples(name: str) -> int:
    ci, local = EXAMPLES[name]
    return local if PROFILE == "local" else ci


def total_examples(profile: str) -> int:
    return sum(counts[0 if profile == "ci" else 1] for counts in EXAMPLES.values())


# ---- tiny models --------------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "llama" or "mistral"
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    window: int | None = None  # Mistral's sliding window

    @property
    def gqa(self) -> int:
        return self.q_heads // self.kv_heads


@functools.lru_cache(maxsize=48)
def build_model(spec: ModelSpec):
    """A tiny random model: hidden size 32 whatever the head dim (q/k/v projections map 32 to
    heads x head_dim), so head dims 32..128 and GQA up to 8 stay cheap. Kept unpatched at rest."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(1000 + spec.layers * 7 + spec.q_heads * 3 + spec.head_dim)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.q_heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                  max_position_embeddings=1024, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    if spec.arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = MistralForCausalLM(MistralConfig(sliding_window=spec.window, **common))
    return model.to(DTYPES[spec.dtype]).eval()


@st.composite
def model_specs(draw, dtypes=("float32", "float64", "bfloat16"), archs=("llama", "mistral")) -> ModelSpec:
    gqa = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = 1 if gqa == 8 else draw(st.sampled_from([1, 2]))
    arch = draw(st.sampled_from(archs))
    window = draw(st.one_of(st.none(), st.integers(6, 30))) if arch == "mistral" else None
    return ModelSpec(arch=arch, layers=draw(st.integers(1, 4)), q_heads=gqa * kv_heads, kv_heads=kv_heads,
                     head_dim=draw(st.sampled_from([32, 64, 128])), dtype=draw(st.sampled_from(dtypes)),
                     window=window)


# ---- configs ------------------------------------------------------------------------------------
def preset_config(name: str):
    from hshare import HShareConfig

    return HShareConfig.from_preset(name)


@st.composite
def config_overrides(draw, preset: str, spec: ModelSpec, budget: int | None = None) -> dict:
    """Small-budget overrides of a preset (N_c = `budget` if given), plus the knobs a user may turn:
    selection granularity, plan scope, query group, look-ahead, label bits and channels, Quest page
    size, dense layers."""
    base = preset_config(preset)
    if not base.sparse:
        return {}
    streaming = base.budget.heavy == 0
    keys = base.sharing.refine_by == "keys"  # ranks candidates: a heavy budget, one selection a KV head
    if budget is None:
        sink = draw(st.integers(0, 4))
        local = draw(st.integers(1, 6))
        heavy = 0 if streaming else draw(st.integers(1 if keys else 0, 10))
    else:
        sink = draw(st.integers(0, min(4, budget - 1)))
        if streaming:
            local, heavy = budget - sink, 0
        else:
            local = draw(st.integers(1, budget - sink - (1 if keys and budget - sink > 1 else 0)))
            heavy = budget - sink - local
    out = dict(sink=sink, local=local, heavy=heavy,
               selection="kv_head" if keys else draw(st.sampled_from(["kv_head", "query_head"])),
               # a scoring budget counts the copies of one plan for the batch
               plan_scope="batch" if base.planner.scorings else draw(st.sampled_from(["batch", "sample"])))
    if keys and heavy == 0:  # a budget of sink and one local token: no candidates to rank
        out["refine_by"] = "labels"
    if draw(st.booleans()):  # query groups other than the preset's
        out["query_sharing"] = draw(st.sampled_from(["1", "1/2", "1/3"]))
    out["group_lookahead"] = draw(st.booleans())
    if base.policy.name == "quest":
        out["page_size"] = draw(st.sampled_from([1, 2, 4, 8]))
    elif base.policy.name == "loki":
        out["loki_rank"] = draw(st.sampled_from([None, 1, spec.head_dim // 2]))
    else:
        out["label_bits"] = draw(st.sampled_from([4, 8, 16]))
        out["label_channels"] = draw(st.sampled_from([c for c in (2, 8, 16, 32) if c <= spec.head_dim]))
    if spec.layers > 1 and draw(st.integers(0, 3)) == 0:
        out["dense_layers"] = (draw(st.integers(0, spec.layers - 1)),)
    return out


def sources_for(ratio: float, count: int) -> int:
    """Selecting nodes for a sharing ratio (the paper's round(ratio x count), at least one)."""
    if count == 0:
        return 0
    return max(1, min(count, int(math.floor(ratio * count + 0.5))))


# ---- prompt batches -----------------------------------------------------------------------------
STRUCTURES = ("none", "one", "two", "whole", "two")  # "two" twice: it needs the most luck to come out


@dataclass(frozen=True)
class Batch:
    """Unpadded prompts, how they are padded, and the shared-prefix structure they were built with."""

    prompts: tuple[tuple[int, ...], ...]
    structure: str
    extra_pad: int = 0  # all-pad columns on the left of every row
    gaps: tuple[tuple[int, int] | None, ...] = ()  # per row: (after how many tokens, pad columns)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for row, prompt in enumerate(self.prompts):
            ids, mask = list(prompt), [1] * len(prompt)
            gap = self.gaps[row] if self.gaps else None
            if gap is not None:
                at, size = gap
                ids[at:at] = [PAD] * size
                mask[at:at] = [0] * size
            rows.append((ids, mask))
        width = max(len(ids) for ids, _ in rows) + self.extra_pad
        input_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(rows):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = torch.tensor(mask)
        return input_ids, attention_mask


def _random_tokens(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(11, 120, (max(n, 0),), generator=generator).tolist()  # markers live outside 11..119


@st.composite
def batches(draw, own_lengths: st.SearchStrategy, structures=STRUCTURES, max_batch: int = 6,
            paddings=("left", "left_extra", "gap")) -> Batch:
    """A batch of 1..`max_batch` prompts whose *own* parts (after any shared prefix) have lengths
    drawn from `own_lengths`, with a shared-prefix structure and a padding pattern.

    Structures: ``none`` (rows differ at their first token), ``one`` (a common prefix), ``two``
    (a common prefix and groups of rows sharing a further extension), ``whole`` (identical rows).
    Paddings: ``left`` (to the longest row), ``left_extra`` (plus all-pad columns), ``gap`` (pad
    columns inside some rows' prompts: key columns that are not tokens)."""
    structure = draw(st.sampled_from(structures))
    batch = draw(st.integers(2 if structure in ("two", "whole") else 1, max_batch))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**20)))
    marker = lambda row: [3 + row]  # rows differ right after what they share
    if structure == "whole":
        prompt = tuple(_random_tokens(generator, draw(own_lengths)))
        prompts = [prompt] * batch
    else:
        common = _random_tokens(generator, draw(st.integers(2, 24))) if structure in ("one", "two") else []
        if structure == "two" and draw(st.integers(0, 3)) == 0:
            common = []  # groups without a level-1 prefix
        group_of = [None] * batch
        extensions = {}
        if structure == "two" and batch >= 2:
            groups = draw(st.integers(1, batch // 2))
            group_of = [0, 0] + [draw(st.one_of(st.none(), st.integers(0, groups - 1))) for _ in range(batch - 2)]
            group_of = draw(st.permutations(group_of))  # group 0 has >= 2 rows, anywhere in the batch
            for group in range(groups):
                extensions[group] = [120 + group] + _random_tokens(generator, draw(st.integers(1, 9)))
        prompts = []
        for row in range(batch):
            own = draw(own_lengths)
            ext = extensions.get(group_of[row], []) if group_of[row] is not None else []
            prompts.append(tuple(common + ext + (marker(row) + _random_tokens(generator, own - 1))[:own]))
    padding = draw(st.sampled_from(paddings))
    extra = draw(st.integers(1, 3)) if padding == "left_extra" else 0
    gaps = ()
    if padding == "gap":
        gaps = tuple(
            (draw(st.integers(1, len(p) - 1)), draw(st.integers(1, 3))) if len(p) >= 2 and draw(st.booleans())
            else None
            for p in prompts
        )
    return Batch(prompts=tuple(tuple(p) for p in prompts), structure=structure, extra_pad=extra, gaps=gaps)


def length_classes(budget: int, long_extra: int = 30) -> st.SearchStrategy:
    """Prompt (own part) lengths around the budget N_c: 1, N_c - 1, N_c, N_c + 1, and long."""
    return st.one_of(
        st.sampled_from(sorted({1, max(1, budget - 1), max(1, budget), budget + 1})),
        st.integers(budget + 2, budget + long_extra),
    )


# ---- brute-force shared-prefix detection (independent of hshare.prefix) ------------------------
@dataclass
class ExpectedPrefix:
    """What `generate` with ``prefix="on"`` must store: level widths, per-row own lengths, and the
    prefix tokens one layer reads per KV head at each decode step (each group once)."""

    common: int
    widths: list[int]
    own: list[int]
    read_tokens: int
    groups: list[tuple[list[int], int]] = field(default_factory=list)

    @property
    def own_width(self) -> int:
        return max(self.own)


def brute_force_prefix(prompts, levels: int, generate_rule: bool = True) -> ExpectedPrefix | None:
    """Longest common prefix of all rows (each keeps >= 1 own token); level 2: rows with >= 2
    remaining tokens that start alike form a group, sharing their longest common extension (each
    again keeping >= 1 own token). None when nothing is shared, or (`generate_rule`: what
    ``generate`` does) when a prompt has a single token."""
    prompts = [list(p) for p in prompts]
    if generate_rule and min(len(p) for p in prompts) < 2:
        return None
    cap = min(len(p) for p in prompts) - 1
    common = 0
    while common < cap and all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    groups = []
    if levels >= 2 and len(prompts) >= 2:
        by_first: dict[int, list[int]] = {}
        for row, p in enumerate(prompts):
            if len(p) - common >= 2:
                by_first.setdefault(p[common], []).append(row)
        for rows in by_first.values():
            if len(rows) < 2:
                continue
            cap2 = min(len(prompts[r]) for r in rows) - 1 - common
            ext = 0
            while ext < cap2 and all(prompts[r][common + ext] == prompts[rows[0]][common + ext] for r in rows):
                ext += 1
            groups.append((sorted(rows), ext))
    if common == 0 and not groups:
        return None
    widths = ([common] if common else []) + ([max(e for _, e in groups)] if groups else [])
    extension = {row: e for rows, e in groups for row in rows}
    own = [len(p) - common - extension.get(row, 0) for row, p in enumerate(prompts)]
    return ExpectedPrefix(common=common, widths=widths, own=own, read_tokens=common + sum(e for _, e in groups),
                          groups=groups)


def stored_prefix(batch: "Batch", config, window: int | None, new_tokens: int) -> ExpectedPrefix | None:
    """The prefix ``generate`` holds once for `batch` under `config`: `brute_force_prefix` with
    ``prefix="on"``, and none where a sliding window could drop a key during the generation (the batch
    laid out ``[level 1 | level 2 | gap | own]``, or as padded with its gaps, plus the new tokens exceeds it:
    a window counts columns)."""
    if config.prefix.mode != "on":
        return None
    expected = brute_force_prefix(batch.prompts, config.prefix.levels)
    if expected is None or window is None:
        return expected
    width = max(sum(expected.widths) + expected.own_width, batch.tensors()[0].shape[1])
    return expected if width + new_tokens <= window else None


# ---- brute-force selection (pure Python, per row) -----------------------------------------------
def brute_windows(valid_row: list[bool], sink: int, local: int, budget: int, lookahead: int = 0) -> dict:
    """One row's windows from its valid columns, by rank: sink = first `sink`, local = last `local`
    (not repeating sink ranks), middle = everything between, selectable = middle widened by
    ``min(lookahead, local - 1)`` ranks, dense = first `budget`; short = at most `budget` valid."""
    cols = [c for c, ok in enumerate(valid_row) if ok]
    n = len(cols)
    local_ranks = list(range(n - local, n))
    widen = min(lookahead, local - 1) if lookahead > 0 else 0
    return dict(
        cols=cols,
        n_valid=n,
        short=n <= budget,
        sink=[cols[r] if r < n else NO_TOKEN for r in range(sink)],
        local=[cols[r] if 0 <= r < n and r >= sink else NO_TOKEN for r in local_ranks],
        dense=[cols[r] if r < n else NO_TOKEN for r in range(budget)],
        middle=set(cols[sink:max(sink, n - local)]),
        selectable=set(cols[sink:max(sink, n - local + widen)]),
    )


def brute_critical(window: dict, heavy_row: list[int]) -> set[int]:
    """The critical set of one (row, head): every valid column of a short row; else sink, the heavy
    columns still in the middle window, and local."""
    if window["short"]:
        return set(window["cols"])
    heavy = {c for c in heavy_row if c >= 0 and c in window["middle"]}
    return {c for c in window["sink"] if c >= 0} | heavy | {c for c in window["local"] if c >= 0}


def brute_top_k(scores_row: list[float], selectable: set[int], k: int) -> list[int]:
    """Top-k selectable columns by score (ties: the earlier column)."""
    ranked = sorted(selectable, key=lambda c: (-scores_row[c], c))
    return ranked[:k]


# ---- in-situ checks during generate --------------------------------------------------------------
def _max(counts: torch.Tensor) -> int:
    return int(counts.max()) if counts.numel() else 0


def check_critical_indices(valid: torch.Tensor, heavy: torch.Tensor, out: torch.Tensor, sink: int, local: int,
                           budget: int) -> None:
    """Vectorized form of `brute_critical` for every (row, head) of one step, plus the invariants:
    only valid columns of the row, no duplicates, exactly N_c slots (-1 = none)."""
    batch, heads, _ = heavy.shape
    n = valid.shape[1]
    assert out.shape == (batch, heads, budget), f"critical indices {tuple(out.shape)}, expected N_c = {budget} slots"
    out = out.long()
    assert bool(((out >= NO_TOKEN) & (out < n)).all()), "a critical index is out of range"
    rank = valid.long().cumsum(-1) - 1
    n_valid = valid.sum(-1, keepdim=True)
    short = (n_valid <= budget)[:, :, None]  # [B, 1, 1]
    middle = valid & (rank >= sink) & (rank < n_valid - local)
    sink_part = valid & (rank < sink)
    local_part = valid & (rank >= n_valid - local) & (rank >= sink)
    heavy_part = torch.zeros(batch, heads, n + 1, dtype=torch.bool)
    heavy_part.scatter_(-1, torch.where(heavy >= 0, heavy.long(), torch.full_like(heavy.long(), n)), True)
    heavy_part = heavy_part[..., :n] & middle[:, None]
    expected = torch.where(short, valid[:, None].expand(-1, heads, -1),
                           sink_part[:, None] | local_part[:, None] | heavy_part)
    picked = out >= 0
    got = torch.zeros(batch, heads, n + 1, dtype=torch.long)
    got.scatter_add_(-1, torch.where(picked, out, torch.full_like(out, n)), picked.long())
    got = got[..., :n]
    assert _max(got) <= 1, "a column is selected twice"
    assert bool((got.bool() <= valid[:, None]).all()), \
        "an invalid column (padding, gap, outside the window) is selected"
    assert torch.equal(got.bool(), expected), "critical set differs from sink + (heavy in middle) + local"


def check_top_k(scores: torch.Tensor, middle: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """`select_heavy` contract, tie-robust: min(k, |middle|) distinct middle columns, none scored
    below an unselected middle column; -1 pads the rest; no NaN scores in the middle."""
    middle = middle.expand_as(scores)
    n = scores.shape[-1]
    assert out.shape == (*scores.shape[:-1], k)
    assert not bool(torch.isnan(scores[middle]).any()), "NaN selection score in the middle window"
    picked = out >= 0
    chosen = torch.zeros(*scores.shape[:-1], n + 1, dtype=torch.long)
    chosen.scatter_add_(-1, torch.where(picked, out.long(), torch.full_like(out.long(), n)), picked.long())
    chosen = chosen[..., :n]
    assert _max(chosen) <= 1, "a heavy column is selected twice"
    chosen = chosen.bool()
    assert bool((chosen <= middle).all()), "a heavy column outside the selectable window"
    assert torch.equal(picked.sum(-1), middle.sum(-1).clamp(max=k)), "heavy count != min(heavy, |window|)"
    inf = torch.tensor(float("inf"), dtype=scores.dtype)
    lowest_chosen = torch.where(chosen, scores, inf).amin(-1)
    best_left = torch.where(middle & ~chosen, scores, -inf).amax(-1)
    assert bool((lowest_chosen >= best_left).all()), "a better-scored middle column was left out"


def check_successor_walk(columns: torch.Tensor, scores: torch.Tensor, window: torch.Tensor,
                         out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`with_successors` contract, walked one column at a time: in rank order (score descending, the smaller
    column first among ties), each column unless taken, then its successor in the window unless taken, until
    k are taken; the taken columns ascending, NO_TOKEN after them; and the best ``top`` (the second output's
    width) given columns by that rank order, ascending, NO_TOKEN after them."""
    n, k = window.shape[-1], columns.shape[-1]
    out, best = out
    top = best.shape[-1]
    for b in range(columns.shape[0]):
        for h in range(columns.shape[1]):
            given = sorted((-float(s), int(c)) for c, s in zip(columns[b, h], scores[b, h].float()) if c >= 0)
            leading = sorted(c for _, c in given[:top])
            assert best[b, h].tolist() == leading + [-1] * (top - len(leading)), "best columns differ"
            taken: list[int] = []
            for _, c in given:
                for column in (c, c + 1):
                    inside = column == c or (column < n and bool(window[b, column]))
                    if len(taken) < k and inside and column not in taken:
                        taken.append(column)
            assert out[b, h].tolist() == sorted(taken) + [-1] * (k - len(taken)), \
                "successor walk differs from brute force"


class SelectionSpy:
    """Checks every step's critical indices (`RowWindows.critical_windows`' indices, made apart or by a refinement)
    and every call of a selection's `select_heavy` (a policy's
    `decode_heavy` on CPU, candidate sets and refinements) while active (each against the vectorized
    brute force), and the key validity the step was given against `expected_valid(kv_len)` when
    provided."""

    def __init__(self, sink: int, local: int, budget: int, heavy: int, expected_valid=None, candidates: int = 0,
                 successors: bool = False) -> None:
        self.sink, self.local, self.budget, self.heavy = sink, local, budget, heavy
        picked = candidates or heavy  # what a selecting head ranks: its candidates, else its heavy columns
        self.top_k_sizes = {heavy, picked}  # heavy columns (picked among candidates too), what a selection ranks
        self.successors = successors
        self.walk_calls = 0
        self.expected_valid = expected_valid
        self.critical_calls = 0
        self.select_calls = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "SelectionSpy":
        import hshare.policy as policy
        import hshare.refine as refine
        from hshare.selection import RowWindows

        from hshare.kernels import CriticalWindows

        original_critical_windows = RowWindows.critical_windows
        original_build = RowWindows.build.__func__
        original_select = policy.select_heavy
        spy = self

        def build(cls, valid, *args, **kwargs):
            """The step's windows, whose key validity the refinements' window masks are made of."""
            spy.valid = valid
            return original_build(cls, valid, *args, **kwargs)

        def critical_windows(windows, count=None):
            """The step's critical windows, whose indices (built apart or by a refinement) are checked against the
            brute force over the step's key validity."""
            class Checked(CriticalWindows):
                def indices(self, heavy):
                    out = CriticalWindows.indices(self, heavy)
                    spy.critical_calls += 1
                    if spy.expected_valid is not None:
                        want = spy.expected_valid(windows.valid.shape[1])
                        assert torch.equal(windows.valid.cpu(), want), "decode step read the wrong key validity"
                    check_critical_indices(windows.valid.cpu(), heavy.cpu(), out.cpu(), spy.sink, spy.local,
                                           spy.budget)
                    return out
            return Checked(*original_critical_windows(windows, count))

        def select(scores, middle, heavy):
            out = original_select(scores, middle, heavy)
            spy.select_calls += 1
            assert heavy in spy.top_k_sizes
            check_top_k(scores.cpu(), middle.cpu(), heavy, out.cpu())
            return out

        def checked_decode_heavy(original):
            def decode_heavy(self, query, selectable, heavy, rows=None, heads=None, out=None):
                chosen = original(self, query, selectable, heavy, rows, heads, out)
                spy.select_calls += 1
                assert heavy in spy.top_k_sizes
                assert out is None or chosen is out or chosen.shape != out.shape, "a kept buffer that fits, not used"
                check_top_k(self.decode_scores(query, rows, heads).cpu(), selectable[:, None].cpu(), heavy,
                            chosen.cpu())
                return chosen
            return decode_heavy

        def checked_candidate_heavy(original):
            def candidate_heavy(self, query, candidates, window, heavy, rows=None, heads=None, out=None,
                                critical=None):
                refined = original(self, query, candidates, window, heavy, rows, heads, out=out, critical=critical)
                spy.select_calls += 1
                assert heavy == spy.heavy
                result = refined if critical is None else refined[0]  # with the step's windows: and its indices
                chosen = result
                if out is not None:  # in place: the heads' own entries of every head's candidates and of `out`
                    index = heads.expand(candidates.shape[0], -1)[..., None]
                    candidates = candidates.gather(1, index.expand(-1, -1, candidates.shape[-1]))
                    chosen = result.gather(1, index.expand(-1, -1, result.shape[-1]))
                # the window's mask: the step's valid columns within the window's bounds; a candidate is a valid
                # column (a selection picked it), so it is allowed where it lies in that mask
                valid = (spy.valid if rows is None else spy.valid[rows]).cpu()
                n = valid.shape[-1]
                column = torch.arange(n)
                window = valid & (column >= window[:, :1].cpu()) & (column < window[:, 1:].cpu())
                given = candidates.cpu()
                assert bool(valid[:, None].expand(-1, given.shape[1], -1).gather(-1, given.clamp(min=0))[given >= 0]
                            .all()), "a candidate is no valid column"
                # the candidates' own scores laid on their columns (column n: where a slot holds no candidate)
                slots = torch.where(candidates >= 0, candidates, torch.full_like(candidates, n))
                scores = self.candidate_scores(query, candidates, rows, heads).cpu().double()
                laid = torch.full((*candidates.shape[:2], n + 1), float("-inf"), dtype=torch.float64)
                laid.scatter_(-1, slots.cpu(), scores)
                allowed = torch.zeros(*candidates.shape[:2], n + 1, dtype=torch.bool).scatter_(
                    -1, slots.cpu(), torch.ones_like(slots, dtype=torch.bool).cpu())[..., :n] & window[:, None].cpu()
                check_top_k(laid[..., :n], allowed, heavy, chosen.cpu())
                return refined
            return candidate_heavy

        original_walk = policy.with_successors

        def walk(columns, scores, window, top=0):
            out = original_walk(columns, scores, window, top)
            assert spy.successors, "successors walked without SharingConfig.successors"
            spy.walk_calls += 1
            check_successor_walk(columns.cpu(), scores.cpu(), window.cpu(), (out[0].cpu(), out[1].cpu()))
            return out

        import hshare.labels as labels
        from hshare.kernels import decode_label_scores, decode_label_topk
        from hshare.kernels.selection_heads import per_head, pick_heads

        original_selection_walk = labels.decode_label_topk_walk

        def selection_walk(query, channels, codes, scale, zero, bits, count, selectable, rows=None, heads=None, *,
                           top=0, head_slot=None, out=(None, None)):
            every_head = original_selection_walk(query, channels, codes, scale, zero, bits, count, selectable, rows,
                                                 heads, top=top, head_slot=head_slot, out=out)
            out = every_head
            if head_slot is not None:  # every selection head's entries: its source's (a source head is its own)
                out = tuple(pick_heads(tensor, heads=heads) for tensor in every_head)
                for tensor, source in zip(every_head, out):
                    assert torch.equal(tensor, per_head(source, head_slot)), "a head's entry is not its source's"
            assert spy.successors, "successors walked without SharingConfig.successors"
            spy.walk_calls += 1
            spy.select_calls += 1
            # the walk of the top C columns by label scores: the top C checked on every column's scores, their walk
            # against the brute-force walk
            columns = decode_label_topk(query, channels, codes, scale, zero, bits, count, None, selectable, rows,
                                        heads)
            scores = decode_label_scores(query, channels, codes, scale, zero, bits, rows, heads).cpu().double()
            check_top_k(scores, selectable[:, None].expand(-1, scores.shape[1], -1).cpu(), count, columns.cpu())
            check_successor_walk(columns.cpu(), scores.gather(-1, columns.clamp(min=0).cpu()), selectable.cpu(),
                                 (out[0].cpu(), out[1].cpu()))
            return every_head

        self._stack.enter_context(mock.patch.object(policy, "with_successors", walk))
        self._stack.enter_context(mock.patch.object(labels, "decode_label_topk_walk", selection_walk))
        self._stack.enter_context(mock.patch.object(RowWindows, "critical_windows", critical_windows))
        self._stack.enter_context(mock.patch.object(RowWindows, "build", classmethod(build)))
        self._stack.enter_context(mock.patch.object(policy, "select_heavy", select))
        self._stack.enter_context(mock.patch.object(refine, "select_heavy", select))  # candidates, refinements
        for cls in {policy.SelectionPolicy, *(policy.policy_class(name) for name in policy.policy_names())}:
            for name, wrap in (("decode_heavy", checked_decode_heavy), ("candidate_heavy", checked_candidate_heavy)):
                if name in cls.__dict__:  # each policy's own selection, checked against its own scores
                    self._stack.enter_context(mock.patch.object(cls, name, wrap(cls.__dict__[name])))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


# ---- generation and comparison ------------------------------------------------------------------
def generate(model, ids, mask, new_tokens: int, cache=None):
    """Greedy, exactly `new_tokens` tokens, raw logits kept. The pad token is never generated: its
    embedding is zero (``padding_idx``), so feeding it gives a zero query whose label scores all tie,
    and the heavy top-k among exact ties is the order `topk` happens to return (not a property)."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True,
                         **{compat.CACHE_KWARG: cache}, suppress_tokens=[PAD])
    return out.sequences, torch.stack(out.logits, 1)


def assert_same_generation(ref_seq, ref_logits, seq, logits, width: int, atol: float) -> None:
    """Greedy outputs equal up to rounding: logits within `atol` at every step, tokens identical,
    except that a row may take the other side of a near tie (the reference's logits of both tokens
    within 2 x atol); that row is compared no further."""
    assert seq.shape == ref_seq.shape
    assert torch.equal(seq[:, :width], ref_seq[:, :width]), "the prompt part of the sequences changed"
    for row in range(ref_seq.shape[0]):
        for step in range(ref_logits.shape[1]):
            torch.testing.assert_close(logits[row, step].double(), ref_logits[row, step].double(), rtol=0, atol=atol,
                                       msg=lambda m: f"row {row}, step {step}: {m}")
            a, b = int(ref_seq[row, width + step]), int(seq[row, width + step])
            if a != b:
                gap = abs(float(ref_logits[row, step, a]) - float(ref_logits[row, step, b]))
                assert gap <= 2 * atol, f"row {row}, step {step}: token {b} instead of {a} (logit gap {gap:.3g})"
                break


# ---- expected work counters ---------------------------------------------------------------------
@dataclass
class ExpectedStats:
    decode_steps: int
    sparse_steps: int
    dense_fallback_steps: int
    selection_steps: int
    score_computations: int
    refinements: int
    plans: int
    scored_tokens: int
    scored_pages: int
    scored_keys: int
    kv_rows_read: int
    dense_kv_rows: int
    kv_rows_read_exact: bool  # False: kv_rows_read is an upper bound (see `expected_stats`)


def pages_for(length: int, page_size: int) -> int:
    """Page slots of a row-anchored paging of `length` columns (a row's first page may start up to
    page_size - 1 columns before column 0)."""
    return 0 if length <= 0 else (length + page_size - 2) // page_size + 1


def expected_stats(config, spec: ModelSpec, batch: int, steps: int, own_valid, full_valid, own_width: int,
                   prefix: ExpectedPrefix | None, window_clips: bool) -> ExpectedStats:
    """The counters one ``generate`` must report, from the schedule and the row lengths alone.

    Args:
        own_valid(s), full_valid(s): per row, valid own keys (the part the budget applies to) and
            all valid keys (prefix included) at decode step s = 1..steps.
        own_width: cached own columns at prefill (padding included): the label / page length is
            own_width + s at step s.
        window_clips: a sliding window dropped keys of some row during decode.

    Per step and layer: a dense layer reads Hkv x the valid own keys of each row; a sparse layer
    reads, when every row fits N_c and there is no shared prefix, the same (exact SDPA), otherwise
    H_sel x min(n_b, N_c) per row (a short row all its keys, a long one N_c). That is exact when
    every selection is full at every step of its query group; with a look-ahead, a group of 3 or
    more steps, or a window sliding inside a group, a heavy column may leave the middle window
    before the next selection, and the value is an upper bound. A successor walk fills every heavy slot
    (`kernels.with_successors`). Shared-prefix levels add Hkv x
    their tokens (each group once) per layer.
    """
    layers, kv_heads = spec.layers, spec.kv_heads
    sel = kv_heads if config.planner.selection == "kv_head" else spec.q_heads
    budget = config.budget.total
    sparse_layers = [i for i in range(layers) if i not in set(config.sharing.dense_layers)] if config.sparse else []
    n_sparse, n_dense = len(sparse_layers), layers - len(sparse_layers)
    group = config.sharing.query_group
    source_layers = sources_for(config.sharing.layer, n_sparse)
    source_heads = sources_for(config.sharing.head, sel)
    candidates = config.candidate_count  # C, 0 without refinement
    counts = dict(decode_steps=steps, sparse_steps=0, dense_fallback_steps=0, selection_steps=0,
                  score_computations=0, refinements=0, plans=0, scored_tokens=0, scored_pages=0, scored_keys=0,
                  kv_rows_read=0, dense_kv_rows=0)
    by_keys = config.sharing.refine_by == "keys"
    for s in range(1, steps + 1):
        own, full = own_valid(s), full_valid(s)
        counts["dense_kv_rows"] += layers * kv_heads * sum(full)
        counts["kv_rows_read"] += layers * kv_heads * (prefix.read_tokens if prefix else 0)
        counts["kv_rows_read"] += n_dense * kv_heads * sum(own)
        if not n_sparse:
            continue
        all_short = max(own) <= budget
        counts["sparse_steps"] += int(not all_short)
        if prefix is None and all_short:
            counts["kv_rows_read"] += n_sparse * kv_heads * sum(own)
        else:
            counts["kv_rows_read"] += n_sparse * sel * sum(min(n, budget) for n in own)
        if config.budget.heavy == 0:
            continue
        selecting = (s - 1) % group == 0
        scorings = batch * source_layers * source_heads if selecting else 0
        # refinements: at a selection step every copying head of a source layer and every head of a copying
        # layer; at a reuse step every head of every sparse layer
        refinements = 0 if not candidates else batch * (
            source_layers * (sel - source_heads) + (n_sparse - source_layers) * sel if selecting else n_sparse * sel)
        counts["selection_steps"] += int(selecting)
        counts["score_computations"] += scorings
        counts["refinements"] += refinements
        if config.policy.name == "quest":  # refinements score every page (no candidate-only scores)
            counts["scored_pages"] += (scorings + refinements) * pages_for(own_width + s, config.policy.page_size)
        elif by_keys:  # every head's C candidates ranked by their keys (with successors the walk takes the labels'
            # scores of the selection)
            counts["scored_tokens"] += scorings * (own_width + s)
            counts["scored_keys"] += (scorings + refinements) * candidates
        else:  # a scoring scores every column, then (with candidates) its C candidates again; with successors the
            # label policy's walk takes the selection's own scores of its top C or heavy (none scored again)
            again = 0 if config.sharing.successors and config.policy.name == "labels" else candidates
            counts["scored_tokens"] += scorings * (own_width + s + again) + refinements * candidates
    if n_sparse and steps and config.sharing.shares_layers_or_heads:
        counts["plans"] = 1
    exact = group == 1 or (group == 2 and not config.sharing.lookahead and not window_clips)
    return ExpectedStats(**counts, kv_rows_read_exact=exact)


def assert_stats(stats, expected: ExpectedStats) -> None:
    for name in ("decode_steps", "sparse_steps", "dense_fallback_steps", "selection_steps", "score_computations",
                 "refinements", "plans", "scored_tokens", "scored_pages", "scored_keys", "dense_kv_rows"):
        assert getattr(stats, name) == getattr(expected, name), \
            f"stats.{name} = {getattr(stats, name)}, expected {getattr(expected, name)}"
    if expected.kv_rows_read_exact:
        assert stats.kv_rows_read == expected.kv_rows_read, \
            f"stats.kv_rows_read = {stats.kv_rows_read}, expected {expected.kv_rows_read}"
    else:
        assert (stats.kv_rows_read > 0 or expected.kv_rows_read == 0) and stats.kv_rows_read <= expected.kv_rows_read, \
            f"stats.kv_rows_read = {stats.kv_rows_read}, expected at most {expected.kv_rows_read}"
