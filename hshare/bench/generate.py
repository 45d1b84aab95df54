"""``hshare bench generate``: end-to-end ``generate`` of random-weight models of real shapes.

Paths, in the same process on the same prompts:

* ``unpatched``: transformers' default (DynamicCache, SDPA, eager);
* ``static``: transformers' ``cache_implementation="static"``, which ``generate`` compiles
  (``torch.compile``, CUDA graphs): the strongest stock path and the baseline of every speed claim;
* patched presets (``dense``, ``ds@512``, ``hshare-1_2-1_2-1_2@512``, ...): hshare's static-shape
  decode replayed as CUDA graphs (`hshare.static_decode`).

Per path: prefill time (a 1-token generate), decode tok/s = rows x (N - 1) / (t(N) - t(1)), warm-up
(the first N-token call minus a later one: compilation or capture), peak GPU memory of an N-token
call (``--repeats R``: R pairs of a 1-token and an N-token call after the first; the row gives the
median pair's rate and every pair's in ``decode_tok_s_runs``, the largest peaks), KV bytes held,
token agreement with the first exact path that ran (``unpatched``, else ``static``) (share of new
tokens equal at the same position), and for patched paths what static decode did (graph replays,
capture and eager warm-up time, or why not). Models are built on the GPU with random weights
(nothing is loaded). Rows print as they come and are written as JSON (and a PNG where matplotlib is
installed: each path's decode tok/s relative to ``static``, peak memory and KV beside it).

Several GPUs (`hshare.bench.multi_gpu`): ``--tp N`` under torchrun (transformers' tensor parallelism,
the model built sharded on the GPUs; every rank measures its own GPU, rank 0 prints and writes) or
``--device-map`` (accelerate's dispatch in one process; sparse presets are refused by the library and
the row records the refusal). There ``peak_gib`` is the largest of the per-GPU peaks
(``peak_gib_per_gpu``, in rank or device order) and ``kv_gib`` the KV of all GPUs together.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hshare import patches
from hshare.bench import multi_gpu
from hshare.bench.multi_gpu import Placement
from hshare.bench.results import environment, write

SHAPES = {  # (config class, fields): the published models' attention and MLP shapes
    "llama2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                rope_theta=500000.0)),
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                   sliding_window=None)),
    "llama3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                 rope_theta=500000.0)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256)),
}
PATHS = ("unpatched", "static", "dense", "ds@512", "hshare-1_2-1_2-1_2@512")
EXACT_REFERENCES = ("unpatched", "static")  # the first of these that runs gives the tokens agreement is taken against


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
    decode_steps: dict = field(default_factory=dict)  # sparse presets: decode / sparse / dense-fallback steps, KV read
    ranks_agree: bool | None = None  # under TP: whether every rank generated the same tokens
    prefill_peak_gib: float = 0.0  # peak of a 1-token generate (the prefill's share of peak_gib; largest GPU)
    decode_tok_s_runs: list = field(default_factory=list)  # decode tok/s of each timed pair (decode_tok_s: the median)


def model_config(shape: str, layers: int | None, max_positions: int):
    """``(model class, config)`` of `shape` (`SHAPES`), cut to `layers` when given."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    kind, fields = SHAPES[shape]
    fields = dict(fields, max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2)
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


def _timed(fn, gpus: list[torch.device]) -> tuple[float, object]:
    """`fn()` timed from a common start (every rank past a barrier) to the end of its GPU work."""
    multi_gpu.barrier()
    multi_gpu.synchronize(gpus)
    start = time.perf_counter()
    out = fn()
    multi_gpu.synchronize(gpus)
    return time.perf_counter() - start, out


def measure_path(model, path: str, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, shape: str, shared: bool,
                 overrides: dict | None = None, repeats: int = 1) -> tuple[GenerateRow, torch.Tensor]:
    """Time one path (see the module docstring) in this process; returns the row and the new tokens ``[B, N]``.
    `repeats` timed pairs (a 1-token and an N-token generate) follow the first N-token call; the row gives the
    median pair.
    Under TP the row is this rank's: its own GPU's peak, the KV of its own heads (`merge_ranks` joins them,
    and sets the agreement with the reference tokens). The GPUs measured are the model's
    (`multi_gpu.model_gpus`)."""
    import hshare

    if repeats < 1:
        raise ValueError(f"repeats={repeats}; accepted: at least 1 timed pair")
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    patched = path not in ("unpatched", "static")
    context = hshare.patched(model, path, prefix="auto" if shared else "off", **(overrides or {})) if patched \
        else contextlib.nullcontext()
    if path == "static":
        kwargs["cache_implementation"] = "static"
    caches = []

    def generate(tokens: int):
        extra = {}
        if patched:  # hold one cache at a time: each is as large as the whole KV of the generation
            caches.clear()  # free the previous cache before making the next
            caches.append(hshare.new_cache(model))
            extra["past_key_values"] = caches[0]
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs, **extra)

    gpus = multi_gpu.model_gpus(model)
    batch, width = ids.shape
    pairs, prefill_peak, peaks = [], 0.0, []
    with context:
        first, _ = _timed(lambda: generate(new_tokens), gpus)
        for _ in range(repeats):
            multi_gpu.reset_peaks(gpus)
            one, _ = _timed(lambda: generate(1), gpus)
            prefill_peak = max(prefill_peak, *(multi_gpu.peaks_gib(gpus) or [0.0]))
            multi_gpu.reset_peaks(gpus)
            total, out = _timed(lambda: generate(new_tokens), gpus)
            now = multi_gpu.peaks_gib(gpus) or [0.0]
            peaks = [max(a, b) for a, b in zip(peaks, now)] if peaks else now
            pairs.append((batch * (new_tokens - 1) / max(total - one, 1e-9), one, total))
    runs = [rate for rate, _, _ in pairs]
    decode, prefill, total = sorted(pairs)[(len(pairs) - 1) // 2]  # the median pair (the lower of two middles)
    new = out[:, width:]
    cfg = model.config
    head_dim = patches.head_dim(cfg)
    steps = {}
    if patched:  # the cache sized its buffers from the heads this process's attention received
        cache = caches[-1]
        kv = cache.reserved_bytes() + (cache.prefix.nbytes() if cache.prefix is not None else 0)
        report = cache.static_decode
        static = {"reason": report.reason, "replays": report.replays, "eager_steps": report.eager_steps,
                  "capture_s": report.capture_seconds, "reserved": report.reserved, "fusion": report.fusion,
                  "compile_s": report.compile_seconds, "eager_s": report.eager_seconds}
        if cache.config.sparse:  # how many decode steps were sparse, how many fell back to dense, KV reads
            stats = cache.stats
            steps = {"decode": stats.decode_steps, "sparse": stats.sparse_steps,
                     "dense_fallback": stats.dense_fallback_steps,
                     "kv_read_share": stats.kv_rows_read / stats.dense_kv_rows if stats.dense_kv_rows else None}
    else:  # this process's share of the KV heads (all of them unless tensor-parallel)
        kv_heads = cfg.num_key_value_heads // (getattr(model, "tp_size", None) or 1)
        # every column but the last new token's (sampled, never cached)
        kv = batch * (width + new_tokens - 1) * cfg.num_hidden_layers * 2 * kv_heads * head_dim \
            * torch.finfo(model.dtype).bits // 8
        static = {}
    row = GenerateRow(shape=shape, path=path, batch=batch, prompt=width, new_tokens=new_tokens, shared_prompt=shared,
                      prefill_s=prefill, decode_tok_s=decode, warmup_s=max(0.0, first - total), peak_gib=max(peaks),
                      kv_gib=kv / 2**30, agreement=None, static_decode=static, peak_gib_per_gpu=peaks,
                      decode_steps=steps, prefill_peak_gib=prefill_peak, decode_tok_s_runs=runs)
    return row, new


def error_text(error: BaseException) -> str:
    what = "out of memory" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__
    return f"{what}: {str(error).splitlines()[0] if str(error) else ''}"


def failed_row(shape: str, path: str, batch: int, prompt: int, new_tokens: int, shared: bool, error: str,
               placement: str = "") -> GenerateRow:
    return GenerateRow(shape, path, batch, prompt, new_tokens, shared, 0.0, 0.0, 0.0, 0.0, 0.0, None, error=error,
                       placement=placement)


def merge_ranks(results: list[tuple], reference, placement: str, failed: GenerateRow) -> tuple[GenerateRow, object]:
    """One row from every rank's ``(row, new tokens, error)`` (a single entry in one process): rank 0's
    times (the ranks step together: each decode step all-reduces), every rank's GPU peaks, the KV of all
    ranks, whether the ranks generated the same tokens, and the agreement of rank 0's tokens with
    `reference`. A rank's error fails the row (`failed`, with the error of the first failing rank)."""
    errors = [(r, error) for r, (_, _, error) in enumerate(results) if error]
    if errors:
        first, error = errors[0]
        if len(results) > 1 and len(errors) < len(results):  # only some ranks failed: say which
            error = f"rank {first} (of {len(results)}; {len(errors)} failed): {error}"
        failed.error = error
        return failed, None
    row, new = results[0][0], results[0][1]
    row.placement = placement
    row.agreement = None if reference is None else float((new == reference).float().mean())
    if len(results) > 1:
        row.peak_gib_per_gpu = [peak for other, _, _ in results for peak in other.peak_gib_per_gpu]
        row.peak_gib = max(row.peak_gib_per_gpu)
        row.prefill_peak_gib = max(other.prefill_peak_gib for other, _, _ in results)
        row.kv_gib = sum(other.kv_gib for other, _, _ in results)
        row.ranks_agree = all(torch.equal(tokens, new) for _, tokens, _ in results)
    return row, new


def bench_generate(shape: str, batch: int, prompt: int, new_tokens: int, paths=PATHS, shared: bool = False,
                   layers: int | None = None, device: str = "cuda", dtype=torch.bfloat16,
                   overrides: dict | None = None, placement: Placement | None = None,
                   progress=None, repeats: int = 1) -> list[GenerateRow]:
    """Every path at one shape; `shared`: all rows are one prompt (the shared prefix held once); `overrides`:
    `HShareConfig` fields set on every patched path (``dense_fallback_mib=0`` to see sparse decode at any size);
    `placement`: several GPUs (`multi_gpu`); `progress(rows)`: called on rank 0 after each row; `repeats`: timed
    pairs per path (`measure_path`).
    Every rank returns the same rows; only rank 0 prints."""
    placement = placement or Placement()
    model = build_model(shape, layers, device, dtype, prompt + new_tokens + 8, placement)
    lead = multi_gpu.rank() == 0
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    if shared:
        ids = torch.randint(3, vocab, (1, prompt), generator=generator).expand(batch, prompt).contiguous()
        mask = torch.ones_like(ids)
    else:  # one row in four left-padded by up to an eighth of the prompt
        ids = torch.randint(3, vocab, (batch, prompt), generator=generator)
        mask = torch.ones_like(ids)
        for row in range(0, batch, 4):
            pad = int(torch.randint(1, max(2, prompt // 8), (1,), generator=generator))
            ids[row, :pad], mask[row, :pad] = 0, 0
    # the same prompts on every rank (made alike from one seed; rank 0's broadcast to be sure)
    ids, mask = multi_gpu.broadcast(ids.to(model.device)), multi_gpu.broadcast(mask.to(model.device))
    rows, reference = [], None
    for path in paths:
        failed = failed_row(shape, path, batch, prompt, new_tokens, shared, "", placement.label)
        refusal = multi_gpu.split_refusal(model, path, overrides)  # hshare's own words, before generating
        if refusal is not None:
            failed.error = f"refused: {refusal}"
            row = failed
        else:
            try:
                local, new = measure_path(model, path, ids, mask, new_tokens, shape, shared, overrides, repeats)
                result = (local, new.cpu(), "")
            except Exception as error:  # one broken path must not lose the others' numbers
                if not isinstance(error, torch.OutOfMemoryError):
                    traceback.print_exc()
                result = (None, None, error_text(error))
            row, new = merge_ranks(multi_gpu.gather(result), reference, placement.label, failed)
            if new is not None and path in EXACT_REFERENCES and reference is None:
                reference = new
        release_memory(device)
        rows.append(row)
        if lead:
            print_row(row, baseline(rows))
            if progress is not None:
                progress(rows)
    return rows


def release_memory(device: str) -> None:
    """Drop what a path left behind (compiled graphs and their memory pools, freed blocks) before the next."""
    gc.collect()
    if device == "cuda" and torch.cuda.is_available():
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


def baseline(rows: list[GenerateRow]) -> GenerateRow:
    """The row speed ratios are taken against: transformers' compiled ``static`` path when it ran, else the first."""
    return next((r for r in rows if r.path == "static" and not r.error), rows[0])


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
    steps = f"  sparse steps {row.decode_steps['sparse']}/{row.decode_steps['decode']}" if row.decode_steps else ""
    ranks = "" if row.ranks_agree is None else ("  ranks agree" if row.ranks_agree else "  RANKS DISAGREE")
    print(f"  {row.path:<26} prefill {row.prefill_s:7.2f}s  decode {row.decode_tok_s:8.1f} tok/s{spread}"
          f" ({ratio:5.2f}x)"
          f"  warm-up {row.warmup_s:6.2f}s  peak {row.peak_gib:6.2f} GiB{per_gpu} (1 token {row.prefill_peak_gib:6.2f})"
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
                  device_map: str | None = None, repeats: int = 1) -> dict:
    """`bench_generate` printed and written (the JSON after every row, the PNG at the end). `tp` > 1: one of
    `tp` processes under torchrun (`multi_gpu.require_torchrun`), rank 0 prints and writes; `device_map`: the
    model dispatched over the GPUs. `smoke`: the tiny shape in float32, on the CPU (under TP: on the GPUs
    where the machine has them, as transformers binds each rank to one); `repeats`: timed pairs per path."""
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
                          placement, partial, repeats)
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
