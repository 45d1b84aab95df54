"""``hshare sweep``: every config of a sweep file on lm-eval tasks, resumable, with a table and a plot.

    hshare sweep --configs configs/sweeps/paper.yaml --tasks longbench_multi_news --limit 20 --out sweep/
    hshare sweep --configs paper --tasks longbench_multi_news --devices auto --out sweep/  # every GPU

The model is loaded once; each config runs `hshare.eval.harness.evaluate` and its result is written
to ``<out>/runs/<config>.json`` as soon as it finishes, so an interrupted sweep resumes where it
stopped (a finished config is skipped when its tasks, limit and config fields are unchanged; a
config that was running when the sweep stopped has no run file and runs again).
Then ``<out>/sweep.md``, ``sweep.csv``, ``sweep.json`` and ``sweep.png`` (score against attention
cost, the paper's Fig. 4 style) are written from every run file.

Several devices (``--devices cuda:0,cuda:1`` or ``--devices auto``, every visible CUDA device): one
worker process per device (`sweep_worker`) loads the model once on its device and runs the configs
the dispatcher (`run_parallel`) hands it, one at a time, next config to the first idle worker. Each
worker writes its run files itself, exactly as a sequential sweep does (a config runs alone on its
device, so its scores and work counters are those of a sequential run); the tables and plot are
written once at the end from every run file. Task configs are prepared once, by the dispatcher. A
worker's output (lm-eval's logs and progress bars) goes to ``<out>/logs/worker-<i>-<device>.log``.
If a config fails, no further config is started, the running ones finish, and the sweep exits
naming the config, the device and the log; the finished runs are kept for the next run. One device
is the sequential sweep, in this process.

Attention cost comes from the work counters of the decode steps (`hshare.cache.DecodeStats`): KV
rows read by decode attention over what dense attention reads at the same steps, and the label
scorings done (what sharing saves).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import pickle
import queue
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from hshare.eval.harness import evaluation_config
from hshare.eval.sweep_spec import SweepEntry, SweepSpec, load_sweep

RUNS = "runs"


def run_path(out_dir: Path, entry: SweepEntry) -> Path:
    return out_dir / RUNS / f"{entry.file_stem}.json"


def _as_json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _identity(entry: SweepEntry, tasks: list[str], limit: Any, dense_fallback: bool = False) -> dict[str, Any]:
    """What must match for a finished run to be reused: tasks, limit, and the config that runs."""
    config = evaluation_config(entry.config(), dense_fallback=dense_fallback).to_dict()
    return {"tasks": sorted(tasks), "limit": limit, "config": _as_json(config)}


def _field_defaults(entry: SweepEntry) -> dict[str, Any]:
    """`HShareConfig.to_dict` of `entry`'s config with every section at its fields' defaults (the
    entry's policy), JSON-normalized as `_identity`'s config."""
    config = entry.config()
    sections = {name: type(getattr(config, name))() for name in config.to_dict() if name != "sparse"}
    return _as_json(dataclasses.replace(config, **sections).to_dict())


def _same_config(saved: Any, current: Any, defaults: Any) -> bool:
    """Whether a saved run's config (a `to_dict`, possibly of an older hshare) is `current`. A field the
    saved run predates (absent from it) matches where `current` holds the field's default, the behaviour
    of the code that made the run; a field the saved run has and `current` lacks does not match."""
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return saved == current
    if not set(saved) <= set(current):
        return False
    defaults = defaults if isinstance(defaults, dict) else {}
    return all(_same_config(saved[key], value, defaults.get(key)) if key in saved
               else key in defaults and value == defaults[key] for key, value in current.items())


def finished(out_dir: Path, entry: SweepEntry, tasks: list[str], limit: Any,
             dense_fallback: bool = False) -> dict[str, Any] | None:
    """The saved run of `entry` if it was made with the same tasks, limit and config, else None (a
    config field added to hshare since the run, at its default, keeps the run: `_same_config`)."""
    path = run_path(out_dir, entry)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    identity, current = saved.get("identity"), _identity(entry, tasks, limit, dense_fallback)
    if not isinstance(identity, dict) or {k: identity.get(k) for k in ("tasks", "limit")} != \
            {k: current[k] for k in ("tasks", "limit")}:
        return None
    return saved if _same_config(identity.get("config"), current["config"], _field_defaults(entry)) else None


def _write_atomic(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def run_sweep(spec: SweepSpec, evaluate_one: Callable[[SweepEntry], Any], out_dir: Path, tasks: list[str],
              limit: Any, meta: dict[str, Any] | None = None, progress: Callable[[str, str], None] | None = None,
              dense_fallback: bool = False) -> list[dict[str, Any]]:
    """Run every config not finished yet; returns the run records in sweep order.

    Args:
        evaluate_one: entry -> `EvalResult` (the model call; injected so that tests can count calls).
        dense_fallback: whether `evaluate_one` keeps the configs' dense fallback (part of a run's
            identity: a run made with it is not reused without it).
        progress: called with (config name, "skip" | "run" | "done") for a progress display.
    """
    records = []
    for entry in spec.entries:
        saved = finished(out_dir, entry, tasks, limit, dense_fallback)
        if saved is not None:
            if progress:
                progress(entry.name, "skip")
            records.append(saved)
            continue
        if progress:
            progress(entry.name, "run")
        result = evaluate_one(entry)
        record = {"name": entry.name, "preset": entry.preset, "overrides": entry.overrides,
                  "identity": _identity(entry, tasks, limit, dense_fallback), **(meta or {}), **result.as_dict()}
        _write_atomic(run_path(out_dir, entry), json.loads(json.dumps(record, default=str)))
        records.append(record)
        if progress:
            progress(entry.name, "done")
    return records


# ---- the table --------------------------------------------------------------------------------

def cost_columns(work: dict[str, int]) -> dict[str, float | None]:
    """Attention cost of a run from its work counters.

    Returns:
        ``kv_read``: KV rows read by decode attention / what dense attention reads (1.0 = dense);
        ``scorings``: (row, layer, selection head) label scorings; None where a counter is missing.
    """
    read, dense = work.get("kv_rows_read"), work.get("dense_kv_rows")
    return {
        "kv_read": (read / dense) if read is not None and dense else None,
        "scorings": work.get("score_computations"),
    }


def primary_metric(scores: dict[str, float]) -> str | None:
    """The metric a table shows for a task: lm-eval's first reported metric (``exact_match,strict-match``
    for gsm8k, ``em``/``f1`` order of the task config, ``rouge_score`` for multi_news)."""
    return next(iter(scores), None)


def summarize(records: list[dict[str, Any]], reference: str = "dense") -> list[dict[str, Any]]:
    """One row per config: primary metric per task, its share of `reference`'s, the costs, and what its
    sharing plans share (``plan_<name>``, the run's mean `SharingPlan.summary`; None in a run without one)."""
    ref = next((r for r in records if r["name"] == reference), None)
    plan_names = list(dict.fromkeys(name for r in records for name in r.get("plan") or {}))
    rows = []
    for record in records:
        row: dict[str, Any] = {"config": record["name"]}
        for task, scores in sorted(record["scores"].items()):
            metric = primary_metric(scores)
            if metric is None:
                continue
            value = scores[metric]
            row[f"{task}:{metric}"] = value
            base = ref["scores"].get(task, {}).get(metric) if ref else None
            row[f"{task}:vs_{reference}"] = (value / base) if base else None
        row.update(cost_columns(record["work"]))
        row.update({f"plan_{name}": (record.get("plan") or {}).get(name) for name in plan_names})
        row["seconds"] = record.get("seconds")
        rows.append(row)
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_tables(rows: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> list[Path]:
    """``sweep.md`` (Markdown), ``sweep.csv`` and ``sweep.json`` of the summary rows."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = [f"<!-- {json.dumps(meta, default=str)} -->", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows]
    md = out_dir / "sweep.md"
    md.write_text("\n".join(lines) + "\n")
    with open(out_dir / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return [md, out_dir / "sweep.csv", out_dir / "sweep.json"]


def plot_sweep(rows: list[dict[str, Any]], out_path: Path) -> Path | None:
    """Score against KV rows read (fraction of dense), one panel per task; None without matplotlib
    or without the counters."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no sweep.png (pip install matplotlib)")
        return None
    score_keys = [k for k in dict.fromkeys(key for row in rows for key in row)
                  if ":" in k and ":vs_" not in k]
    plotted = [row for row in rows if row.get("kv_read") is not None]
    if not score_keys or not plotted:
        return None
    fig, axes = plt.subplots(1, len(score_keys), figsize=(5.5 * len(score_keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], score_keys):
        for row in plotted:
            if row.get(key) is None:
                continue
            ax.scatter(row["kv_read"], row[key], s=24)
            ax.annotate(row["config"], (row["kv_read"], row[key]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xlabel("KV rows read by decode attention (fraction of dense)")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=130)
    plt.close(fig)
    return out_path


# ---- several devices --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunSettings:
    """How every config of a sweep runs (the command's options): the model to load, lm-eval's
    settings and where runs go. Picklable: `sweep_worker` processes receive it.

    Attributes:
        record_meta: added to every run record (``date``, ``model``; the device is added by whoever
            loaded the model).
    """

    tasks: list[str]
    limit: int | float | None
    out_dir: Path
    model: str | None = None
    gguf_file: str | None = None
    dtype: str = "auto"
    batch_size: int = 8
    num_fewshot: int | None = None
    gen_kwargs: str | None = None
    dense_fallback: bool = False
    log_samples: bool = False
    record_meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def evaluator(self, model, tokenizer, suite) -> Callable[[SweepEntry], Any]:
        """entry -> `EvalResult` of `model` patched with the entry's config on `suite`."""
        from hshare.eval.harness import evaluate

        def evaluate_one(entry: SweepEntry):
            return evaluate(model, tokenizer, entry.config(), suite, limit=self.limit, batch_size=self.batch_size,
                            num_fewshot=self.num_fewshot, gen_kwargs=self.gen_kwargs,
                            dense_fallback=self.dense_fallback, log_samples=self.log_samples)

        return evaluate_one


def parse_devices(value: str | None) -> list[str]:
    """``--devices``: ``auto`` -> every visible CUDA device, else the comma-separated devices
    (``cuda:0,cuda:1``; ``cpu,cpu`` runs two CPU workers, for tests). A device may repeat (two
    workers on one GPU).

    Raises:
        SystemExit: not a device, a CUDA device that is not visible, or ``auto`` without CUDA.
    """
    if not value:
        return []
    import torch

    visible = torch.cuda.device_count()
    if value.strip() == "auto":
        if not visible:
            raise SystemExit("hshare sweep --devices auto: no CUDA device is visible; accepted: a list of "
                             "devices, e.g. --devices cuda:0,cuda:1 (or --device cpu)")
        return [f"cuda:{i}" for i in range(visible)]
    devices = [d.strip() for d in value.split(",") if d.strip()]
    for name in devices:
        try:
            device = torch.device(name)
        except (RuntimeError, ValueError):
            raise SystemExit(f"hshare sweep --devices: {name!r} is not a device; accepted: auto, or a list "
                             "such as cuda:0,cuda:1") from None
        if device.type == "cuda" and (not visible or (device.index or 0) >= visible):
            raise SystemExit(f"hshare sweep --devices: {name} is not visible here ({visible} CUDA device(s)"
                             f"{'' if not visible else f': cuda:0..cuda:{visible - 1}'}); check "
                             "CUDA_VISIBLE_DEVICES, or use --devices auto")
    return devices


def use_device(device: str | None) -> None:
    """Make an indexed CUDA device (``cuda:1``) this process's current one: kernels launched by
    Triton and CUDA-graph capture use the current device, which must be the model's."""
    if device:
        import torch

        parsed = torch.device(device)
        if parsed.type == "cuda" and parsed.index is not None:
            torch.cuda.set_device(parsed)


def worker_log(out_dir: Path, index: int, device: str) -> Path:
    return out_dir / "logs" / f"worker-{index}-{device.replace(':', '')}.log"


def sweep_worker(index: int, device: str, settings: RunSettings, suite: bytes, inbox, outbox) -> None:
    """One device's share of a sweep, in its own (spawned) process.

    Loads the model on `device` once, then runs each config `inbox` hands over (None: stop) with
    `run_sweep`, which writes its run file as a sequential sweep does. Its stdout and stderr go to
    `worker_log`. Reports on `outbox`: ``("ready", index)`` once loaded, ``("done", index, name)``
    after each config, ``("error", index, name or None, traceback)`` on a failure (and returns).

    Args:
        suite: the pickled `TaskSuite` the dispatcher prepared (tasks are prepared once).
    """
    from datetime import datetime, timezone

    log = worker_log(settings.out_dir, index, device)
    log.parent.mkdir(parents=True, exist_ok=True)
    stream = open(log, "a", buffering=1)
    os.dup2(stream.fileno(), 1)
    os.dup2(stream.fileno(), 2)
    for std in (sys.stdout, sys.stderr):
        std.reconfigure(line_buffering=True)
    print(f"== {datetime.now(timezone.utc).isoformat(timespec='seconds')} worker {index} on {device}")
    name = None
    try:
        from hshare.default_model import load_model

        use_device(device)
        model, tokenizer = load_model(settings.model, settings.gguf_file, settings.dtype, device)
        evaluate_one = settings.evaluator(model, tokenizer, pickle.loads(suite))
        meta = {**settings.record_meta, "device": str(model.device)}
        outbox.put(("ready", index))
        for entry in iter(inbox.get, None):
            name = entry.name
            print(f"== {name}")
            run_sweep(SweepSpec([entry]), evaluate_one, settings.out_dir, settings.tasks, settings.limit, meta,
                      dense_fallback=settings.dense_fallback)
            outbox.put(("done", index, name))
            name = None
    except BaseException:  # noqa: BLE001 - reported to the dispatcher, which decides
        traceback.print_exc()
        outbox.put(("error", index, name, traceback.format_exc()))


def run_parallel(entries: list[SweepEntry], devices: list[str], settings: RunSettings, suite: Any,
                 progress: Callable[[str, str], None] | None = None) -> None:
    """Run `entries` over `devices`: one `sweep_worker` process per device (no more than there are
    entries), each config to the first idle worker. Run files are written by the workers; read
    them with `finished`.

    Args:
        suite: the `TaskSuite` every worker uses (pickled to them).
        progress: called with (config name, "run" | "done").

    Raises:
        SystemExit: a config (or loading the model on a device) failed; raised once the configs
            running on the other devices have finished, and none is started after the failure.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    todo = list(entries)
    blob = pickle.dumps(suite)
    outbox = ctx.Queue()
    inboxes, workers = [], []
    for index, device in enumerate(devices[:len(todo)]):
        inboxes.append(ctx.SimpleQueue())
        workers.append(ctx.Process(target=sweep_worker, name=f"hshare-sweep-{index}-{device}",
                                   args=(index, device, settings, blob, inboxes[index], outbox)))
        workers[-1].start()
    running: dict[int, str | None] = {i: None for i in range(len(workers))}  # live worker -> its config
    failure: tuple[str | None, int, str] | None = None

    def hand_out(i: int) -> None:
        if todo and failure is None:
            entry = todo.pop(0)
            inboxes[i].put(entry)
            running[i] = entry.name
            if progress:
                progress(entry.name, "run")
        else:
            inboxes[i].put(None)
            del running[i]

    completed = False
    try:
        while running:
            try:
                message = outbox.get(timeout=1.0)
            except queue.Empty:
                for i in [i for i in running if not workers[i].is_alive()]:
                    failure = failure or (running[i], i, f"the worker exited with code {workers[i].exitcode}")
                    del running[i]
                continue
            kind, i = message[0], message[1]
            if kind == "error":
                failure = failure or (message[2], i, message[3])
                running.pop(i, None)
                continue
            if kind == "done" and progress:
                progress(message[2], "done")
            hand_out(i)
        completed = True
    finally:
        for worker in workers:
            if not completed and worker.is_alive():
                worker.terminate()
            worker.join()
    if failure is not None:
        name, i, trace = failure
        what = f"config {name!r}" if name else "loading the model"
        print(trace, file=sys.stderr)
        raise SystemExit(f"hshare sweep: {what} failed on {devices[i]} (log: "
                         f"{worker_log(settings.out_dir, i, devices[i])}); no config was started after it, "
                         "the finished runs are kept: run the same command again to resume")


# ---- the command ------------------------------------------------------------------------------

def add_sweep_parser(subparsers) -> None:
    sweep = subparsers.add_parser("sweep", help="every config of a sweep file on lm-eval tasks (resumable)")
    sweep.add_argument("--configs", required=True, help="a sweep YAML (configs/sweeps/<name>.yaml) or its name")
    sweep.add_argument("--tasks", help="comma-separated lm-eval tasks (default: the sweep file's)")
    sweep.add_argument("--model", help="a model directory or hub id (default: the embedded SmolLM2)")
    sweep.add_argument("--gguf-file", help="a GGUF file inside --model")
    sweep.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, ...")
    sweep.add_argument("--device", help="cuda, cpu, cuda:1 (default: CUDA when present)")
    sweep.add_argument("--devices", help="spread the configs over several devices, one worker process (and model "
                                         "copy) per device: cuda:0,cuda:1, or auto (every visible CUDA device); "
                                         "worker logs in OUT/logs")
    sweep.add_argument("--data-dir", help="local task data (default: $HSHARE_DATA_DIR, else the hub)")
    sweep.add_argument("--ruler-lengths", help="RULER tasks: token lengths, e.g. 4k,8k (default: lm-eval's)")
    sweep.add_argument("--limit", type=float, help="documents per task (an integer, or a fraction < 1)")
    sweep.add_argument("--batch-size", type=int, default=8)
    sweep.add_argument("--num-fewshot", type=int)
    sweep.add_argument("--gen-kwargs", help="lm-eval generation kwargs, e.g. max_gen_toks=128")
    sweep.add_argument("--dense-fallback", action="store_true",
                       help="keep each config's dense fallback of small steps (default off)")
    sweep.add_argument("--log-samples", action="store_true", help="keep per-document outputs in the run files")
    sweep.add_argument("--out", default="sweep-results", help="output directory (default sweep-results)")
    sweep.add_argument("--report", action="store_true",
                       help="only rebuild the table and plot from the finished runs in --out (no model)")
    sweep.set_defaults(run=main_sweep)


def _limit(value: float | None) -> int | float | None:
    if value is None:
        return None
    return int(value) if value >= 1 else value


def main_sweep(args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    from tqdm.auto import tqdm

    from hshare.default_model import load_model
    from hshare.eval.harness import TaskSuite

    spec = load_sweep(args.configs)
    tasks = args.tasks.split(",") if args.tasks else spec.tasks
    if not tasks:
        raise SystemExit(f"hshare sweep: no tasks; pass --tasks or list them under 'tasks:' in {spec.source}")
    out_dir = Path(args.out)
    limit = _limit(args.limit)
    if args.report:
        records = [json.loads(run_path(out_dir, e).read_text()) for e in spec.entries if run_path(out_dir, e).is_file()]
        if not records:
            raise SystemExit(f"hshare sweep --report: no finished runs under {out_dir / RUNS}")
        return _report(records, out_dir, {"sweep": spec.source, "tasks": tasks, "runs": len(records),
                                          "of": len(spec.entries)})
    devices = parse_devices(getattr(args, "devices", None))
    if devices and args.device:
        raise SystemExit("hshare sweep: give --device (one device) or --devices (several), not both")
    model_name = args.model or "SmolLM2-135M-Instruct (embedded)"
    settings = RunSettings(tasks=tasks, limit=limit, out_dir=out_dir, model=args.model, gguf_file=args.gguf_file,
                           dtype=args.dtype, batch_size=args.batch_size, num_fewshot=args.num_fewshot,
                           gen_kwargs=args.gen_kwargs, dense_fallback=args.dense_fallback,
                           log_samples=args.log_samples,
                           record_meta={"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                        "model": model_name})
    if len(devices) > 1:
        return _main_parallel(args, spec, settings, devices)
    device = devices[0] if devices else args.device
    use_device(device)
    model, tokenizer = load_model(args.model, args.gguf_file, args.dtype, device)
    gen_kwargs = args.gen_kwargs
    meta = {"model": model_name, "dtype": str(model.dtype),
            "device": str(model.device), "sweep": spec.source, "tasks": tasks, "limit": limit,
            "data_dir": args.data_dir or os.environ.get("HSHARE_DATA_DIR"), "gen_kwargs": gen_kwargs,
            "dense_fallback": args.dense_fallback}

    suite = TaskSuite.prepare(tasks, args.data_dir, out_dir / "tasks",
                              _ruler_options(args, {"pretrained": model, "tokenizer": tokenizer}))
    evaluate_one = settings.evaluator(model, tokenizer, suite)

    with tqdm(total=len(spec.entries), desc="sweep", unit="config") as bar:
        def progress(name: str, what: str) -> None:
            bar.set_postfix_str(name)
            if what in ("skip", "done"):
                bar.update(1)

        records = run_sweep(spec, evaluate_one, out_dir, tasks, limit,
                            {**settings.record_meta, "device": meta["device"]}, progress, args.dense_fallback)
    return _report(records, out_dir, meta)


def _ruler_options(args: argparse.Namespace, model_args: dict):
    """The `hshare.eval.ruler.RulerOptions` of the sweep's RULER tasks: ``--ruler-lengths`` and the evaluated
    model (its tokenizer sizes the documents)."""
    from hshare.eval.ruler import RulerOptions, parse_lengths

    lengths = None if args.ruler_lengths is None else parse_lengths(args.ruler_lengths)
    return RulerOptions(lengths=lengths, model_args={k: v for k, v in model_args.items() if v is not None})


def _main_parallel(args: argparse.Namespace, spec: SweepSpec, settings: RunSettings, devices: list[str]) -> int:
    """`main_sweep` over several devices: the unfinished configs to `run_parallel`, then the report
    from every run file."""
    import torch
    from tqdm.auto import tqdm

    from hshare.default_model import torch_dtype
    from hshare.eval.harness import TaskSuite

    out_dir, tasks, limit = settings.out_dir, settings.tasks, settings.limit
    first = torch.device(devices[0])
    meta = {"model": settings.record_meta["model"],
            "dtype": str(torch_dtype(args.dtype, torch.bfloat16 if first.type == "cuda" else torch.float32)),
            "device": ",".join(devices), "sweep": spec.source, "tasks": tasks, "limit": limit,
            "data_dir": args.data_dir or os.environ.get("HSHARE_DATA_DIR"), "gen_kwargs": args.gen_kwargs,
            "dense_fallback": args.dense_fallback}
    with tqdm(total=len(spec.entries), desc="sweep", unit="config") as bar:
        pending = []
        for entry in spec.entries:
            if finished(out_dir, entry, tasks, limit, args.dense_fallback) is None:
                pending.append(entry)
            else:
                bar.update(1)
        if pending:
            if args.model is None:
                _convert_default_model()  # once, before the workers load it
            model_args = {} if args.model is None else {"pretrained": args.model, "gguf_file": args.gguf_file}
            suite = TaskSuite.prepare(tasks, args.data_dir, out_dir / "tasks", _ruler_options(args, model_args))
            workers = min(len(devices), len(pending))
            bar.write(f"hshare sweep: {len(pending)} config(s) over {workers} worker(s) on "
                      f"{', '.join(devices[:workers])}; their logs: {out_dir / 'logs'}")
            running: list[str] = []

            def progress(name: str, what: str) -> None:
                if what == "run":
                    running.append(name)
                else:
                    running.remove(name)
                    bar.update(1)
                bar.set_postfix_str(", ".join(running))

            run_parallel(pending, devices, settings, suite, progress)
    records = [finished(out_dir, e, tasks, limit, args.dense_fallback) for e in spec.entries]
    missing = [e.name for e, r in zip(spec.entries, records) if r is None]
    if missing:
        raise SystemExit(f"hshare sweep: no run file for {missing} under {out_dir / RUNS} after the workers ended")
    return _report(records, out_dir, meta)


def _convert_default_model() -> None:
    """Convert the embedded model once (`hshare.default_model`), so that workers only load it."""
    from hshare.default_model import MODEL_NAME, cache_dir, load_default_model

    if not (cache_dir() / MODEL_NAME / "config.json").is_file():
        load_default_model()


def _report(records: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> int:
    rows = summarize(records)
    written = write_tables(rows, out_dir, meta)
    png = plot_sweep(rows, out_path=out_dir / "sweep.png")
    print((out_dir / "sweep.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written + ([png] if png else [])))
    return 0
