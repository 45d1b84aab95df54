"""``hshare plan``: the sharing plan each config makes on a text, layer by layer, before any evaluation.

    hshare plan --text war_and_peace.txt --length 2k --configs \\
        hshare-refine-successors-c4@512,hshare-refine-successors-c4@512+planner=auto+share_scorings=1/3+layer_sharing=1/8

Each config is patched into the model; `--batch` windows of the text (spread as `hshare fidelity` spreads
them) are prefilled on a fresh cache and one token decoded, which plans the sharing from that prefill's
evidence exactly as ``generate`` would; the plan is then read off the cache (`HShareCache.planner.sharing`).
Printed per config: its summary (`SharingPlan.summary`: layer copies, head copies, the share of (layer,
selection head) pairs that score the whole context), then one line per layer: ``dense``, the layer it copies,
or its selection heads' sources (``0 0 2``: head 1 copies head 0). A per-sample plan (``plan_scope: sample``)
prints one such block per row. ``--json`` writes every plan's sources and summary.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from hshare.eval.fidelity import (
    check_lengths, forced_decode_logits, parse_configs, parse_lengths, parse_override, resolve_configs,
    text_token_ids, window_offsets,
)
from hshare.step import StepPlanner


@dataclass
class ConfigPlan:
    """The plan one config made on one batch of windows.

    Attributes:
        config: the config's label; length, windows: the windows' tokens and count.
        layer_source: ``[P][L]`` each layer's source layer (itself where it selects or is dense); P = 1
            for a batch plan, the rows for a per-sample one (a config without sharing: every layer and
            head its own source). Empty for a config without a plan (dense).
        head_source: ``[L][P][H]`` each selection head's source head.
        sparse_layers: the layers that decode sparsely; the others are dense.
        summary: `SharingPlan.summary` (empty without a plan).
    """

    config: str
    length: int
    windows: int
    layer_source: list[list[int]]
    head_source: list[list[list[int]]]
    sparse_layers: list[int]
    summary: dict[str, float]


def plan_lines(plan: ConfigPlan) -> list[str]:
    """The plan as text: a header with its summary, then per plane one line a layer."""
    head = f"{plan.config}: {plan.windows} window(s) of {plan.length} tokens"
    if not plan.layer_source:
        return [f"{head}: no sharing plan (a dense config)"]
    s = plan.summary
    lines = [f"{head}: {s['layer_copies']:g} layer copies, {s['head_copies']:g} head copies, "
             f"{s['selecting']:.3f} of the (layer, selection head) pairs score the whole context"]
    planes = len(plan.layer_source)
    sparse = set(plan.sparse_layers)
    for p, sources in enumerate(plan.layer_source):
        if planes > 1:
            lines.append(f"row {p}:")
        for layer, source in enumerate(sources):
            if layer not in sparse:
                what = "dense"
            elif source != layer:
                what = f"copies layer {source}"
            else:
                what = "selects, head sources " + " ".join(str(h) for h in plan.head_source[layer][p])
            lines.append(f"  layer {layer:>3}: {what}")
    return lines


def _read_plan(label: str, windows: torch.Tensor, planner: StepPlanner) -> ConfigPlan:
    sharing = planner.sharing
    return ConfigPlan(label, windows.shape[1], windows.shape[0], [] if sharing is None else sharing.layer_source.tolist(),
                      [] if sharing is None else sharing.head_source.tolist(), list(planner.sparse_layers),
                      planner.sharing_summary())


def measure_plans(model, tokenizer_or_ids, text: str | None, length: int, configs: Sequence, batch: int = 1,
                  overrides: dict[str, Any] | None = None) -> list[ConfigPlan]:
    """The plan each config makes on `batch` windows of `length` tokens of the text (`window_offsets`).

    Args:
        model: a Llama / Mistral causal LM, patched or not (its patch state is restored at the end).
        tokenizer_or_ids, text: a tokenizer and the text, or ``[N]`` token ids and None (`text_token_ids`).
        configs: preset names, YAML paths or `HShareConfig` objects; overrides: fields for every config
            (``dense_fallback_mib`` is 0 unless given: the plan of the sparse path).
        batch: windows prefilled together; a batch plan pools their evidence.
    """
    from hshare.api import new_cache, patched

    if batch < 1 or length < 1:
        raise ValueError(f"batch = {batch}, length = {length}; accepted: integers >= 1")
    check_lengths(model, [length], 2)
    resolved = resolve_configs(configs, dict(overrides or {}))
    ids = text_token_ids(tokenizer_or_ids, text)
    windows = torch.stack([ids[o:o + length] for o in window_offsets(len(ids), length, batch)])
    plans = []
    for label, config in resolved:
        with patched(model, config):
            cache = new_cache(model)
            forced_decode_logits(model, windows, windows[:, :2], cache)  # the prefill and a decode step: planned
            plans.append(_read_plan(label, windows, cache.planner))
    return plans


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command to `subparsers` (``hshare plan``); it runs `run_plan`."""
    p = subparsers.add_parser("plan", help="the sharing plan each config makes on a text, layer by layer",
                              description="Prefill windows of a text with each config and print the sharing plan "
                                          "its planner made: which layer each layer copies, which head each head "
                                          "copies, and the share of pairs that score the whole context.")
    p.add_argument("--text", required=True, help="a plain-text file (e.g. War and Peace)")
    p.add_argument("--length", required=True, type=parse_lengths, help="the windows' length in tokens, e.g. 2k (k = 1024)")
    p.add_argument("--configs", required=True, type=parse_configs,
                   help="comma-separated presets, YAML paths or sweep:<sweep file or name>")
    p.add_argument("--batch", type=int, default=1, help="windows prefilled together (default 1)")
    p.add_argument("--model", help="a local directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--gguf-file", help="a GGUF file inside --model")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, ...")
    p.add_argument("--device", help="cuda, cpu, ... (default: CUDA when present)")
    p.add_argument("--set", dest="overrides", type=parse_override, action="append", default=[], metavar="FIELD=VALUE",
                   help="an HShareConfig option (flat or dotted name) for every config (repeatable)")
    p.add_argument("--json", help="also write the plans (sources and summaries) to this JSON file")
    p.set_defaults(run=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """The ``hshare plan`` command."""
    from hshare.default_model import load_model

    if len(args.length) != 1:
        raise SystemExit(f"hshare plan --length: {len(args.length)} lengths given; accepted: one")
    text = Path(args.text).read_text(encoding="utf-8")
    model, tokenizer = load_model(pretrained=args.model, gguf_file=args.gguf_file, dtype=args.dtype,
                                  device=args.device)
    plans = measure_plans(model, tokenizer, text, args.length[0], args.configs, batch=args.batch,
                          overrides=dict(args.overrides))
    print("\n\n".join("\n".join(plan_lines(plan)) for plan in plans))
    if args.json:
        Path(args.json).write_text(json.dumps([plan.__dict__ for plan in plans], indent=1))
        print(f"wrote {args.json}")
    return 0
