"""``hshare sweep``: every config of a sweep file on lm-eval tasks, resumable, with a table and a plot.

    hshare sweep --configs configs/sweeps/paper.yaml --tasks longbench_multi_news --limit 20 --out sweep/

The model is loaded once; each config runs `hshare.eval.harness.evaluate` and its result is written
to ``<out>/runs/<config>.json`` as soon as it finishes, so an interrupted sweep resumes where it
stopped (a finished config is skipped when its tasks, limit and config fields are unchanged).
Then ``<out>/sweep.md``, ``sweep.csv``, ``sweep.json`` and ``sweep.png`` (score against attention
cost, the paper's Fig. 4 style) are written from every run file.

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
from pathlib import Path
from typing import Any, Callable

from hshare.eval.harness import evaluation_config
from hshare.eval.sweep_spec import SweepEntry, SweepSpec, load_sweep

RUNS = "runs"


def run_path(out_dir: Path, entry: SweepEntry) -> Path:
    return out_dir / RUNS / f"{entry.file_stem}.json"


def _identity(entry: SweepEntry, tasks: list[str], limit: Any, dense_fallback: bool = False) -> dict[str, Any]:
    """What must match for a finished run to be reused: tasks, limit, and the config that runs."""
    config = dataclasses.asdict(evaluation_config(entry.config(), dense_fallback=dense_fallback))
    config.pop("name", None)
    return {"tasks": sorted(tasks), "limit": limit, "config": json.loads(json.dumps(config, default=str))}


def finished(out_dir: Path, entry: SweepEntry, tasks: list[str], limit: Any,
             dense_fallback: bool = False) -> dict[str, Any] | None:
    """The saved run of `entry` if it was made with the same tasks, limit and config, else None."""
    path = run_path(out_dir, entry)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return saved if saved.get("identity") == _identity(entry, tasks, limit, dense_fallback) else None


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
    """One row per config: primary metric per task, its share of `reference`'s, and the costs."""
    ref = next((r for r in records if r["name"] == reference), None)
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


# ---- the command ------------------------------------------------------------------------------

def add_sweep_parser(subparsers) -> None:
    sweep = subparsers.add_parser("sweep", help="every config of a sweep file on lm-eval tasks (resumable)")
    sweep.add_argument("--configs", required=True, help="a sweep YAML (configs/sweeps/<name>.yaml) or its name")
    sweep.add_argument("--tasks", help="comma-separated lm-eval tasks (default: the sweep file's)")
    sweep.add_argument("--model", help="a model directory or hub id (default: the embedded SmolLM2)")
    sweep.add_argument("--gguf-file", help="a GGUF file inside --model")
    sweep.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, ...")
    sweep.add_argument("--device", help="cuda, cpu, cuda:1 (default: CUDA when present)")
    sweep.add_argument("--data-dir", help="local task data (default: $HSHARE_DATA_DIR, else the hub)")
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
    from hshare.eval.harness import TaskSuite, evaluate

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
    model, tokenizer = load_model(args.model, args.gguf_file, args.dtype, args.device)
    gen_kwargs = args.gen_kwargs
    meta = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "dtype": str(model.dtype),
            "device": str(model.device), "sweep": spec.source, "tasks": tasks, "limit": limit,
            "data_dir": args.data_dir or os.environ.get("HSHARE_DATA_DIR"), "gen_kwargs": gen_kwargs,
            "dense_fallback": args.dense_fallback}

    suite = TaskSuite.prepare(tasks, args.data_dir, out_dir / "tasks")

    def evaluate_one(entry: SweepEntry):
        return evaluate(model, tokenizer, entry.config(), suite, limit=limit, batch_size=args.batch_size,
                        num_fewshot=args.num_fewshot, gen_kwargs=gen_kwargs, dense_fallback=args.dense_fallback,
                        log_samples=args.log_samples)

    with tqdm(total=len(spec.entries), desc="sweep", unit="config") as bar:
        def progress(name: str, what: str) -> None:
            bar.set_postfix_str(name)
            if what in ("skip", "done"):
                bar.update(1)

        records = run_sweep(spec, evaluate_one, out_dir, tasks, limit,
                            {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             "model": meta["model"], "device": meta["device"]}, progress, args.dense_fallback)
    return _report(records, out_dir, meta)


def _report(records: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> int:
    rows = summarize(records)
    written = write_tables(rows, out_dir, meta)
    png = plot_sweep(rows, out_dir / "sweep.png")
    print((out_dir / "sweep.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written + ([png] if png else [])))
    return 0
