"""``hshare bench generate``: end-to-end ``generate`` of random-weight models of real shapes.

Paths, on the same prompts:

* ``unpatched``: transformers' default (DynamicCache, SDPA, eager);
* ``static``: transformers' ``cache_implementation="static"``, which ``generate`` compiles
  (``torch.compile``, CUDA graphs): the strongest stock path and the baseline of every speed claim. On
  one CUDA device it runs in a process of its own, before the other paths build their model (its
  compiled graphs keep a memory pool that would stay allocated under them); elsewhere it runs last;
* patched presets (``dense``, ``ds@512``, ``hshare-1_2-1_2-1_2@512``, ...): hshare's static-shape
  decode replayed as CUDA graphs (`hshare.static_decode`). A path may add `HShareConfig` overrides
  after ``+``: ``hshare-1_2-1_2-1_2@1024+dense_fallback_mib=0`` (`hshare.config.split_overrides`).

Per path (`measure_path`), timed one of two ways (``timing``):

* ``"pairs"``: `repeats` timed pairs of a 1-token and an N-token generate after a first N-token call;
  decode tok/s = rows x (N - 1) / (t(N) - t(1)) of the median pair (every pair's in
  ``decode_tok_s_runs``), prefill = the 1-token generate, warm-up = the first N-token call minus a later
  one (compilation or capture);
* ``"steps"``: `repeats` N-token generates, each timed at every new token (`StepClock`); decode tok/s =
  rows x (N - k) / (t(token N) - t(token k)) with k - 1 = `warm_decode_steps` (N) first decode steps left
  out (capture, compilation), prefill = the time to the first token, warm-up = what those first steps took
  beyond the steady rate. A third of the prefills of ``"pairs"``: the long-context rows and the grid.

and for each: peak GPU memory of an N-token call (reset between calls; and of the prefill), KV bytes
held, token agreement with the first exact path that ran (``unpatched``, else ``static``) (share of new
tokens equal at the same position), for patched paths what static decode did (graph replays, capture
and eager warm-up time, or why not), and the roofline column (`hshare.bench.roofline`): the bytes a
decode step must read at the timed steps' mean context, the bandwidth of a device copy measured in the
same run, the floor rate rows / (bytes / bandwidth) and the share of it reached. Models are built with
random weights (nothing is loaded). Rows print as they come and are written as JSON (and a PNG where
matplotlib is installed: each path's decode tok/s relative to ``static``, peak memory and KV beside it).

Prompts (`make_prompts`): random tokens; with padding, one row in four of a batch of several rows is
left-padded by up to an eighth of the prompt (a batch of one row is never padded). A padded row makes
transformers build the 4-D bool mask ``[B, 1, n, n]`` and SDPA a float copy of it in every layer (both
quadratic in the prompt), which unpadded prompts do not.

Several shapes of one model in one process (`bench_cells`, used by `hshare.bench.grid`): the model is
built once for the longest prompt, and a shape whose estimated peak memory
(`roofline.estimated_peak_bytes`) exceeds the device's free memory is skipped with what it needs.

Several GPUs (`hshare.bench.multi_gpu`): ``--tp N`` under torchrun (transformers' tensor parallelism,
the model built sharded on the GPUs; every rank measures its own GPU, rank 0 prints and writes) or
``--device-map`` (accelerate's dispatch in one process; sparse presets are refused by the library and
the row records the refusal). There ``peak_gib`` is the largest of the per-GPU peaks
(``peak_gib_per_gpu``, in rank or device order), ``kv_gib`` the KV of all GPUs together, and no roofline
is computed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import multiprocessing
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hshare import compat, patches
from hshare.bench import multi_gpu, roofline
from hshare.bench.multi_gpu import Placement
from hshare.bench.results import environment, write
from hshare.bench.timing import copy_bandwidth
from hshare.config import split_overrides

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
LLAMA3_1_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192, rope_theta=500000.0)
SHAPES = {  # (config class, fields): the published models' attention, MLP and position shapes
    "llama2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                max_position_embeddings=4096)),
    "llama3-8b": ("llama", dict(LLAMA3_8B, rope_theta=500000.0, max_position_embeddings=8192)),
    "llama3.1-8b": ("llama", dict(LLAMA3_8B, rope_parameters=LLAMA3_1_ROPE, max_position_embeddings=131072)),
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                   sliding_window=None, max_position_embeddings=32768)),
    "llama3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                 rope_theta=500000.0, max_position_embeddings=8192)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256)),
}
PATHS = ("unpatched", "static", "dense", "ds@512", "hshare-1_2-1_2-1_2@512")
EXACT_REFERENCES = ("unpatched", "static")  # the first of these that runs gives the tokens agreement is taken against
TIMINGS = ("pairs", "steps")


@dataclass
class GenerateRow:
    """One path at one shape."""

    shape: str
    path: str
    batch: int
    prompt: int
    new_tokens: int
    shared_prompt: bool
    prefill_s: float
    decode_tok_s: float
    warmup_s: float
    peak_gib: float
    kv_gib: float
    agreement: float | None
    static_decode: dict = field(default_factory=dict)
    error: str = ""
    placement: str = ""  # "": one device; "tp2": 2 tensor-parallel ranks; "device_map split2": accelerate's dispatch
    peak_gib_per_gpu: list = field(default_factory=list)  # each GPU's peak (rank order under TP); peak_gib: the max
    # sparse presets: decode / sparse / dense-fallback steps, KV read, scorings, refinements, and the sharing plan's
    # summary (`SharingPlan.summary`: layer copies, head copies, selecting pairs; empty without a plan)
    decode_steps: dict = field(default_factory=dict)
    ranks_agree: bool | None = None  # under TP: whether every rank generated the same tokens
    prefill_peak_gib: float = 0.0  # peak of the prefill (the prefill's share of peak_gib; largest GPU)
    decode_tok_s_runs: list = field(default_factory=list)  # decode tok/s of each timed pair or generate (median)
    timing: str = "pairs"  # how decode_tok_s was measured (`TIMINGS`, module docstring)
    step_gb: float = 0.0  # bytes one decode step must read at the timed steps' mean context, in GB (0: not computed)
    bandwidth_gb_s: float = 0.0  # the device copy's bandwidth measured in the same run (bytes read + written)
    floor_tok_s: float = 0.0  # rows / (step bytes / bandwidth): the rate no decode can beat
    floor_share: float = 0.0  # decode_tok_s / floor_tok_s


def model_config(shape: str, layers: int | None, max_positions: int):
    """``(model class, config)`` of `shape` (`SHAPES`), cut to `layers` when given; its position table
    raised to `max_positions` where the published one is shorter (rotary types that scale by the length
    read ``original_max_position_embeddings``, which stays)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; accepted: {', '.join(SHAPES)}")
    kind, fields = SHAPES[shape]
    fields = dict(fields, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields["max_position_embeddings"] = max(fields.get("max_position_embeddings", 0), max_positions)
    if layers:
        fields["num_hidden_layers"] = layers
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (MistralConfig,
                                                                                         MistralForCausalLM)
    return model_class, config_class(**fields)


def build_model(shape: str, layers: int | None, device: str, dtype: torch.dtype, max_positions: int,
                placement: Placement | None = None):
    """A random-weight model of `shape` (`SHAPES`), made directly on `device` in `dtype`; under `placement`
    sharded over the torchrun ranks (``tp``) or dispatched over the GPUs (``device_map``), see `multi_gpu`."""
    model_class, config = model_config(shape, layers, max_positions)
    placement = placement or Placement()
    if placement.tp > 1:
        return multi_gpu.build_tp_model(model_class, config, dtype, placement.tp)
    if placement.device_map:
        return multi_gpu.build_device_map_model(model_class, config, dtype, placement.device_map, device)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def make_prompts(vocab: int, batch: int, prompt: int, shared: bool, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[batch, prompt]`` on the CPU, the same for the same arguments.
    `shared`: every row is one prompt; else random rows, and with `padded` one row in four (rows 0, 4,
    ...) left-padded by up to an eighth of the prompt when `batch` > 1."""
    generator = torch.Generator().manual_seed(1)
    if shared:
        ids = torch.randint(3, vocab, (1, prompt), generator=generator).expand(batch, prompt).contiguous()
        return ids, torch.ones_like(ids)
    ids = torch.randint(3, vocab, (batch, prompt), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(0, batch if padded and batch > 1 else 0, 4):
        pad = int(torch.randint(1, max(2, prompt // 8), (1,), generator=generator))
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def path_config(path: str, without: tuple[str, ...] = ()):
    """The `HShareConfig` a patched path runs (its ``+`` overrides applied, but not those named in
    `without`), or None for ``unpatched``, ``static`` and a path that names no config (its run says why)."""
    from hshare.config import resolve_config

    name, overrides = split_overrides(path)
    if name in ("unpatched", "static"):
        return None
    try:
        return resolve_config(name, **{k: v for k, v in overrides.items() if k not in without})
    except Exception:  # noqa: BLE001 - not a config: the path's run fails and its row says why
        return None


def warm_decode_steps(new_tokens: int) -> int:
    """Decode steps the ``"steps"`` timing leaves out at the start of a generate (graph capture,
    compilation): a quarter of them, at least one."""
    return max(1, (new_tokens - 1) // 4)


class StepClock(StoppingCriteria):
    """A ``generate`` stopping criterion that never stops: after each new token it waits for the GPUs
    and records the seconds since `start` (``times[i]``: token i + 1; ``times[0]`` ends the prefill), and
    at the first token the peak memory so far (the prefill's, GiB, largest GPU)."""

    def __init__(self, gpus: list[torch.device]) -> None:
        self.gpus = gpus
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.prefill_peak_gib = 0.0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        multi_gpu.synchronize(self.gpus)
        self.times.append(time.perf_counter() - self.start)
        if len(self.times) == 1:
            self.prefill_peak_gib = max(multi_gpu.peaks_gib(self.gpus) or [0.0])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class TimedRun:
    """One timed measurement of a path: decode rate (tok/s), prefill and warm-up seconds, the peaks (GiB)
    of the N-token call per GPU and of its prefill, and the context (mean cached tokens a row attends to)
    of the timed decode steps."""

    rate: float
    prefill_s: float
    warmup_s: float
    peaks: list
    prefill_peak: float
    context: float


def _timed(fn, gpus: list[torch.device]) -> tuple[float, object]:
    """`fn()` timed from a common start (every rank past a barrier) to the end of its GPU work."""
    multi_gpu.barrier()
    multi_gpu.synchronize(gpus)
    start = time.perf_counter()
    out = fn()
    multi_gpu.synchronize(gpus)
    return time.perf_counter() - start, out


def _time_pairs(generate, gpus, batch: int, valid: float, new_tokens: int, repeats: int):
    """`repeats` timed pairs (``"pairs"``) after a first N-token call: the runs and the last N-token output.
    Decode step j attends valid + j columns: steps 1..N-1 have mean context valid + N / 2."""
    first, _ = _timed(lambda: generate(new_tokens), gpus)
    runs, out = [], None
    for _ in range(repeats):
        multi_gpu.reset_peaks(gpus)
        one, _ = _timed(lambda: generate(1), gpus)
        prefill_peak = max(multi_gpu.peaks_gib(gpus) or [0.0])
        multi_gpu.reset_peaks(gpus)
        total, out = _timed(lambda: generate(new_tokens), gpus)
        runs.append(TimedRun(batch * (new_tokens - 1) / max(total - one, 1e-9), one, max(0.0, first - total),
                             multi_gpu.peaks_gib(gpus) or [0.0], prefill_peak, valid + new_tokens / 2))
    return runs, out


def _time_steps(generate, gpus, batch: int, valid: float, new_tokens: int, repeats: int):
    """`repeats` N-token generates timed at every token (``"steps"``): the runs and the last output. The
    timed steps k..N-1 (k - 1 = `warm_decode_steps`) attend valid + k .. valid + N - 1 columns."""
    first = warm_decode_steps(new_tokens) + 1  # the first timed token's index k: tokens k+1..N are timed
    runs, out = [], None
    for _ in range(repeats):
        multi_gpu.reset_peaks(gpus)
        clock = StepClock(gpus)
        _, out = _timed(lambda: generate(new_tokens, clock), gpus)
        times = clock.times
        step = (times[-1] - times[first - 1]) / (new_tokens - first)
        warm = max(0.0, times[first - 1] - times[0] - (first - 1) * step)
        runs.append(TimedRun(batch / max(step, 1e-12), times[0], warm, multi_gpu.peaks_gib(gpus) or [0.0],
                             clock.prefill_peak_gib, valid + (first + new_tokens - 1) / 2))
    return runs, out


def measure_path(model, path: str, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, shape: str, shared: bool,
                 overrides: dict | None = None, repeats: int = 1,
                 timing: str = "pairs") -> tuple[GenerateRow, torch.Tensor]:
    """Time one path (see the module docstring) in this process; returns the row and the new tokens ``[B, N]``.
    `timing`: ``"pairs"`` (`repeats` timed pairs after a first N-token call) or ``"steps"`` (`repeats`
    N-token generates timed per token); the row gives the median run. `overrides`: `HShareConfig` fields
    for a patched path (the path's own ``+`` overrides win). The row's ``step_gb`` is the roofline's
    bytes per step (one device, prompts not shared); its floor needs the bandwidth (`bench_cells`).
    Under TP the row is this rank's: its own GPU's peak, the KV of its own heads (`merge_ranks` joins them).
    The GPUs measured are the model's (`multi_gpu.model_gpus`)."""
    import hshare

    if repeats < 1:
        raise ValueError(f"repeats={repeats}; accepted: at least 1 timed pair or generate")
    if timing not in TIMINGS:
        raise ValueError(f"timing={timing!r}; accepted: {', '.join(TIMINGS)}")
    if timing == "steps" and new_tokens < 3:
        raise ValueError(f"new_tokens={new_tokens} with timing 'steps'; accepted: at least 3 (the first token, a "
                         "warm decode step and a timed one)")
    name, path_overrides = split_overrides(path)
    overrides = {**(overrides or {}), **path_overrides}
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    patched = name not in ("unpatched", "static")
    context = hshare.patched(model, name, prefix="auto" if shared else "off", **overrides) if patched \
        else contextlib.nullcontext()
    if name == "static":
        kwargs["cache_implementation"] = "static"
    caches = []

    def generate(tokens: int, clock: StepClock | None = None):
        extra = {}
        if patched:  # hold one cache at a time: each is as large as the whole KV of the generation
            caches.clear()  # free the previous cache before making the next
            caches.append(hshare.new_cache(model))
            extra[compat.CACHE_KWARG] = caches[0]
        if clock is not None:
            extra["stopping_criteria"] = StoppingCriteriaList([clock])
            clock.start = time.perf_counter()
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs, **extra)

    gpus = multi_gpu.model_gpus(model)
    batch, width = ids.shape
    valid = float(mask.sum()) / batch
    timer = _time_pairs if timing == "pairs" else _time_steps
    with context:
        runs, out = timer(generate, gpus, batch, valid, new_tokens, repeats)
    median = sorted(runs, key=lambda run: run.rate)[(len(runs) - 1) // 2]  # the lower of two middles
    peaks = [max(column) for column in zip(*(run.peaks for run in runs))]
    new = out[:, width:]
    cfg = model.config
    head_dim = patches.head_dim(cfg)
    element_bytes = torch.finfo(model.dtype).bits // 8
    steps, sparse = {}, None
    if patched:  # the cache sized its buffers from the heads this process's attention received
        cache = caches[-1]
        kv = cache.reserved_bytes() + (cache.prefix.nbytes() if cache.prefix is not None else 0)
        report = cache.static_decode
        static = {"reason": report.reason, "replays": report.replays, "eager_steps": report.eager_steps,
                  "capture_s": report.capture_seconds, "reserved": report.reserved, "fusion": report.fusion,
                  "projections": report.projections,
                  "compile_s": report.compile_seconds, "eager_s": report.eager_seconds}
        if cache.config.sparse:  # how many decode steps were sparse, how many fell back to dense, KV reads
            stats = cache.stats
            steps = {"decode": stats.decode_steps, "sparse": stats.sparse_steps,
                     "dense_fallback": stats.dense_fallback_steps,
                     "kv_read_share": stats.kv_rows_read / stats.dense_kv_rows if stats.dense_kv_rows else None,
                     "score_computations": stats.score_computations, "refinements": stats.refinements,
                     "plan": cache.planner.sharing_summary()}  # what the last generate's sharing plan shares
            sparse = roofline.sparse_reads(cache.config, cfg, element_bytes, stats, cache.label_bytes(), batch,
                                           cache.get_seq_length())
    else:  # this process's share of the KV heads (all of them unless tensor-parallel)
        kv_heads = cfg.num_key_value_heads // (getattr(model, "tp_size", None) or 1)
        # every column but the last new token's (sampled, never cached)
        kv = batch * (width + new_tokens - 1) * cfg.num_hidden_layers * 2 * kv_heads * head_dim * element_bytes
        static = {}
    one_device = not multi_gpu.distributed() and not getattr(model, "hf_device_map", None)
    step_bytes = roofline.decode_step_bytes(
        roofline.weight_bytes_read(model, batch), batch, median.context, cfg.num_hidden_layers,
        roofline.kv_token_bytes(cfg, element_bytes), sparse) if one_device and not shared else 0.0
    row = GenerateRow(shape=shape, path=path, batch=batch, prompt=width, new_tokens=new_tokens, shared_prompt=shared,
                      prefill_s=median.prefill_s, decode_tok_s=median.rate, warmup_s=runs[0].warmup_s,
                      peak_gib=max(peaks), kv_gib=kv / 2**30, agreement=None, static_decode=static,
                      peak_gib_per_gpu=peaks, decode_steps=steps,
                      prefill_peak_gib=max(run.prefill_peak for run in runs),
                      decode_tok_s_runs=[run.rate for run in runs], timing=timing, step_gb=step_bytes / 1e9)
    return row, new


def error_text(error: BaseException) -> str:
    what = "out of memory" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__
    return f"{what}: {str(error).splitlines()[0] if str(error) else ''}"


def failed_row(shape: str, path: str, batch: int, prompt: int, new_tokens: int, shared: bool, error: str,
               placement: str = "") -> GenerateRow:
    return GenerateRow(shape, path, batch, prompt, new_tokens, shared, 0.0, 0.0, 0.0, 0.0, 0.0, None, error=error,
                       placement=placement)


def merge_ranks(results: list[tuple], placement: str, failed: GenerateRow) -> tuple[GenerateRow, object]:
    """One row from every rank's ``(row, new tokens, error)`` (a single entry in one process): rank 0's
    times (the ranks step together: each decode step all-reduces), every rank's GPU peaks, the KV of all
    ranks, and whether the ranks generated the same tokens; returns it with rank 0's new tokens (agreement
    is set once every path ran: `set_agreement`). A rank's error fails the row (`failed`, with the error
    of the first failing rank)."""
    errors = [(r, error) for r, (_, _, error) in enumerate(results) if error]
    if errors:
        first, error = errors[0]
        if len(results) > 1 and len(errors) < len(results):  # only some ranks failed: say which
            error = f"rank {first} (of {len(results)}; {len(errors)} failed): {error}"
        failed.error = error
        return failed, None
    row, new = results[0][0], results[0][1]
    row.placement = placement
    if len(results) > 1:
        row.peak_gib_per_gpu = [peak for other, _, _ in results for peak in other.peak_gib_per_gpu]
        row.peak_gib = max(row.peak_gib_per_gpu)
        row.prefill_peak_gib = max(other.prefill_peak_gib for other, _, _ in results)
        row.kv_gib = sum(other.kv_gib for other, _, _ in results)
        row.ranks_agree = all(torch.equal(tokens, new) for _, tokens, _ in results)
    return row, new


def set_agreement(rows: list[GenerateRow], tokens: dict[str, torch.Tensor]) -> None:
    """Each row's agreement with the first path of `EXACT_REFERENCES` that produced tokens (`tokens`: new
    tokens by path; that row itself keeps None)."""
    reference = next((path for path in EXACT_REFERENCES if path in tokens), None)
    for row in rows:
        if reference is not None and row.path != reference and row.path in tokens:
            row.agreement = float((tokens[row.path] == tokens[reference]).float().mean())


def skip_reason(config, weight_bytes: float, element_bytes: int, path: str, batch: int, prompt: int,
                new_tokens: int, padded: bool, free_bytes: float | None) -> str:
    """``"skipped: needs X GiB of Y GiB"`` when the path's estimated peak (`roofline.estimated_peak_bytes`, for
    the model `config` with `weight_bytes` of parameters) exceeds `free_bytes` (the device's free memory
    before the model was built; None: never skipped), else ""."""
    if free_bytes is None:
        return ""
    config_of_path = path_config(path)
    sparse = config_of_path is not None and config_of_path.sparse
    needed = roofline.estimated_peak_bytes(config, weight_bytes, element_bytes, batch, prompt, new_tokens, padded,
                                           sparse)
    if needed <= free_bytes:
        return ""
    return f"skipped: needs {needed / roofline.GIB:.1f} GiB of {free_bytes / roofline.GIB:.1f} GiB"


def _static_in_own_process(shape: str, layers: int | None, device: str, dtype: torch.dtype, max_positions: int,
                           ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, shared: bool, repeats: int,
                           timing: str) -> tuple[GenerateRow | None, torch.Tensor | None, str]:
    """The ``static`` path measured in a spawned process of its own, which builds the same model (same
    seed) and exits with its compiled graphs' memory: ``(row, new tokens, "")`` or ``(None, None, error)``."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        job = pool.submit(_measure_static, shape, layers, device, dtype, max_positions, ids, mask, new_tokens,
                          shared, repeats, timing)
        try:
            return job.result()
        except Exception as error:  # the process died (killed, out of host memory): the row says so
            return None, None, error_text(error)


def _measure_static(shape: str, layers: int | None, device: str, dtype: torch.dtype, max_positions: int,
                    ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, shared: bool, repeats: int,
                    timing: str) -> tuple[GenerateRow | None, torch.Tensor | None, str]:
    """Inside the process of `_static_in_own_process`."""
    try:
        model = build_model(shape, layers, device, dtype, max_positions)
        row, new = measure_path(model, "static", ids.to(model.device), mask.to(model.device), new_tokens, shape,
                                shared, repeats=repeats, timing=timing)
        return row, new.cpu(), ""
    except Exception as error:  # returned, not raised: the parent records it as the row's error
        if not isinstance(error, torch.OutOfMemoryError):
            traceback.print_exc()
        return None, None, error_text(error)


def bench_cells(shape: str, cells: list[tuple[int, int]], new_tokens: int, paths=PATHS, shared: bool = False,
                layers: int | None = None, device: str = "cuda", dtype=torch.bfloat16, overrides: dict | None = None,
                placement: Placement | None = None, progress=None, repeats: int = 1, timing: str = "pairs",
                padded: bool = True, free_bytes: float | None = None, static_process: bool | None = None,
                deadline: float | None = None, rounds: int = 1) -> list[GenerateRow]:
    """Every path at each ``(rows, prompt)`` of `cells`, on one model of `shape` built for the longest
    prompt; rows in cell order, each cell's in the order of `paths` (each path once).

    Args:
        shared: all rows of a cell are one prompt (the shared prefix held once).
        overrides: `HShareConfig` fields set on every patched path (``dense_fallback_mib=0`` to see sparse
            decode at any size); a path's own ``+`` overrides win (`hshare.config.split_overrides`).
        placement: several GPUs (`multi_gpu`); every rank returns the same rows, only rank 0 prints.
        progress: ``progress(rows)`` on rank 0 after each row.
        repeats, timing: see `measure_path`.
        padded: one row in four left-padded (`make_prompts`).
        free_bytes: memory a cell may use; a path whose estimated peak exceeds it is skipped (`skip_reason`).
            None on one CUDA device: the free memory before the model is built; elsewhere: nothing skipped.
        static_process: run ``static`` in a process of its own, before this process builds its model
            (None: on one CUDA device); else it runs after the cell's other paths.
        deadline: a ``time.monotonic()`` value; a path not started by then is not run (its row says so).
        rounds: the cell's patched and unpatched paths are measured this many times in turn, in the order
            given, then reversed, and so on (A B C, C B A, A B C...), so that the order of paths in a process and
            its drift weigh on every path alike; a row keeps every round's runs (``decode_tok_s_runs``) and
            their median (`add_round`). ``static`` runs once.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}; accepted: at least 1")
    check_paths(paths)
    placement = placement or Placement()
    one_device = not placement.label
    on_cuda = device == "cuda" and torch.cuda.is_available()
    static_process = (on_cuda and one_device) if static_process is None else static_process
    max_positions = max(prompt for _, prompt in cells) + new_tokens + 8
    model_class, config = model_config(shape, layers, max_positions)
    bandwidth = copy_bandwidth(torch.device(device)) if one_device else 0.0
    if free_bytes is None and on_cuda and one_device:
        free_bytes = torch.cuda.mem_get_info()[0]
    free_bytes = free_bytes if one_device else None
    weight_bytes = roofline.parameter_bytes(model_class, config, dtype) if free_bytes is not None else 0
    prompts = {cell: make_prompts(config.vocab_size, *cell, shared, padded) for cell in cells}
    measured: dict[tuple[int, int], dict[str, tuple[GenerateRow, torch.Tensor | None]]] = {cell: {} for cell in cells}
    order = [p for p in paths if p != "static"] + (["static"] if "static" in paths else [])

    def record(cell: tuple[int, int], path: str, row: GenerateRow, new: torch.Tensor | None) -> None:
        if bandwidth and row.step_gb:
            row.bandwidth_gb_s = bandwidth / 1e9
            row.floor_tok_s = roofline.floor_rate(row.batch, row.step_gb * 1e9, bandwidth)
            row.floor_share = row.decode_tok_s / row.floor_tok_s
        measured[cell][path] = (row, new)
        if multi_gpu.rank() == 0:  # (under TP the process group starts with the model)
            done = [r for r, _ in measured[cell].values()]
            print_row(row, baseline(done))
            if progress is not None:
                progress([r for c in cells for r, _ in measured[c].values()])

    def skipped(cell: tuple[int, int], path: str) -> GenerateRow | None:
        ids, mask = prompts[cell]
        reason = skip_reason(config, weight_bytes, torch.finfo(dtype).bits // 8, path, *cell, new_tokens,
                             not bool(mask.all()), free_bytes)
        if not reason and deadline is not None and multi_gpu.gather(time.monotonic() > deadline)[0]:
            reason = "not run: the time limit was reached"
        return failed_row(shape, path, *cell, new_tokens, shared, reason, placement.label) if reason else None

    if static_process and "static" in paths:
        order.remove("static")
        for cell in cells:
            _print_cell(shape, cell, cells)
            row = skipped(cell, "static")
            new = None
            if row is None:
                ids, mask = prompts[cell]
                row, new, error = _static_in_own_process(shape, layers, device, dtype, max_positions, ids, mask,
                                                         new_tokens, shared, repeats, timing)
                row = row or failed_row(shape, "static", *cell, new_tokens, shared, error)
            record(cell, "static", row, new)
    model = build_model(shape, layers, device, dtype, max_positions, placement)
    for cell in cells:
        _print_cell(shape, cell, cells)
        ids, mask = prompts[cell]
        # the same prompts on every rank (made alike from one seed; rank 0's broadcast to be sure)
        ids, mask = multi_gpu.broadcast(ids.to(model.device)), multi_gpu.broadcast(mask.to(model.device))
        for path in _turns(order, rounds):
            first = measured[cell].get(path)
            if first is not None and (first[0].error or not first[0].decode_tok_s_runs):
                continue  # a path skipped, refused or failed in the first round is not tried again
            failed = skipped(cell, path)
            if failed is not None:
                if first is None:  # a later round past the deadline keeps the rounds measured
                    record(cell, path, failed, None)
                continue
            failed = failed_row(shape, path, *cell, new_tokens, shared, "", placement.label)
            name, path_overrides = split_overrides(path)
            # hshare's own words, before generating
            refusal = multi_gpu.split_refusal(model, name, {**(overrides or {}), **path_overrides})
            if refusal is not None:
                failed.error = f"refused: {refusal}"
                record(cell, path, failed, None)
                continue
            try:
                local, new = measure_path(model, path, ids, mask, new_tokens, shape, shared, overrides, repeats,
                                          timing)
                result = (local, new.cpu(), "")
            except Exception as error:  # one broken path must not lose the others' numbers
                if not isinstance(error, torch.OutOfMemoryError):
                    traceback.print_exc()
                result = (None, None, error_text(error))
            row, new = merge_ranks(multi_gpu.gather(result), placement.label, failed)
            if first is not None:  # a later round: its runs join the first's (a failure there ends the path's rounds)
                row = add_round(first[0], row) if not row.error else dataclasses.replace(
                    first[0], error=f"round failed: {row.error}")
                new = new if new is not None else first[1]
            record(cell, path, row, new)
            release_memory(device, compiled=path == "static")  # hshare's fused kernels stay compiled for the next
    rows = []
    for cell in cells:
        cell_rows = [measured[cell][path][0] for path in paths]
        set_agreement(cell_rows, {path: new for path, (_, new) in measured[cell].items() if new is not None})
        rows.extend(cell_rows)
    return rows


def rounds_arg(text: str) -> int:
    """The ``--rounds`` option's argparse type (``hshare bench generate``, the grid): an int, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}; accepted: an integer, at least 1")
    return value


def check_paths(paths) -> None:
    """A ValueError naming the paths given more than once (a row is kept per path; rounds repeat them)."""
    twice = sorted({path for path in paths if list(paths).count(path) > 1})
    if twice:
        raise ValueError(f"paths {', '.join(twice)} given more than once; accepted: each path once (--rounds "
                         "measures them again in turn)")


def _turns(order: list[str], rounds: int) -> list[str]:
    """The paths of `rounds` rounds, every other round reversed (``static`` in the first only)."""
    later = [path for path in order if path != "static"]
    return list(order) + [path for r in range(1, rounds) for path in (later[::-1] if r % 2 else later)]


def add_round(row: GenerateRow, later: GenerateRow) -> GenerateRow:
    """`row` with a later round's runs of the same path: every run kept, the rate their median (the lower of
    two middles, as `measure_path` takes), peaks the larger; the rest (prefill, warm-up, counters) the first
    round's."""
    runs = row.decode_tok_s_runs + later.decode_tok_s_runs
    return dataclasses.replace(row, decode_tok_s_runs=runs, decode_tok_s=sorted(runs)[(len(runs) - 1) // 2],
                               peak_gib=max(row.peak_gib, later.peak_gib),
                               prefill_peak_gib=max(row.prefill_peak_gib, later.prefill_peak_gib))


def _print_cell(shape: str, cell: tuple[int, int], cells: list[tuple[int, int]]) -> None:
    """A heading before a cell's rows when there are several cells (rank 0)."""
    if multi_gpu.rank() == 0 and len(cells) > 1:
        print(f" {shape} B{cell[0]} x {cell[1]}")


def bench_generate(shape: str, batch: int, prompt: int, new_tokens: int, paths=PATHS, shared: bool = False,
                   layers: int | None = None, device: str = "cuda", dtype=torch.bfloat16,
                   overrides: dict | None = None, placement: Placement | None = None,
                   progress=None, repeats: int = 1, timing: str = "pairs", rounds: int = 1) -> list[GenerateRow]:
    """Every path at one shape (`bench_cells` with one cell), one row in four of a batch left-padded."""
    return bench_cells(shape, [(batch, prompt)], new_tokens, paths, shared, layers, device, dtype, overrides,
                       placement, progress, repeats, timing, rounds=rounds)


def release_memory(device: str, compiled: bool = True) -> None:
    """Drop what a path left behind (freed blocks; with `compiled`, torch.compile's graphs and their memory
    pools, which transformers' ``static`` path holds) before the next."""
    gc.collect()
    if device == "cuda" and torch.cuda.is_available():
        if compiled:
            torch._dynamo.reset()
            gc.collect()
        torch.cuda.empty_cache()


def baseline(rows: list[GenerateRow]) -> GenerateRow:
    """The row speed ratios are taken against: transformers' compiled ``static`` path when it ran, else the
    first row that ran (else the first)."""
    ran = [r for r in rows if not r.error] or rows
    return next((r for r in ran if r.path == "static"), ran[0])


def print_row(row: GenerateRow, base: GenerateRow) -> None:
    if row.error:
        print(f"  {row.path:<26} {row.error}")
        return
    ratio = row.decode_tok_s / base.decode_tok_s if base.decode_tok_s else float("nan")
    graphs = row.static_decode.get("replays")
    static = (f"graphs {sum(graphs.values())} steps, capture {sum(row.static_decode['capture_s'].values()):.2f}s"
              f" eager {row.static_decode.get('eager_s', 0.0):.2f}s" if graphs else row.static_decode.get("reason", ""))
    runs = row.decode_tok_s_runs
    spread = f" [{min(runs):.0f}-{max(runs):.0f}]" if len(runs) > 1 else ""
    agreement = "" if row.agreement is None else f"{row.agreement:.3f}"
    per_gpu = f" ({'/'.join(f'{p:.1f}' for p in row.peak_gib_per_gpu)} per GPU)" \
        if len(row.peak_gib_per_gpu) > 1 else ""
    steps = (f"  sparse steps {row.decode_steps['sparse']}/{row.decode_steps['decode']}"
             f"  scorings {row.decode_steps.get('score_computations', 0)}"
             f" refinements {row.decode_steps.get('refinements', 0)}") if row.decode_steps else ""
    plan = row.decode_steps.get("plan") if row.decode_steps else None
    if plan:  # what the sharing plan shared: copying layers, copying heads, the share of pairs that select
        steps += (f"  plan {plan['layer_copies']:.1f} layer + {plan['head_copies']:.1f} head copies,"
                  f" {plan['selecting']:.0%} selecting")
    ranks = "" if row.ranks_agree is None else ("  ranks agree" if row.ranks_agree else "  RANKS DISAGREE")
    floor = f"  {row.floor_share:4.0%} of floor {row.floor_tok_s:.0f} ({row.step_gb:.1f} GB/step)" \
        if row.floor_tok_s else ""
    print(f"  {row.path:<26} prefill {row.prefill_s:7.2f}s  decode {row.decode_tok_s:8.1f} tok/s{spread}"
          f" ({ratio:5.2f}x){floor}"
          f"  warm-up {row.warmup_s:6.2f}s  peak {row.peak_gib:6.2f} GiB{per_gpu} (prefill {row.prefill_peak_gib:6.2f})"
          f"  KV {row.kv_gib:6.2f} GiB"
          f"  agree {agreement:>5}{steps}{ranks}  {static}")


def figure(results: dict, source: str = ""):
    """Decode tok/s of each path relative to `baseline` (transformers' compiled StaticCache when it
    ran), one bar per path, and beside it the peak GPU memory and the KV bytes each path held. `source`:
    the JSON's name, shown in the title (it names a layer cut, which the rows do not)."""
    import matplotlib.pyplot as plt

    rows = [GenerateRow(**r) for r in results["generate"]]
    base = baseline(rows)
    first, x = rows[0], range(len(rows))
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    ratios = [0.0 if r.error or not base.decode_tok_s else r.decode_tok_s / base.decode_tok_s for r in rows]
    colors = ["tab:gray" if r.path in EXACT_REFERENCES else "tab:blue" for r in rows]
    bars = speed.bar(x, ratios, color=colors, edgecolor=["black" if r is base else c for r, c in zip(rows, colors)],
                     linewidth=1.5)
    for bar, row, ratio in zip(bars, rows, ratios):
        label = row.error.split(":")[0] if row.error else f"{ratio:.2f}x\n{row.decode_tok_s:.0f} tok/s"
        speed.annotate(label, (bar.get_x() + bar.get_width() / 2, ratio), ha="center", va="bottom", fontsize=8,
                       xytext=(0, 2), textcoords="offset points", color="tab:red" if row.error else "black",
                       bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=0.5))
    speed.axhline(1.0, color="black", linewidth=0.8)
    speed.set_ylim(0, max(ratios + [1.0]) * 1.2)
    speed.set_ylabel(f"decode tok/s relative to {base.path}")
    stock = "transformers' compiled StaticCache" if base.path == "static" else \
        f"{base.path}: static {'failed' if any(r.path == 'static' for r in rows) else 'not run'}"
    speed.set_title(f"decode speed vs {stock} (gray: transformers, blue: hshare)", fontsize=10)
    width = 0.4
    peaks = memory.bar([i - width / 2 for i in x], [r.peak_gib for r in rows], width, label="peak allocated")
    memory.bar([i + width / 2 for i in x], [r.kv_gib for r in rows], width, label="KV held")
    memory.bar_label(peaks, ["" if r.error else f"{r.peak_gib:.1f}" for r in rows], fontsize=8)
    memory.set_ylim(0, max([r.peak_gib for r in rows] + [r.kv_gib for r in rows]) * 1.25 or 1.0)
    memory.set_ylabel("GiB")
    several = any(len(r.peak_gib_per_gpu) > 1 for r in rows)
    memory.set_title("GPU memory of an N-token generate" + (" (peak: the largest GPU's; KV: all GPUs)"
                                                            if several else ""), fontsize=10)
    memory.legend(fontsize=8, loc="upper center", ncols=2)
    for ax in (speed, memory):
        ax.set_xticks(x, [r.path for r in rows], rotation=20, ha="right", fontsize=8)
    overrides = results.get("overrides") or {}
    where = (results.get("placement") or {}).get("label") or first.placement
    fig.suptitle(f"generate: {first.shape}{f' ({where})' if where else ''}, B{first.batch}, prompt {first.prompt}"
                 f"{' (one prompt, shared)' if first.shared_prompt else ''}, {first.new_tokens} new tokens"
                 f"{f', patched with {overrides}' if overrides else ''} - {results['env'].get('device')}"
                 f"{f'  [{source}]' if source else ''}", fontsize=11)
    return fig


def main_generate(out: Path, shape: str, batch: int, prompt: int, new_tokens: int, paths, shared: bool,
                  layers: int | None, smoke: bool, overrides: dict | None = None, tp: int = 1,
                  device_map: str | None = None, repeats: int = 1, timing: str = "pairs", rounds: int = 1) -> dict:
    """`bench_generate` printed and written (the JSON after every row, the PNG at the end). `tp` > 1: one of
    `tp` processes under torchrun (`multi_gpu.require_torchrun`), rank 0 prints and writes; `device_map`: the
    model dispatched over the GPUs. `smoke`: the tiny shape in float32, on the CPU (under TP: on the GPUs
    where the machine has them, as transformers binds each rank to one); `repeats`, `timing`: timed pairs or
    generates per path (`measure_path`); `rounds`: the paths measured in turn that many times (`bench_cells`)."""
    try:
        placement = Placement(tp=tp, device_map=device_map)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    multi_gpu.require_torchrun(tp)
    on_gpus = torch.cuda.is_available() and (not smoke or tp > 1)
    device = "cuda" if on_gpus else "cpu"
    dtype = torch.bfloat16 if on_gpus and not smoke else torch.float32
    if smoke:
        shape, batch, prompt, new_tokens, layers = "tiny", 2, 40, 4, None
    lead = int(os.environ.get("RANK", "0")) == 0  # the process group starts with the model (transformers')
    if lead:
        print(f"generate: {shape}{f' ({layers} layers)' if layers else ''}, B{batch}, prompt {prompt}"
              f"{' (one prompt, shared)' if shared else ''}, {new_tokens} new tokens, {dtype}, {device}"
              f"{f', {placement.label}' if placement.label else ''}")
    name = (f"bench_generate_{shape}{f'_l{layers}' if layers else ''}_b{batch}_p{prompt}"
            f"{'_shared' if shared else ''}{placement.tag}")
    info = {"tp": tp, "device_map": device_map, "label": placement.label}

    def results_of(rows: list[GenerateRow]) -> dict:  # "placement" only on several GPUs (one device: as before)
        placed = {"placement": info} if placement.label else {}
        return {"env": environment(), "overrides": overrides or {}, **placed, "generate": [asdict(r) for r in rows]}

    def partial(rows: list[GenerateRow]) -> None:  # a run cut short still leaves the rows it measured
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(results_of(rows), indent=1))

    rows = bench_generate(shape, batch, prompt, new_tokens, paths, shared, layers, device, dtype, overrides,
                          placement, partial, repeats, timing, rounds)
    info["world"] = multi_gpu.world()
    info["gpus"] = multi_gpu.gather(multi_gpu.describe_gpus(_process_gpus(device)))
    results = results_of(rows)
    if lead:
        if overrides:
            print(f"  (patched paths with {overrides})")
        write(results, out, name)
    multi_gpu.barrier()  # no rank leaves before rank 0 has written
    if tp > 1:
        multi_gpu.finish()  # the process group transformers started for the model: the bench was its only user
    return results


def _process_gpus(device: str) -> list[torch.device]:
    """The GPUs this process used: its own under TP, every visible one otherwise."""
    if device != "cuda":
        return []
    if multi_gpu.distributed():
        return [torch.device("cuda", torch.cuda.current_device())]
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
