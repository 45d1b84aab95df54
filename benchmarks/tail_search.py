"""The exact top-r search over a selection's own score keys: probes and GPU time with the normal pivots against
the tail pivots (`key_search_triton`, TAIL), on the keys a real decode step searches (on the GPU).

One ``generate`` of a path whose selecting layers walk their top C (`label_topk.decode_label_topk_walk`) records,
at its first eager selection step, every `--every`-th selecting layer's label score keys of every column
(``[A, H', n]``, `label_topk.score_keys_torch`, none outside the selectable window). Over each row-head's keys it
then runs the search alone (one program a row-head, the keys in registers) for:

  walk best    the top C keys (the walk's keys), r = heavy: the walk's search for a selecting head's best heavy
  select       the top 3 C / 2 keys (about what a label top-k's bound L admits at C = 4 x heavy), r = C: the
               label top-k's last program
  refine       the top C columns of a head scored by the next selection head of the row, r = heavy: a refinement
               (a query that did not choose them)

and prints per search and pivots the probes (mean / max over the row-heads) and the launch's GPU time (a CUDA
graph's replay). The walk's own slot search weighs each key by its cost; it is not run alone here. `--save` also
writes the keys (``$OUT/selection_keys_K.pt``, `--per-file` layers a file).

    python3 benchmarks/tail_search.py --shape llama3-8b --batch 4 --prompt 32768 --padded \
        --path hshare-refine-successors-c4@1024 --every 2
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

import hshare
from hshare import compat
from hshare.bench.generate import build_model, make_prompts
from hshare.bench.timing import graph_time_us
from hshare.config import split_overrides
from hshare.kernels import label_topk_triton
from hshare.kernels.key_search_triton import _exact_threshold, _first_value, _key_stats
from hshare.kernels.label_topk import score_keys_torch, window_columns
from hshare.kernels.labels import decode_query_labels, score_heads_torch

NONE = torch.iinfo(torch.int32).min


@triton.jit
def _search_probes(key_ptr, probes_ptr, r, C_PAD: tl.constexpr, TAIL: tl.constexpr):
    """Program pid: the search for the top `r` of its row of keys ``[P, C_PAD]`` (INT32_MIN: none); its probes."""
    pid = tl.program_id(0)
    key = tl.load(key_ptr + pid.to(tl.int64) * C_PAD + tl.arange(0, C_PAD))
    count, smallest, largest, mean, std = _key_stats(key, key != -2147483648)
    need = tl.minimum(count, r)
    _, _, probes = _exact_threshold(key, 1, probes_ptr, 0, need, smallest, count, largest.to(tl.int64) + 1,
                                    _first_value(mean, std, tl.maximum(count, 1), need - 0.5), False, C_PAD, TAIL)
    tl.store(probes_ptr + pid, probes)


def record_keys(args) -> list[dict]:
    """The selecting layers' keys of the first eager selection step of one ``generate`` (every `args.every`-th)."""
    model = build_model(args.shape, None, "cuda", torch.bfloat16, args.prompt + 16)
    ids, mask = make_prompts(model.config.vocab_size, args.batch, args.prompt, False, args.padded)
    saved, calls = [], [0]
    original = label_topk_triton.selection_walk_triton

    def recording(query, channels, codes, scale, zero, bits, count, rows, heads, selectable, top=0, *placement):
        if not torch.cuda.is_current_stream_capturing():
            if calls[0] % args.every == 0 and calls[0] < args.layers * args.every:
                labels = decode_query_labels(query, channels, rows, heads)
                scores = score_heads_torch(labels, codes, scale, zero, bits, rows, heads).float()
                ok = window_columns(None, selectable, scores.shape[0], scores.shape[-1], scores.device)
                keys = torch.where(ok[:, None] & torch.isfinite(scores), score_keys_torch(scores), NONE)
                saved.append({"call": calls[0], "keys": keys.int().cpu(), "count": count, "top": top})
            calls[0] += 1
        return original(query, channels, codes, scale, zero, bits, count, rows, heads, selectable, top, *placement)

    label_topk_triton.selection_walk_triton = recording
    name, overrides = split_overrides(args.path)
    try:
        with hshare.patched(model, name, **overrides):
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0, **{compat.CACHE_KWARG: hshare.new_cache(model)})
    finally:
        label_topk_triton.selection_walk_triton = original
    del model
    torch.cuda.empty_cache()
    return saved


def searches(layer: dict) -> dict[str, tuple[torch.Tensor, int]]:
    """The key rows ``[P, width]`` (NONE-padded) and r of each search over one layer's keys."""
    keys, count, heavy = layer["keys"].cuda(), layer["count"], layer["top"]
    rows, heads, n = keys.shape
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices  # ties: smaller columns first
    top = order[..., :count].sort(-1).values  # the top C columns, ascending
    select = order[..., : 3 * count // 2]
    refine = keys.roll(-1, dims=1).gather(-1, top)  # the next head's keys at this head's top C
    return {"walk best": (keys.gather(-1, top), heavy), "select": (keys.gather(-1, select), count),
            "refine": (refine, heavy)}


def run_search(rows: torch.Tensor, r: int, tail: bool) -> tuple[torch.Tensor, float]:
    """Probes per row and the launch's GPU us of the search for the top `r` of each row of `rows` ``[P, width]``."""
    pad = triton.next_power_of_2(rows.shape[-1])
    key = torch.full((rows.shape[0], pad), NONE, dtype=torch.int32, device=rows.device)
    key[:, : rows.shape[-1]] = rows
    probes = torch.empty(rows.shape[0], dtype=torch.int32, device=rows.device)

    def launch() -> None:
        _search_probes[(rows.shape[0],)](key, probes, r, C_PAD=pad, TAIL=tail, num_warps=8)

    us = graph_time_us(launch, rows.device)
    launch()
    return probes.cpu(), us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--padded", action="store_true")
    parser.add_argument("--path", default="hshare-refine-successors-c4@1024")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8, help="selecting layers recorded")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--per-file", type=int, default=3)
    args = parser.parse_args()
    saved = record_keys(args)
    out = Path(os.environ.get("OUT", "."))
    if args.save:
        for k in range(0, len(saved), args.per_file):
            torch.save(saved[k:k + args.per_file], out / f"selection_keys_{k // args.per_file}.pt")
    print(f"{args.path}, {args.shape} B{args.batch} x {args.prompt}: {len(saved)} selecting layers "
          f"(C = {saved[0]['count']}, heavy {saved[0]['top']}), {tuple(saved[0]['keys'].shape)} row-heads x columns")
    print("| search | pivots | probes mean / max | GPU us a launch, mean over the layers |")
    print("|---|---|---|---|")
    for name in searches(saved[0]):
        for tail in (False, True):
            probes, times = [], []
            for layer in saved:
                rows, r = searches(layer)[name]
                got, us = run_search(rows.reshape(-1, rows.shape[-1]), r, tail)
                probes.append(got)
                times.append(us)
            probes = torch.cat(probes).float()
            print(f"| {name} | {'tail' if tail else 'normal'} | {probes.mean():.2f} / {probes.max():.0f} | "
                  f"{sum(times) / len(times):.1f} |")


if __name__ == "__main__":
    main()
