"""Decode speed over a grid of shapes in one run: ``python -m hshare.bench.grid``.

For each model shape, every ``(rows, prompt)`` of the grid runs every path (`hshare.bench.generate`,
one model built per shape for the longest prompt, ``static`` in a process of its own), timed per step
by default (``--timing steps``: one prefill per path and shape). Shapes whose estimated peak memory
exceeds the device's are skipped with what they need. Printed at the end, and written beside the JSON
as Markdown:

* every row: decode tok/s, against ``static`` (else ``dense``), the roofline (bytes a step must read,
  the floor rate at the bandwidth a device copy reached in the same run, the share of it reached),
  peak memory (and whether it is above ``static``'s), prefill time;
* with ``dense`` and sparse paths: the crossover table, per shape the dense rate, each sparse path's
  rate and ratio to dense, and which of the two the path's config *without* its ``dense_fallback_mib``
  override would run (the rule of `HShareConfig.runtime.dense_fallback_mib`: a decode step whose per-layer KV,
  rows x columns x K and V, is below the threshold runs dense) and whether that is the faster one.
  Run the sparse paths with ``+dense_fallback_mib=0`` so that they decode sparsely at every size::

    python -m hshare.bench.grid --shapes llama3-8b,llama2-7b --rows 1,4,16,64 --prompts 1k,4k,16k,32k,128k \\
        --paths dense,hshare-1_2-1_2-1_2@512+dense_fallback_mib=0 --new-tokens 32 --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hshare.bench import generate, roofline
from hshare.bench.generate import GenerateRow
from hshare.bench.results import environment
from hshare.config import split_overrides

RIGHT_SHARE = 0.95  # the default config of a preset reaches this share of the faster of its sparse and dense paths


def parse_tokens(text: str) -> int:
    """A token count: ``"4096"``, or with a ``k`` suffix (x 1024): ``"4k"``, ``"128k"``."""
    value = text.strip().lower()
    scale = 1024 if value.endswith("k") else 1
    digits = value[:-1] if scale > 1 else value
    if not digits.isdigit() or int(digits) < 1:
        raise ValueError(f"{text!r} is not a token count; accepted: a positive integer, optionally with a k "
                         "suffix (x 1024), e.g. 4096 or 4k")
    return int(digits) * scale


def parse_axis(text: str) -> list[int]:
    """A comma-separated list of token counts (`parse_tokens`), in the order given, without repeats."""
    values = [parse_tokens(part) for part in text.split(",") if part.strip()]
    if not values:
        raise ValueError(f"{text!r} names no value; accepted: comma-separated counts, e.g. 1,4,16 or 1k,4k")
    return list(dict.fromkeys(values))


def grid_cells(rows: list[int], prompts: list[int]) -> list[tuple[int, int]]:
    """Every ``(rows, prompt)``, smallest KV (rows x prompt) first, so that a run cut short by its time
    limit has measured the most shapes."""
    return sorted(itertools.product(rows, prompts), key=lambda cell: (cell[0] * cell[1], cell[1]))


def default_runs(path: str, model_config, rows: int, prompt: int, new_tokens: int, element_bytes: int,
                 device: torch.device) -> str:
    """What the path's config without its ``dense_fallback_mib`` override runs at this shape under CUDA graphs
    (`hshare.step.StepPlanner.sparse_pays`): ``"dense"`` (a sparse step would not save enough K/V reads even at
    the reserve, rows x (prompt + N - 1 - N_c) columns: dense throughout), ``"sparse"`` (already the first
    step's saving is enough), ``"mixed"`` (the steps cross it), or ``"-"`` for a dense config (or no config)."""
    config = generate.path_config(path, without=("dense_fallback_mib",))
    if config is None or not config.sparse:
        return "-"
    threshold = config.sparse_min_saved_bytes(device, graphs=True)
    token = roofline.kv_token_bytes(model_config, element_bytes)
    if config.sparse_saved_bytes(rows, prompt + new_tokens - 1, token) < threshold:
        return "dense"
    return "sparse" if config.sparse_saved_bytes(rows, prompt + 1, token) >= threshold else "mixed"


def _rate(row: GenerateRow) -> str:
    return row.error.split(":")[0] if row.error else f"{row.decode_tok_s:.1f}"


def rows_table(rows: list[GenerateRow]) -> list[str]:
    """Markdown lines, one per row: rate, ratio to the cell's ``static`` (else ``dense``) row, roofline,
    peak memory (``!`` above ``static``'s), prefill."""
    lines = ["| shape | B | prompt | path | decode tok/s | vs | GB/step | floor tok/s | of floor | peak GiB "
             "| prefill s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, cell in itertools.groupby(rows, key=lambda r: (r.shape, r.batch, r.prompt)):
        cell = list(cell)
        base = next((r for r in cell if r.path == "static" and not r.error),
                    next((r for r in cell if r.path == "dense" and not r.error), None))
        static = next((r for r in cell if r.path == "static" and not r.error), None)
        for row in cell:
            ratio = f"{row.decode_tok_s / base.decode_tok_s:.2f}x {base.path}" \
                if base is not None and not row.error and base.decode_tok_s else "-"
            above = "!" if static is not None and not row.error and row.peak_gib > static.peak_gib else ""
            floor = (f"{row.step_gb:.1f} | {row.floor_tok_s:.0f} | {row.floor_share:.0%}" if row.floor_tok_s
                     else "- | - | -")
            measured = "- | -" if row.error else f"{row.peak_gib:.2f}{above} | {row.prefill_s:.2f}"
            lines.append(f"| {row.shape} | {row.batch} | {row.prompt} | {row.path} | {_rate(row)} | {ratio} | {floor}"
                         f" | {measured} |")
    return lines


def crossover_table(rows: list[GenerateRow], model_configs: dict, element_bytes: int,
                    device: torch.device) -> list[str]:
    """Markdown lines, one per ``(shape, rows, prompt)``: per-layer KV at the prompt, ``dense``'s rate, and
    for each sparse path its rate, its ratio to dense and what its config's default would run
    (`default_runs`); for a path that runs sparse at every size (``dense_fallback_mib=0``), ``(right)`` when the
    default's choice reaches `RIGHT_SHARE` of the faster of the two rates, ``(wrong)`` when not. Empty
    without a ``dense`` row and a sparse path. `model_configs`: each shape's model config."""
    paths = list(dict.fromkeys(r.path for r in rows))
    sparse_paths = [p for p in paths if getattr(generate.path_config(p), "sparse", False)]
    forced_sparse = {p: generate.path_config(p).runtime.dense_fallback_mib == 0 for p in sparse_paths}
    if "dense" not in paths or not sparse_paths:
        return []
    header = "| shape | B | prompt | KV/layer MiB | dense tok/s |" + "".join(
        f" {p} tok/s | x dense | default runs |" for p in sparse_paths)
    lines = [header, "|" + "---|" * (5 + 3 * len(sparse_paths))]
    for (shape, batch, prompt), cell in itertools.groupby(rows, key=lambda r: (r.shape, r.batch, r.prompt)):
        by_path = {r.path: r for r in cell}
        config = model_configs[shape]
        dense = by_path.get("dense")
        layer_kv = batch * prompt * roofline.kv_token_bytes(config, element_bytes) / 2**20
        line = f"| {shape} | {batch} | {prompt} | {layer_kv:.4g} | {_rate(dense) if dense else '-'} |"
        for path in sparse_paths:
            row = by_path.get(path)
            new_tokens = row.new_tokens if row is not None else 0
            runs = default_runs(path, config, batch, prompt, new_tokens, element_bytes, device)
            measured = row is not None and not row.error and dense is not None and not dense.error
            ratio = row.decode_tok_s / dense.decode_tok_s if measured and dense.decode_tok_s else None
            verdict = ""
            if ratio is not None and runs in ("dense", "sparse") and forced_sparse[path]:
                chosen = ratio if runs == "sparse" else 1.0  # the chosen path's rate over dense's
                verdict = " (right)" if chosen >= RIGHT_SHARE * max(ratio, 1.0) else " (wrong)"
            line += (f" {_rate(row) if row else '-'} | {f'{ratio:.2f}x' if ratio is not None else '-'} |"
                     f" {runs}{verdict} |")
        lines.append(line)
    return lines


def run_grid(out: Path, shapes: list[str], rows: list[int], prompts: list[int], paths: list[str], new_tokens: int,
             repeats: int = 1, timing: str = "steps", padded: bool = False, layers: int | None = None,
             device: str = "cuda", dtype: torch.dtype = torch.bfloat16, free_bytes: float | None = None,
             time_limit_s: float | None = None, name: str = "bench_grid", rounds: int = 1) -> dict:
    """Every path at every ``(rows, prompt)`` of each shape (`generate.bench_cells`); writes ``NAME.json``
    after every row and ``NAME.md`` (the tables) at the end, prints the tables, and returns the results.

    Args:
        padded: one row in four left-padded (off by default: decode rates do not depend on it, and a
            padded prompt's quadratic mask costs prefill time and memory the grid does not measure).
        free_bytes: memory a shape may use (None: the device's free memory; on the CPU nothing is skipped).
        time_limit_s: no path starts after this many seconds from the start (its row says so).
        rounds: each cell's paths measured this many times in turn, every other round in reverse order; a row
            keeps every round's runs and their median (`generate.bench_cells`).
    """
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    element_bytes = torch.finfo(dtype).bits // 8
    cells = grid_cells(rows, prompts)
    measured: list[GenerateRow] = []
    model_configs = {}
    out.mkdir(parents=True, exist_ok=True)
    settings = {"shapes": shapes, "rows": rows, "prompts": prompts, "paths": paths, "new_tokens": new_tokens,
                "repeats": repeats, "rounds": rounds, "timing": timing, "padded": padded, "layers": layers}

    def results_of(done: list[GenerateRow]) -> dict:
        return {"env": environment(), "grid": settings, "generate": [asdict(r) for r in done]}

    for shape in shapes:
        print(f"grid: {shape}{f' ({layers} layers)' if layers else ''}, B x prompt {cells}, {new_tokens} new tokens,"
              f" {dtype}, {device}, timing {timing}")
        model_configs[shape] = generate.model_config(shape, layers, max(prompts) + new_tokens + 8)[1]
        shape_rows = generate.bench_cells(
            shape, cells, new_tokens, paths, layers=layers, device=device, dtype=dtype, repeats=repeats, timing=timing,
            padded=padded, free_bytes=free_bytes, deadline=deadline, rounds=rounds,
            progress=lambda now: (out / f"{name}.json").write_text(json.dumps(results_of(measured + now), indent=1)))
        measured.extend(shape_rows)
        generate.release_memory(device)
    results = results_of(measured)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    tables = rows_table(measured)
    crossover = crossover_table(measured, model_configs, element_bytes, torch.device(device))
    if crossover:
        tables += ["", f"crossover ({new_tokens} new tokens, timing {timing}; default runs: the config without its "
                       "dense_fallback_mib override on this device)", ""] + crossover
    (out / f"{name}.md").write_text("\n".join(tables) + "\n")
    print("\n".join(tables))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hshare.bench.grid",
                                     description="generate's decode speed over a grid of rows x prompt lengths per "
                                                 "model shape, with the roofline and the dense-fallback crossover")
    parser.add_argument("--shapes", default="llama3-8b", help=f"comma-separated, of: {', '.join(generate.SHAPES)}")
    parser.add_argument("--rows", default="1,4,16,64", help="comma-separated batch sizes (default 1,4,16,64)")
    parser.add_argument("--prompts", default="1k,4k,16k,32k,128k",
                        help="comma-separated prompt lengths, k = 1024 (default 1k,4k,16k,32k,128k)")
    parser.add_argument("--paths", default="dense,hshare-1_2-1_2-1_2@512+dense_fallback_mib=0",
                        help="comma-separated paths: unpatched, static, presets with +FIELD=VALUE overrides "
                             "(default dense,hshare-1_2-1_2-1_2@512+dense_fallback_mib=0)")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per generate (default 32)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per path (default 1)")
    parser.add_argument("--rounds", type=generate.rounds_arg, default=1,
                        help="the paths measured this many times in turn, every other round reversed (A B, B A, "
                             "...): a row's rate is the median over its rounds (default 1)")
    parser.add_argument("--timing", choices=generate.TIMINGS, default="steps",
                        help="steps: per-token times of one generate (default); pairs: 1-token and N-token generates")
    parser.add_argument("--padded", action="store_true", help="left-pad one row in four (default: no padding)")
    parser.add_argument("--layers", type=int, default=None, help="cut the models to this many layers")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="memory a shape may use (default: the GPU's free memory; CPU: no limit)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds after which no path starts")
    parser.add_argument("--name", default="bench_grid", help="file name of the JSON and Markdown (default bench_grid)")
    parser.add_argument("--out", default="bench-results", help="directory for the results (default bench-results)")
    parser.add_argument("--smoke", action="store_true",
                        help="checks the grid runs: the tiny shape in float32 on the CPU, rows 1,2, prompts 40,80, "
                             "4 new tokens")
    args = parser.parse_args(argv)
    try:
        shapes = [s for s in args.shapes.split(",") if s]
        unknown = [s for s in shapes if s not in generate.SHAPES]
        if unknown:
            raise ValueError(f"--shapes: unknown {', '.join(unknown)}; accepted: {', '.join(generate.SHAPES)}")
        rows, prompts = parse_axis(args.rows), parse_axis(args.prompts)
        if args.smoke:
            shapes, rows, prompts, args.new_tokens = ["tiny"], [1, 2], [40, 80], 4
        paths = [p for p in args.paths.split(",") if p]
        for path in paths:
            split_overrides(path)
        generate.check_paths(paths)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    on_gpu = torch.cuda.is_available() and not args.smoke
    run_grid(Path(args.out), shapes, rows, prompts, paths, args.new_tokens, args.repeats,
             args.timing, args.padded, args.layers, "cuda" if on_gpu else "cpu",
             torch.bfloat16 if on_gpu else torch.float32,
             None if args.memory_gib is None else args.memory_gib * roofline.GIB, args.time_limit, args.name,
             args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
