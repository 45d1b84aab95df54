"""``hshare bench attention``: the library's own decode step per (layer, step), against dense.

What is timed is the step a patched ``generate`` runs, not a model of it: an attention-only decoder
(`AttentionProbes`: L attention probes, no projections, norms or MLP) drives exactly the calls a
patched model makes. Before layer 0 of every forward the step planner plans it
(`hshare.step.StepPlanner.begin_forward`, what the decoder's pre-hook of `hshare.api` calls); each
probe stores its keys (``HShareCache.update``) and runs the registered attention function
(`hshare.attention.hshare_attention`); after the forward the planner ends it
(`hshare.step.StepPlanner.end_forward`, the model's forward hook). The prompt is random keys of the
benchmark shape; every decode step gives every layer a new random query, key and value (rows of
per-layer tables picked by the step's token ids, an embedding lookup).

Two decode paths, each in its own generation (`ProbeGeneration`):

* eager: each step's forward called directly (what ``cuda_graphs=False`` runs);
* static: the forward driven by the library's `hshare.static_decode.StaticDecoder` (buffers reserved
  and frozen after prefill, each step planned on the host, each step kind captured once and replayed
  as a CUDA graph by `hshare.graphs.StepGraphs`). On CUDA only in the benchmark; off CUDA the
  decoder runs the same static-shape step without graphs (the tests' check of that path).

A row is the median time of one whole sharing cycle (``query_group`` decode steps: one selection
step and its reuse steps) divided by the cycle's (layer, step) pairs: the per-step work (planning,
row windows, the token lookups) is shared by the harness's L layers. Presets run at N_c = n /
``budget_ratio`` (`HShareConfig.with_budget`), with the planner's own dense fallback. The baseline
is the ``dense`` preset through the same harness; SDPA on one layer's keys (every backend that runs,
the fastest quoted) is the outside reference. The row also gives the work counters of the timed eager
steps (``cache.stats``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig

from hshare import compat
from hshare.attention import hshare_attention
from hshare.bench.results import environment, speedup_panels, write
from hshare.bench.timing import dense_graph_us, dense_sdpa_us
from hshare.cache import HShareCache
from hshare.config import HShareConfig, resolve_config
from hshare.static_decode import StaticDecodeReport, StaticDecoder

MHA_SHAPES = [(b, 32, 32, n) for b in (8, 16) for n in (1024, 2048, 4096)]  # Llama-2-7B
GQA_SHAPES = [(b, 32, 8, n) for b in (16, 64) for n in (4096, 16384)]  # Llama-3-8B
SMOKE_ATTENTION_SHAPES = [(2, 4, 2, 256), (2, 4, 4, 128)]
DENSE_PRESET = "dense"
PRESETS = (DENSE_PRESET, "ds", "hshare-1_2-1_2-1_2", "hshare-3_4-3_4-1_2")
HARNESS_LAYERS = 8  # probes of the harness: each holds its own KV, so memory bounds them
DECODE_TOKENS = 64  # rows of the per-layer query / key / value tables decode steps draw from
TIMED_CYCLES = 10
PREFIX_BENCH_LAYERS = 4  # probes of the prefix benchmark's harness (its rows are large)


def probe_model_config(q_heads: int, kv_heads: int, head_dim: int, layers: int) -> LlamaConfig:
    """The transformers config of an attention-only decoder of this shape (what `HShareCache` and
    `hshare.heads.head_shard` read: layers, head counts)."""
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, hidden_size=q_heads * head_dim, vocab_size=DECODE_TOKENS)


class AttentionProbe(torch.nn.Module):
    """One layer's attention module as `hshare_attention` sees it, without projections.

    Attributes:
        config: the model's config (`hshare.heads.head_shard` reads its head counts).
        layer_idx, scaling: what the attention function reads of a transformers attention module.
        num_key_value_groups, is_causal: what transformers' SDPA (the prefill's attention) reads.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.scaling = config.head_dim ** -0.5
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.is_causal = True
        self.eval()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: HShareCache,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Store ``key, value [B, Hkv, t, d]`` and attend with ``query [B, Hq, T, d]``: ``[B, T, Hq, d]``."""
        keys, values = cache.update(key, value, self.layer_idx)
        out, _ = hshare_attention(self, query, keys, values, attention_mask, scaling=self.scaling, hshare_cache=cache)
        return out


class AttentionProbes(torch.nn.Module):
    """An attention-only decoder of L `AttentionProbe` layers, with a transformers causal LM's calling
    convention (what `StaticDecoder` drives): ``forward(input_ids [B, 1], position_ids, attention_mask,
    cache=...)``, its output's ``logits`` being every layer's attention output ``[B, 1, L, Hq, d]``.

    * Prefill (the first forward over an empty cache, as the planner decides): every layer stores its
      prompt's n random keys and values and attends with the prompt's last query (`prompt`). Only
      decode is timed; one query keeps the prefill's memory at the KV it stores (transformers' SDPA of
      several GQA queries under a mask would repeat every key per query head).
    * Decode: layer l's query, key and value are rows ``input_ids`` of ``decode_queries[l]``,
      ``decode_keys[l]`` and ``decode_values[l]`` (``[DECODE_TOKENS, H, d]`` each).

    Args:
        batch, q_heads, kv_heads, head_dim: B, Hq, Hkv, d; context: n, the prompt's columns.
        layers: L; seed: seed of every random tensor (`prompt` makes the same tensors on each call).
    """

    def __init__(self, batch: int, q_heads: int, kv_heads: int, context: int, head_dim: int, layers: int,
                 dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> None:
        super().__init__()
        self.config = probe_model_config(q_heads, kv_heads, head_dim, layers)
        self.batch, self.context = batch, context
        self.dtype, self.device, self.seed = dtype, torch.device(device), seed
        self.probes = torch.nn.ModuleList(AttentionProbe(self.config, i) for i in range(layers))
        generator = self._generator(layers)
        self.decode_queries = self._randn(generator, layers, DECODE_TOKENS, q_heads, head_dim)
        self.decode_keys = self._randn(generator, layers, DECODE_TOKENS, kv_heads, head_dim)
        self.decode_values = self._randn(generator, layers, DECODE_TOKENS, kv_heads, head_dim)

    @property
    def layers(self) -> int:
        return len(self.probes)

    def _generator(self, stream: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + stream)

    def _randn(self, generator: torch.Generator, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=self.device, dtype=self.dtype)

    def prompt(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s prompt: its last query ``[B, Hq, 1, d]``, its keys and values ``[B, Hkv, n, d]``
        (random, the same on every call)."""
        config = self.config
        generator = self._generator(layer)
        keys = self._randn(generator, self.batch, config.num_key_value_heads, self.context, config.head_dim)
        values = self._randn(generator, self.batch, config.num_key_value_heads, self.context, config.head_dim)
        query = self._randn(generator, self.batch, config.num_attention_heads, 1, config.head_dim)
        return query, keys, values

    def decode_inputs(self, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
        """`steps` decode steps' inputs after the prompt: random ``input_ids [B, 1]`` and their
        ``position_ids``, made on the device before any step runs."""
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(DECODE_TOKENS, (steps, self.batch, 1), generator=generator)
        return [{"input_ids": tokens[step].to(self.device),
                 "position_ids": torch.full((self.batch, 1), self.context + step, device=self.device)}
                for step in range(steps)]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = True, return_dict: bool = True,
                **kwargs):
        """One forward over the `HShareCache` passed as ``cache=`` (or ``past_key_values=``); `position_ids`,
        `use_cache` and `return_dict` are taken as a causal LM takes them (the static decoder passes them)
        and not read."""
        cache = compat.cache_from(kwargs)
        cache.planner.begin_forward(cache, input_ids.shape[1], attention_mask)  # the decoder's pre-hook (hshare.api)
        if cache.planner.forward == "prefill":
            layer_inputs = (self.prompt(layer) for layer in range(self.layers))  # made as each layer runs
        else:
            tokens = input_ids[:, 0]
            queries, keys, values = (table.index_select(1, tokens)[..., None, :] for table in
                                     (self.decode_queries, self.decode_keys, self.decode_values))  # [L, B, H, 1, d]
            layer_inputs = zip(queries, keys, values)
        outputs = [probe(*inputs, cache, attention_mask) for probe, inputs in zip(self.probes, layer_inputs)]
        return compat.causal_lm_output(torch.stack(outputs, 2), cache)


class ProbeGeneration:
    """One generation of `config` over `probes`, prefilled at construction, decoded as a patched
    ``generate`` decodes: each forward planned and ended by the cache's planner, and with `static`,
    through the library's `StaticDecoder` (static shapes; on CUDA each step kind replayed as a graph).

    Args:
        config: the preset; its ``compile_elementwise`` and ``fuse_projections`` are turned off (the probes
            have no norms, rotary embedding, MLP or q/k/v projections to fuse).
        steps: decode steps the generation reserves columns for (the buffers never grow).

    Attributes:
        cache: the generation's `HShareCache`.
        report: what the static decoder did (`StaticDecodeReport`; None when eager).
        kinds: the kind of every decode step run (`hshare.step.STEP_KINDS`).
    """

    def __init__(self, probes: AttentionProbes, config: HShareConfig, steps: int, static: bool) -> None:
        self.probes = probes
        self.cache = HShareCache(config.replace(compile_elementwise=False, fuse_projections=False), probes.config)
        self.cache.set_reserve(probes.context + steps)
        self.report = StaticDecodeReport() if static else None
        self.forward = StaticDecoder(probes, probes.forward, steps + 1, self.report) if static else probes.forward
        self.kinds: list[str] = []
        self._run(torch.zeros(probes.batch, 1, dtype=torch.long, device=probes.device), None)  # the prefill

    @property
    def replayed_steps(self) -> int:
        """Decode steps replayed as a CUDA graph so far (0 when eager)."""
        return 0 if self.report is None else self.report.graphed_steps

    def step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One decode step of `AttentionProbes.decode_inputs`: every layer's output ``[B, 1, L, Hq, d]``."""
        out = self._run(inputs["input_ids"], inputs["position_ids"])
        self.kinds.append(self.cache.planner.current.kind)
        return out

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        output = self.forward(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=True,
                              return_dict=True, **{compat.CACHE_KWARG: self.cache})
        self.cache.planner.end_forward(self.cache)  # the model's forward hook (hshare.api)
        return output.logits


@dataclass
class PresetTiming:
    """One preset's decode step over one harness, in microseconds per (layer, decode step).

    Attributes:
        step_us: eager decode, the median over the timed cycles.
        step_graph_us: static decode with every timed step replayed as a CUDA graph; None when not
            measured (`graph_note` says why).
        graph_note: why `step_graph_us` is None ("" when measured).
        kinds: the timed eager steps' kinds, counted.
        stats: what the timed eager steps added to the generation's counters (`DecodeStats` fields).
    """

    step_us: float
    step_graph_us: float | None
    graph_note: str
    kinds: dict[str, int]
    stats: dict[str, int]


def measure_preset(probes: AttentionProbes, config: HShareConfig, cycles: int = TIMED_CYCLES,
                   graphs: bool = True) -> PresetTiming:
    """Time `config`'s decode step over `probes`: one untimed sharing cycle (the plan is built, kernels
    compile, each step kind is captured), then `cycles` timed ones, eager and, with `graphs` on CUDA,
    through the static decoder. Each path decodes its own generation from the same prompt and the
    same step inputs."""
    group = config.sharing.query_group
    steps = (cycles + 1) * group
    schedule = probes.decode_inputs(steps)
    schedule = [schedule[start:start + group] for start in range(0, steps, group)]
    per_step = group * probes.layers  # (layer, step) pairs of a cycle

    eager = _timed_cycles(ProbeGeneration(probes, config, steps, static=False), schedule)
    graph_us, note = None, "off" if not graphs else "no CUDA"
    if graphs and probes.device.type == "cuda":
        generation = ProbeGeneration(probes, config, steps, static=True)
        static = _timed_cycles(generation, schedule)
        if static.replayed_steps == cycles * group:
            graph_us, note = statistics.median(static.cycle_us) / per_step, ""
        else:
            note = generation.report.reason or "not every timed step replayed a graph"
        del generation
        torch.cuda.empty_cache()
    return PresetTiming(statistics.median(eager.cycle_us) / per_step, graph_us, note, dict(Counter(eager.kinds)),
                        eager.counters)


@dataclass
class TimedCycles:
    """What `_timed_cycles` measured of one generation.

    Attributes:
        cycle_us: microseconds of each timed cycle.
        kinds: the timed steps' kinds.
        counters: what the timed steps added to ``cache.stats`` (`DecodeStats` fields).
        replayed_steps: timed steps the static decoder replayed as a CUDA graph.
    """

    cycle_us: list[float]
    kinds: list[str]
    counters: dict[str, int]
    replayed_steps: int


def _timed_cycles(generation: ProbeGeneration, schedule: list[list[dict]]) -> TimedCycles:
    """Run the cycle ``schedule[0]`` untimed, then time each later cycle of steps."""
    for inputs in schedule[0]:
        generation.step(inputs)
    before, warm, replayed = generation.cache.stats, len(generation.kinds), generation.replayed_steps
    device = generation.probes.device
    if device.type == "cuda":
        marks = []
        for cycle in schedule[1:]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for inputs in cycle:
                generation.step(inputs)
            end.record()
            marks.append((start, end))
        torch.cuda.synchronize(device)
        cycle_us = [start.elapsed_time(end) * 1e3 for start, end in marks]
    else:
        cycle_us = []
        for cycle in schedule[1:]:
            began = time.perf_counter()
            for inputs in cycle:
                generation.step(inputs)
            cycle_us.append((time.perf_counter() - began) * 1e6)
    after = generation.cache.stats
    counters = {field.name: getattr(after, field.name) - getattr(before, field.name)
                for field in dataclasses.fields(after)}
    return TimedCycles(cycle_us, generation.kinds[warm:], counters, generation.replayed_steps - replayed)


@dataclass
class AttentionRow:
    """One (shape, preset) of ``hshare bench attention``; times in microseconds per (layer, decode step).

    Attributes:
        shape: ``"B{batch} {Hq}/{Hkv} n{context} N_c{budget}"``; budget: N_c of the sparse presets.
        layers: the harness's probes (the per-step work is shared by them).
        kv_mib_per_layer: one layer's prompt keys and values.
        sdpa_us: decode SDPA over one layer's prompt, per backend that ran; fastest_sdpa: the fastest;
            sdpa_graph_us: the fastest replayed as a CUDA graph (None off CUDA).
        path: "dense" (the dense preset), "sparse", or "dense fallback" (a sparse preset whose every
            timed step the planner ran densely: `HShareConfig.runtime.dense_fallback_mib`).
        step_kinds: the timed eager steps' kinds, counted.
        step_us: eager; speedup: the dense preset's eager step over this one; speedup_sdpa: the fastest
            SDPA over this step.
        step_graph_us, speedup_graph, speedup_sdpa_graph: the same with static decode's CUDA graphs
            (against the dense preset's graphs and SDPA's graph); None where not measured (graph_note).
        kv_read_fraction: K/V rows read over what dense attention reads (``DecodeStats``), timed eager steps.
        stats: what the timed eager steps added to ``cache.stats``.
    """

    shape: str
    batch: int
    q_heads: int
    kv_heads: int
    context: int
    head_dim: int
    budget: int
    layers: int
    kv_mib_per_layer: float
    sdpa_us: dict
    fastest_sdpa: str
    sdpa_graph_us: float | None
    preset: str
    path: str
    step_kinds: dict
    step_us: float
    speedup: float
    speedup_sdpa: float
    step_graph_us: float | None
    speedup_graph: float | None
    speedup_sdpa_graph: float | None
    graph_note: str
    kv_read_fraction: float | None
    stats: dict


def preset_config(preset: str, budget: int, head_dim: int, layers: int) -> HShareConfig:
    """`preset` (options after ``+`` allowed) at N_c = `budget` (`HShareConfig.with_budget`; a dense preset as
    it is), checked against the harness's shape as ``hshare.patch`` checks a model's."""
    config = resolve_config(preset)
    if config.sparse:
        config = resolve_config(preset, budget=budget)  # options after '+' win over the budget's split
    config.validate_for_model(layers, head_dim)
    return config


def bench_attention(shapes, dtype=torch.float16, device="cuda", budget_ratio=8, layers=HARNESS_LAYERS,
                    presets=PRESETS, cycles=TIMED_CYCLES) -> list[AttentionRow]:
    """Every preset's decode step per (layer, step) at each shape ``(B, Hq, Hkv, n)`` (d 128 on CUDA,
    16 elsewhere; N_c = n / `budget_ratio`), against the dense preset and SDPA. The dense preset is
    measured (and listed first) whether or not `presets` names it."""
    device = torch.device(device)
    head_dim = 128 if device.type == "cuda" else 16
    presets = (DENSE_PRESET, *(preset for preset in presets if preset != DENSE_PRESET))
    rows = []
    for batch, q_heads, kv_heads, context in shapes:
        probes = AttentionProbes(batch, q_heads, kv_heads, context, head_dim, layers, dtype, device)
        query, key, value = probes.prompt(0)
        sdpa = dense_sdpa_us(query, key, value)
        fastest = min(sdpa, key=sdpa.get)
        sdpa_graph = dense_graph_us(query, key, value, fastest)
        kv_mib = key.numel() * key.element_size() * 2 / 2**20
        del query, key, value
        budget = context // budget_ratio
        timings = {preset: measure_preset(probes, preset_config(preset, budget, head_dim, layers), cycles)
                   for preset in presets}
        baseline = timings[DENSE_PRESET]
        for preset, timing in timings.items():
            read, dense_read = timing.stats["kv_rows_read"], timing.stats["dense_kv_rows"]
            rows.append(AttentionRow(
                shape=f"B{batch} {q_heads}/{kv_heads} n{context} N_c{budget}", batch=batch, q_heads=q_heads,
                kv_heads=kv_heads, context=context, head_dim=head_dim, budget=budget, layers=layers,
                kv_mib_per_layer=kv_mib, sdpa_us=sdpa, fastest_sdpa=fastest, sdpa_graph_us=sdpa_graph,
                preset=preset, path=_path(preset, timing.kinds), step_kinds=timing.kinds,
                step_us=timing.step_us, speedup=baseline.step_us / timing.step_us,
                speedup_sdpa=sdpa[fastest] / timing.step_us, step_graph_us=timing.step_graph_us,
                speedup_graph=_ratio(baseline.step_graph_us, timing.step_graph_us),
                speedup_sdpa_graph=_ratio(sdpa_graph, timing.step_graph_us),
                graph_note=timing.graph_note, kv_read_fraction=read / dense_read if dense_read else None,
                stats=timing.stats,
            ))
        del probes
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _path(preset: str, kinds: dict[str, int]) -> str:
    if preset == DENSE_PRESET:
        return "dense"
    return "dense fallback" if set(kinds) == {"dense"} else "sparse"


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def table_lines(rows: list[AttentionRow]) -> list[str]:
    """The printed table: a header, then one line per row ("-" where a value was not measured)."""
    lines = [f"{'shape':<28}{'KV MiB':>8}{'SDPA':>8} {'backend':<10}{'preset':<22}{'path':<16}{'eager':>9}"
             f"{'vs dense':>9}{'vs SDPA':>8}{'graph':>9}{'vs dense':>9}{'vs SDPA':>8}{'KV read':>8}"]
    for r in rows:
        lines.append(f"{r.shape:<28}{r.kv_mib_per_layer:>8.1f}{r.sdpa_us[r.fastest_sdpa]:>8.1f} {r.fastest_sdpa:<10}"
                     f"{r.preset:<22}{r.path:<16}{r.step_us:>9.1f}{r.speedup:>8.2f}x{r.speedup_sdpa:>7.2f}x"
                     f"{_cell(r.step_graph_us, 9, '.1f')}{_cell(r.speedup_graph, 8, '.2f', 'x')}"
                     f"{_cell(r.speedup_sdpa_graph, 7, '.2f', 'x')}{_cell(r.kv_read_fraction, 8, '.3f')}")
    return lines


def _cell(value: float | None, width: int, spec: str, suffix: str = "") -> str:
    text = "-" if value is None else f"{value:{spec}}{suffix}"
    return f"{text:>{width + len(suffix)}}"


def print_attention(rows: list[AttentionRow]) -> None:
    print("\n".join(table_lines(rows)))


def figure(results: dict):
    """Speed-up of each sparse preset's step against the dense preset's, grouped by shape, eager and
    CUDA graph."""
    rows = [r for r in results["attention"] if r["preset"] != DENSE_PRESET]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    width = 0.8 / max(1, len(presets))

    def draw(ax, suffix: str) -> None:
        for i, preset in enumerate(presets):
            values = [next(r[f"speedup{suffix}"] or 0 for r in rows if r["shape"] == s and r["preset"] == preset)
                      for s in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], values, width, label=preset)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=30, ha="right")
        ax.legend()

    return speedup_panels(results, "decode step per (layer, step) vs hshare's dense preset", draw)


def main_attention(out: Path, smoke: bool, layers: int = HARNESS_LAYERS, presets=PRESETS) -> dict:
    """``hshare bench attention``: the table printed, ``bench_attention.json`` (and its PNG) written to `out`.
    `smoke`: tiny shapes on the CPU, two timed cycles."""
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    shapes = SMOKE_ATTENTION_SHAPES if smoke else MHA_SHAPES + GQA_SHAPES
    dtype = torch.float16 if device == "cuda" else torch.float32
    rows = bench_attention(shapes, dtype=dtype, device=device, layers=layers, presets=presets,
                           cycles=2 if smoke else TIMED_CYCLES)
    print_attention(rows)
    results = {"env": environment(), "attention": [asdict(r) for r in rows]}
    write(results, out, "bench_attention")
    return results
