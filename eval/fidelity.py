"""How close a sparse generation stays to dense decoding, and GSM8K answer checks.

A 135M model scores near the floor on GSM8K, so the demo reports agreement with dense decoding
(the quantity sparse attention can change) next to accuracy.

``hshare fidelity`` (`measure_fidelity`, `add_fidelity_parser`): dense's own greedy continuation
of windows of a long text is forced, token by token, through each config's real decode path
(q_len == 1 forwards on a fresh `HShareCache`: the patched attention's decode step, query groups,
plan), and each step's next-token distribution is compared with dense's: top-1 agreement and mean
KL(dense || config). Forcing one continuation isolates the attention approximation from error
compounding and needs no labels.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from hshare import compat
from hshare.counters import WorkTotals

# ---- forced-continuation fidelity against dense decoding -------------------------------------

FIDELITY_FILES = ("fidelity.json", "fidelity.csv", "fidelity.md", "fidelity.png")


@dataclass
class FidelityResult:
    """Fidelity of one config at one context length, over all windows and steps.

    Attributes:
        config: the config's label (the preset name or path as given, or `HShareConfig.name`).
        length: context tokens before the first forced step.
        windows: text windows measured; steps: forced continuation tokens per window.
        predictions: next-token distributions compared (windows x steps).
        agreement: fraction of steps whose argmax equals dense's (dense's greedy token).
        kl: mean KL(dense || config) in nats, from float64 log-softmax.
        budget: N_c = sink + local + heavy of a sparse config, None for a dense one.
        stats: the config's cache counters summed over the windows (`dataclasses.asdict` of
            `HShareCache.stats`: decode_steps, score_computations, ...).
        plan: what its sharing plan shares, the mean over the batches' plans (`SharingPlan.summary`:
            layer_copies, head_copies, selecting); empty for a dense config.
    """

    config: str
    length: int
    windows: int
    steps: int
    predictions: int
    agreement: float
    kl: float
    budget: int | None = None
    stats: dict[str, int] = field(default_factory=dict)
    plan: dict[str, float] = field(default_factory=dict)


def _new_decode_cache(model):
    """A fresh `HShareCache` when `model` is patched, else a transformers `DynamicCache`."""
    from transformers import DynamicCache

    from hshare.api import new_cache, patch_state

    if patch_state(model) is not None:
        return new_cache(model)
    return DynamicCache(config=model.config)


@torch.no_grad()
def _decode(model, input_ids: torch.Tensor, steps: int, continuation: torch.Tensor | None = None,
            cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill `input_ids` then decode `steps` tokens one at a time, as ``generate`` does.

    Args:
        input_ids: ``[B, P]`` prompts (equal length, no padding).
        continuation: ``[B, steps]`` tokens to feed (forced decoding), or None to feed each step's
            argmax (greedy decoding).
        cache: the cache to fill (default: `_new_decode_cache`).

    Returns:
        ``(tokens [B, steps], logits [B, steps, V] float32)``: logits[:, t] predicts tokens[:, t];
        logits[:, 0] are the prefill's last-position logits, logits[:, t] follow feeding
        tokens[:, t - 1] (the last token is never fed).
    """
    batch, prompt = input_ids.shape
    if continuation is not None and tuple(continuation.shape) != (batch, steps):
        raise ValueError(f"continuation has shape {tuple(continuation.shape)}; accepted: [B, T] = ({batch}, {steps})")
    device = model.device
    cache = _new_decode_cache(model) if cache is None else cache
    mask = torch.ones(batch, prompt + steps, dtype=torch.long, device=device)
    out = model(input_ids=input_ids.to(device), attention_mask=mask[:, :prompt], use_cache=True, logits_to_keep=1,
                **{compat.CACHE_KWARG: cache})
    tokens, logits = [], []
    for t in range(steps):
        step_logits = out.logits[:, -1].float()
        logits.append(step_logits)
        token = step_logits.argmax(-1) if continuation is None else continuation[:, t].to(device)
        tokens.append(token)
        if t == steps - 1:
            break
        position = torch.full((batch, 1), prompt + t, dtype=torch.long, device=device)
        out = model(input_ids=token[:, None], attention_mask=mask[:, :prompt + t + 1], position_ids=position,
                    use_cache=True, **{compat.CACHE_KWARG: cache})
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def forced_decode_logits(model, input_ids: torch.Tensor, continuation: torch.Tensor, cache=None) -> torch.Tensor:
    """Next-token logits along a forced continuation, through the model's real decode path.

    The prompt is prefilled on a fresh cache (`hshare.new_cache` when the model is patched, else a
    `DynamicCache`), then the continuation is fed one token per forward (q_len == 1: a patched
    model's sparse decode step with its query groups and plan), exactly as ``generate`` would.

    Args:
        input_ids: ``[B, P]`` prompts of equal length (no padding).
        continuation: ``[B, T]`` tokens to force.
        cache: optional cache to fill (its counters then show the work done); default a fresh one.

    Returns:
        ``[B, T, V]`` float32: [:, 0] the prefill's last-position logits (predicting
        continuation[:, 0]), [:, t] the logits after feeding continuation[:, t - 1].
    """
    return _decode(model, input_ids, continuation.shape[1], continuation, cache)[1]


def greedy_decode_logits(model, input_ids: torch.Tensor, steps: int, cache=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding on the same path as `forced_decode_logits` (each argmax fed back).

    Args:
        input_ids: ``[B, P]`` prompts of equal length; steps: tokens to generate.

    Returns:
        ``(tokens [B, steps], logits [B, steps, V] float32)``; forcing `tokens` reproduces `logits`.
    """
    return _decode(model, input_ids, steps, None, cache)


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per position, from float64 log-softmax.

    Args:
        reference_logits, logits: ``[..., V]``.

    Returns:
        ``[...]`` float64, in nats.
    """
    ref = torch.log_softmax(reference_logits.double(), -1)
    other = torch.log_softmax(logits.double(), -1)
    return (ref.exp() * (ref - other)).sum(-1)


def window_offsets(n_tokens: int, length: int, windows: int) -> list[int]:
    """Start offsets of `windows` windows of `length` tokens spread evenly over `n_tokens` tokens.

    The first window starts at 0 and the last ends at the text's end; offsets are distinct, and
    windows do not overlap when the text holds ``windows * length`` tokens.

    Raises:
        ValueError: when the text has fewer than ``length + windows - 1`` tokens.
    """
    if windows < 1 or length < 1:
        raise ValueError(f"windows = {windows}, length = {length}; accepted: integers >= 1")
    if n_tokens < length + windows - 1:
        raise ValueError(f"the text has {n_tokens} tokens: too short for {windows} distinct windows of {length} "
                         f"tokens; accepted: at least {length + windows - 1} tokens (non-overlapping from "
                         f"{windows * length}), or fewer windows / shorter lengths")
    if windows == 1:
        return [0]
    return [i * (n_tokens - length) // (windows - 1) for i in range(windows)]


def text_token_ids(tokenizer_or_ids, text: str | None = None) -> torch.Tensor:
    """The text as ``[N]`` token ids.

    Args:
        tokenizer_or_ids: a tokenizer (then `text` is the string, tokenised once without special
            tokens: windows start mid-text anyway), or the token ids themselves (a 1-D integer
            tensor or a list of ints; `text` must then be None).
    """
    if isinstance(tokenizer_or_ids, (torch.Tensor, list, tuple)):
        if text is not None:
            raise ValueError("token ids were given as tokenizer_or_ids, so text must be None; accepted: "
                             "(tokenizer, text) or (ids, None)")
        ids = torch.as_tensor(tokenizer_or_ids)
        if ids.ndim != 1 or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"token ids of shape {tuple(ids.shape)} and dtype {ids.dtype}; accepted: a 1-D "
                             "integer tensor or a list of ints")
        return ids.long()
    if not isinstance(text, str):
        raise ValueError(f"text has type {type(text).__name__}; accepted: a str with a tokenizer, or token ids "
                         "as tokenizer_or_ids and text=None")
    encoded = tokenizer_or_ids(text, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return torch.tensor(encoded["input_ids"], dtype=torch.long)


def config_label(config) -> str:
    """How a config is named in the results: the preset name or path as given, else its name."""
    return config if isinstance(config, str) else str(getattr(config, "name", config))


def resolve_configs(configs: Sequence, overrides: dict[str, Any]) -> list[tuple[str, Any]]:
    """``[(label, HShareConfig)]`` with dense fallback off unless `overrides` sets it; resolved
    before any work so that a bad name or field fails at once."""
    from hshare.eval.harness import evaluation_config

    if not configs:
        raise ValueError("no configs to measure; accepted: preset names, YAML paths or HShareConfig objects")
    if isinstance(overrides.get("dense_layers"), list):
        overrides["dense_layers"] = tuple(overrides["dense_layers"])
    return [(config_label(c), evaluation_config(c, overrides)) for c in configs]  # unknown fields: ConfigError


def check_lengths(model, lengths: Sequence[int], steps: int) -> None:
    """Each context length plus `steps` decoded tokens fits the model's ``max_position_embeddings``."""
    limit = getattr(model.config, "max_position_embeddings", None)
    for length in lengths:
        if length < 1:
            raise ValueError(f"context length {length}; accepted: integers >= 1")
        if limit is not None and length + steps > limit:
            raise ValueError(f"context length {length} + {steps} steps exceeds the model's max_position_embeddings "
                             f"{limit}; accepted: lengths <= {limit - steps}")


def _batches(windows: torch.Tensor, batch: int):
    """``[W, L]`` windows -> ``(rows slice, [b, L])`` groups of at most `batch` rows."""
    for start in range(0, windows.shape[0], batch):
        rows = slice(start, start + batch)
        yield rows, windows[rows]


def _reference(model, windows: torch.Tensor, steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense greedy continuation and its logits on the unpatched model: ``([W, T], [W, T, V])``."""
    parts = [greedy_decode_logits(model, rows, steps) for _, rows in _batches(windows, batch)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _measure_config(model, label: str, config, windows: torch.Tensor, tokens: torch.Tensor,
                    ref_logits: torch.Tensor, batch: int) -> FidelityResult:
    """Force `tokens` ``[W, T]`` through the model patched with `config`, compare with `ref_logits` ``[W, T, V]``."""
    from hshare.api import new_cache

    agree = kl = 0.0
    work = WorkTotals()
    for rows, prompts in _batches(windows, batch):
        cache = new_cache(model)
        logits = forced_decode_logits(model, prompts, tokens[rows], cache)
        reference = ref_logits[rows].to(logits.device)
        agree += float((logits.argmax(-1) == tokens[rows].to(logits.device)).sum())
        kl += float(kl_divergence(reference, logits).sum())
        work.add(cache.stats, cache.planner.sharing_summary())
    predictions = tokens.numel()
    return FidelityResult(config=label, length=windows.shape[1], windows=windows.shape[0], steps=tokens.shape[1],
                          predictions=predictions, agreement=agree / predictions, kl=kl / predictions,
                          budget=config.budget.total if config.sparse else None, stats=work.counters,
                          plan=work.plan_mean())


def measure_fidelity(model, tokenizer_or_ids, text: str | None, lengths: Sequence[int], configs: Sequence,
                     windows: int = 4, steps: int = 64, batch: int = 1, overrides: dict[str, Any] | None = None,
                     progress: Callable[[int, int], None] | None = None) -> list[FidelityResult]:
    """Forced-continuation fidelity of each config against dense decoding, per context length.

    For each length L: `windows` windows of L tokens at evenly spread offsets of the text
    (`window_offsets`); dense's greedy continuation of `steps` tokens (on the unpatched model) is
    the reference; each config (``hshare.patch(model, config, dense_fallback_mib=0, **overrides)``)
    is forced along it (`forced_decode_logits`) and compared step by step.

    Args:
        model: a Llama / Mistral causal LM, patched or not (its patch state is restored at the end).
        tokenizer_or_ids, text: a tokenizer and the text, or ``[N]`` token ids and None
            (`text_token_ids`).
        lengths: context lengths in tokens; each + `steps` must fit `max_position_embeddings`.
        configs: preset names, YAML paths or `HShareConfig` objects (``"dense"`` gives agreement 1
            and KL 0: the check of the forced path itself).
        batch: windows per forward. 1 (default) keeps windows independent; larger is faster but
            a ``plan_scope="batch"`` plan then pools the evidence of the windows batched together.
        overrides: `HShareConfig` fields applied to every config (e.g. ``{"heavy": 200}``;
            ``dense_fallback_mib`` is 0 unless given here).
        progress: called as ``progress(done, total)`` after each (length, config).

    Returns:
        One `FidelityResult` per (config, length), configs in the given order, lengths ascending
        within each config.
    """
    from hshare.api import patched, unpatched

    if steps < 1 or batch < 1:
        raise ValueError(f"steps = {steps}, batch = {batch}; accepted: integers >= 1")
    lengths = sorted(set(int(n) for n in lengths))
    check_lengths(model, lengths, steps)
    resolved = resolve_configs(configs, dict(overrides or {}))
    ids = text_token_ids(tokenizer_or_ids, text)
    offsets = {n: window_offsets(len(ids), n, windows) for n in lengths}  # fails before any work

    results: dict[tuple[int, int], FidelityResult] = {}
    done, total = 0, len(lengths) * len(resolved)
    for length in lengths:
        rows = torch.stack([ids[o:o + length] for o in offsets[length]])
        with unpatched(model):
            tokens, ref_logits = _reference(model, rows, steps, batch)
        for index, (label, config) in enumerate(resolved):
            with patched(model, config):
                results[index, length] = _measure_config(model, label, config, rows, tokens, ref_logits, batch)
            done += 1
            if progress is not None:
                progress(done, total)
    return [results[key] for key in sorted(results)]


# ---- output -------------------------------------------------------------------------------------

def length_label(tokens: int) -> str:
    """1024 -> "1k", 1536 -> "1.5k", 1000 -> "1000"."""
    return f"{tokens / 1024:g}k" if tokens % 512 == 0 else str(tokens)


def _grid(results: Sequence[FidelityResult]) -> tuple[list[str], list[int], dict[tuple[str, int], FidelityResult]]:
    """(configs in first-seen order, lengths ascending, {(config, length): result})."""
    configs = list(dict.fromkeys(r.config for r in results))
    lengths = sorted({r.length for r in results})
    return configs, lengths, {(r.config, r.length): r for r in results}


def fidelity_markdown(results: Sequence[FidelityResult]) -> str:
    """A Markdown table: one row per config, an agreement and a KL column per context length."""
    configs, lengths, cell = _grid(results)
    header = ["config"] + [f"{name} {length_label(n)}" for n in lengths for name in ("agree", "KL")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for config in configs:
        values = []
        for n in lengths:
            r = cell.get((config, n))
            values += ["-", "-"] if r is None else [f"{r.agreement:.3f}", f"{r.kl:.3g}"]
        lines.append("| " + " | ".join([config] + values) + " |")
    return "\n".join(lines) + "\n"


def _csv_rows(results: Sequence[FidelityResult]) -> tuple[list[str], list[dict[str, Any]]]:
    """Flat rows: the result's fields, then its stats and its plan summary (``plan_<name>``; each the union over
    the results, first-seen order)."""
    stat_names = list(dict.fromkeys(name for r in results for name in r.stats))
    base = [f.name for f in dataclasses.fields(FidelityResult) if f.name not in ("stats", "plan")]
    plan_names = list(dict.fromkeys(name for r in results for name in r.plan))
    rows = []
    for r in results:
        row = {name: getattr(r, name) for name in base}
        row["budget"] = "" if r.budget is None else r.budget
        row.update({name: r.stats.get(name, "") for name in stat_names})
        row.update({f"plan_{name}": r.plan.get(name, "") for name in plan_names})
        rows.append(row)
    return base + stat_names + [f"plan_{name}" for name in plan_names], rows


def fidelity_plot(results: Sequence[FidelityResult], path: Path) -> Path | None:
    """Agreement and KL against context length, one line per config; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed: {path} is not drawn (pip install matplotlib)", file=sys.stderr)
        return None
    configs, lengths, cell = _grid(results)
    figure = Figure(figsize=(12, 4.5))
    axes = figure.subplots(1, 2)
    for config in configs:
        points = [cell[config, n] for n in lengths if (config, n) in cell]
        x = [r.length for r in points]
        axes[0].plot(x, [r.agreement for r in points], marker="o", label=config)
        axes[1].plot(x, [r.kl for r in points], marker="o", label=config)
    for ax, title in zip(axes, ("top-1 agreement with dense", "mean KL(dense || config), nats")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(n) for n in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("symlog", linthresh=1e-4)  # dense sits at 0
    axes[1].set_ylim(0, max(max(r.kl for r in results) * 2, 1e-3))
    axes[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def write_fidelity(results: Sequence[FidelityResult], out_dir: str | Path) -> list[Path]:
    """Write fidelity.json (the results, stats and plan nested), fidelity.csv (one flat row per result),
    fidelity.md (`fidelity_markdown`) and fidelity.png (`fidelity_plot`, where matplotlib is
    installed) into `out_dir` (created). Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path, md_path, png_path = (out / name for name in FIDELITY_FILES)
    json_path.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2) + "\n")
    columns, rows = _csv_rows(results)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    md_path.write_text(fidelity_markdown(results))
    written = [json_path, csv_path, md_path]
    if fidelity_plot(results, png_path) is not None:
        written.append(png_path)
    return written


# ---- the `hshare fidelity` command ----------------------------------------------------------------

def parse_lengths(text: str) -> list[int]:
    """``"1k,2k,1536"`` -> ``[1024, 2048, 1536]`` ("k" = 1024; "1.5k" = 1536)."""
    lengths = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            value = float(item[:-1]) * 1024 if item.endswith("k") else int(item)
        except ValueError:
            value = None
        if value is None or value != int(value) or value < 1:
            raise argparse.ArgumentTypeError(f"context length {item!r} in {text!r} is invalid; accepted: "
                                             "comma-separated positive token counts such as 1k,2k,4k or 1500")
        lengths.append(int(value))
    return lengths


def parse_configs(text: str) -> list:
    """``"ds@512,hshare-1_2-1_2-1_2,sweep:ablation"`` -> presets / YAML paths (checked to exist), and
    for ``sweep:<name or path>`` every config of that sweep file (`HShareConfig` objects named as in
    the sweep)."""
    from hshare.config import ConfigError, resolve_config
    from hshare.eval.sweep_spec import load_sweep

    names = [item.strip() for item in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty config name in {text!r}; accepted: comma-separated preset "
                                         "names, YAML paths or sweep:<sweep file>")
    configs, seen = [], set()
    for name in names:
        try:
            if name.startswith("sweep:"):
                expanded = [entry.config() for entry in load_sweep(name[len("sweep:"):]).entries]
            else:
                resolve_config(name)
                expanded = [name]
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        for config in expanded:  # a config named twice (a preset also in a sweep) runs once
            label = config if isinstance(config, str) else config.name
            if label not in seen:
                seen.add(label)
                configs.append(config)
    return configs


def parse_override(text: str) -> tuple[str, Any]:
    """``"heavy=200"`` -> ``("heavy", 200)``; the value is read as YAML (numbers, true/false, lists)."""
    import yaml

    from hshare.config import option_names

    name, sep, value = text.partition("=")
    known = option_names()
    if not sep or name.strip() not in known:
        raise argparse.ArgumentTypeError(f"--set {text!r}: accepted: option=value with an HShareConfig option "
                                         f"({', '.join(known)})")
    return name.strip(), yaml.safe_load(value)


def add_fidelity_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``fidelity`` sub-command to `subparsers` (``hshare fidelity``); it runs `run_fidelity`."""
    p = subparsers.add_parser("fidelity", help="forced-continuation fidelity of configs against dense decoding",
                              description="Force dense's greedy continuation of text windows through each config's "
                                          "decode path; report top-1 agreement and KL(dense || config) per length.")
    p.add_argument("--text", required=True, help="a plain-text file (e.g. War and Peace)")
    p.add_argument("--lengths", required=True, type=parse_lengths, help="context lengths, e.g. 1k,2k,4k,8k (k = 1024)")
    p.add_argument("--configs", required=True, type=parse_configs,
                   help="comma-separated presets, YAML paths or sweep:<sweep file or name>, e.g. "
                        "ds@512,hshare-7_8-3_4-1_2@512,sweep:ablation")
    p.add_argument("--model", help="a local directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--gguf-file", help="a GGUF file inside --model")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, ...")
    p.add_argument("--device", help="cuda, cpu, ... (default: CUDA when present)")
    p.add_argument("--windows", type=int, default=4, help="text windows per length (default 4)")
    p.add_argument("--steps", type=int, default=64, help="forced continuation tokens per window (default 64)")
    p.add_argument("--batch", type=int, default=1, help="windows per forward (default 1: windows independent)")
    p.add_argument("--set", dest="overrides", type=parse_override, action="append", default=[], metavar="FIELD=VALUE",
                   help="an HShareConfig option (flat or dotted name) for every config (repeatable); dense_fallback_mib is 0 unless set")
    p.add_argument("--out", default="fidelity-results", help="directory for the outputs (default fidelity-results)")
    p.set_defaults(run=run_fidelity)
    return p


def run_fidelity(args: argparse.Namespace) -> int:
    """The ``hshare fidelity`` command: measure, print the Markdown table, write the files."""
    from tqdm.auto import tqdm

    from hshare.default_model import load_model

    text = Path(args.text).read_text(encoding="utf-8")
    model, tokenizer = load_model(pretrained=args.model, gguf_file=args.gguf_file, dtype=args.dtype,
                                  device=args.device)
    with tqdm(total=len(args.lengths) * len(args.configs), desc="fidelity", unit="config x length") as bar:
        results = measure_fidelity(model, tokenizer, text, args.lengths, args.configs, windows=args.windows,
                                   steps=args.steps, batch=args.batch, overrides=dict(args.overrides),
                                   progress=lambda done, total: bar.update(done - bar.n))
    print(fidelity_markdown(results))
    for path in write_fidelity(results, args.out):
        print(f"wrote {path}")
    return 0
