"""Times candidate-set refinement's kernels on one GPU at growing candidate counts: the fused Triton
candidate top-k and candidate walk (`label_topk_triton.candidate_label_topk_triton` /
`candidate_label_walk_triton`, a program per (row, head) holding its C candidates in registers) against
their torch twins, and checks each against its twin (top-k: the same columns; walk: the same taken
columns and best `heavy`).

`--widths` lists C; a width above the kernels' limits (``MAX_CANDIDATES``, ``MAX_WALK_CANDIDATES``) is run
with the limits raised for the run, which is what this script is for: whether a wider register tile
compiles, agrees and is faster than the twin.

    python3 benchmarks/candidate_timing.py                      # B16 x 32 heads x 4k, B4 x 8 x 32k, B1 x 8 x 128k
    python3 benchmarks/candidate_timing.py --widths 1728,7872 --shapes 4x8x32768
    python3 benchmarks/candidate_timing.py --widths 3776 --shapes 16x32x4096 --maxnreg 128   # a register cap
    python3 benchmarks/candidate_timing.py --widths 3776 --shapes 4x8x32768 --keys --group 4   # refine_by keys too
    python3 benchmarks/candidate_timing.py --widths 3776 --shapes 4x8x32768 --score-tiles 0,256   # split scoring
    python3 benchmarks/candidate_timing.py --widths 1408 --shapes 16x32x4096 --channels 16 --no-window   # its cost

`--keys` also times the refinement by exact logits (`candidate_keys_triton.candidate_key_topk_triton`, bf16 keys
``[rows, heads, n, 128]``, `--group` query heads a head) against its twin.

Candidates are distinct random window columns, ascending (the walk told so); labels as `label_topk_timing.make_step` (8 heavy
channels at 4 bits by default); each path replayed as a CUDA graph (`graph_time_us`, L2 flushed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from label_topk_timing import SINK, make_step  # noqa: E402

from hshare.bench.timing import graph_time_us  # noqa: E402
from hshare.kernels import label_topk_triton  # noqa: E402
from hshare.kernels.candidate_keys import candidate_key_topk_torch  # noqa: E402
from hshare.kernels import candidate_keys_triton  # noqa: E402
from hshare.kernels.label_topk import candidate_label_topk_torch, candidate_label_walk_torch  # noqa: E402

SHAPES = "16x32x4096,4x8x32768,1x8x131072"
WIDTHS = "1728,3776,7872,15936"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="rows x heads x n, comma-separated")
    parser.add_argument("--widths", default=WIDTHS, help="candidates per (row, head), comma-separated")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--warps", type=int, default=None, help="num_warps of the Triton kernels (default: theirs)")
    parser.add_argument("--maxnreg", type=int, default=None,
                        help="registers a thread at most, both kernels (default: theirs; 0: no cap)")
    parser.add_argument("--keys", action="store_true", help="also the refinement by exact logits (bf16 keys)")
    parser.add_argument("--no-window", action="store_true",
                        help="the top-k without its window (no bounds tested; the candidates are in it)")
    parser.add_argument("--group", type=int, default=1, help="query heads a head for --keys (default 1)")
    parser.add_argument("--score-tiles", default=None,
                        help="also the label kernels with their scoring in a launch of its own, at these candidates "
                             "a scoring program (comma-separated; 0: scored in the top-k's program)")
    parser.add_argument("--key-tiles", default=None,
                        help="--keys also at these candidates a scoring program (comma-separated; default: the kernel's)")
    args = parser.parse_args()
    device = torch.device("cuda")
    header = ("rows x heads x n", "C", "top-k triton us", "top-k twin us", "walk triton us", "walk twin us",
              "keys triton us", "keys twin us", "agree")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    results = []
    for shape in args.shapes.split(","):
        rows, heads, n = map(int, shape.split("x"))
        codes, scale, zero, query, chans, window, selectable = make_step(rows, heads, n, args.bits, args.channels, 0.0,
                                                                    device)
        all_rows = torch.arange(rows, device=device)
        all_heads = torch.arange(heads, device=device)[None]
        keys = torch.randn(rows, heads, n, query.shape[-1], device=device, dtype=torch.bfloat16) if args.keys else None
        key_query = (torch.randn(rows, heads * args.group, query.shape[-1], device=device, dtype=torch.bfloat16)
                     if args.keys else None)
        span = int(selectable[0].sum())
        topk_window = None if args.no_window else window  # the top-k's window: bounds; the walk's: the mask
        for width in map(int, args.widths.split(",")):
            if width > span:
                continue
            candidates = torch.stack([SINK + torch.randperm(span, device=device)[:width]
                                      for _ in range(rows * heads)]).view(rows, heads, width).sort(-1).values
            heavy = width // 4
            limits = label_topk_triton.MAX_CANDIDATES, label_topk_triton.MAX_WALK_CANDIDATES
            label_topk_triton.MAX_CANDIDATES = label_topk_triton.MAX_WALK_CANDIDATES = max(*limits, width)
            try:
                score_tile = None  # the kernels' rule

                def topk_triton():
                    return label_topk_triton.candidate_label_topk_triton(
                        query, chans, codes, scale, zero, args.bits, heavy, candidates, all_rows, all_heads,
                        topk_window, num_warps=args.warps, max_registers=args.maxnreg, score_tile=score_tile)

                def topk_twin():
                    return candidate_label_topk_torch(query, chans, codes, scale, zero, args.bits, heavy, candidates,
                                                      topk_window)

                def walk_triton():  # the candidates ascending, as a selection's label top-k writes them; and their
                    return label_topk_triton.candidate_label_walk_triton(  # best heavy, as refinement asks
                        query, chans, codes, scale, zero, args.bits, candidates, all_rows, all_heads, selectable,
                        heavy, ascending=True, num_warps=args.warps, max_registers=args.maxnreg, score_tile=score_tile)

                def walk_twin():
                    return candidate_label_walk_torch(query, chans, codes, scale, zero, args.bits, candidates,
                                                      selectable, top=heavy)

                def keys_triton():
                    return candidate_keys_triton.candidate_key_topk_triton(key_query, keys, heavy, candidates,
                                                                           window, num_warps=args.warps)

                def keys_twin():
                    return candidate_key_topk_torch(key_query, keys, heavy, candidates, window)

                with torch.no_grad():
                    agree = {}  # the share of (row, head) programs equal to the twin's (fp32 scores rounded
                    try:        # differently may swap near-equal candidates at a boundary)
                        agree["topk"] = (topk_triton() == topk_twin()).all(-1).float().mean().item()
                        taken, best = walk_triton()
                        taken_twin, best_twin = walk_twin()
                        agree["walk"] = (taken == taken_twin).all(-1).float().mean().item()
                        agree["walk best"] = (best == best_twin).all(-1).float().mean().item()
                        if args.keys:
                            agree["keys"] = (keys_triton().sort(-1).values == keys_twin().sort(-1).values
                                             ).all(-1).float().mean().item()
                    except Exception as error:  # a register tile that does not compile or launch
                        agree["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                    row = {"shape": shape, "candidates": width, "heavy": heavy, "agree": agree}
                    if "error" not in agree:
                        row.update(topk_triton_us=graph_time_us(topk_triton, device),
                                   topk_twin_us=graph_time_us(topk_twin, device),
                                   walk_triton_us=graph_time_us(walk_triton, device),
                                   walk_twin_us=graph_time_us(walk_twin, device))
                        for score_tile in map(int, args.score_tiles.split(",") if args.score_tiles else ()):
                            same = (torch.equal(topk_triton(), topk_twin())
                                    and all(torch.equal(a, b) for a, b in zip(walk_triton(), walk_twin())))
                            row[f"score_tile{score_tile}"] = {"topk_us": graph_time_us(topk_triton, device),
                                                              "walk_us": graph_time_us(walk_triton, device),
                                                              "equal_to_twin": same}
                        score_tile = None
                        if args.keys:
                            row.update(keys_triton_us=graph_time_us(keys_triton, device),
                                       keys_twin_us=graph_time_us(keys_twin, device))
                            default_tile = candidate_keys_triton.TILE_C
                            for key_tile in map(int, args.key_tiles.split(",") if args.key_tiles else ()):
                                candidate_keys_triton.TILE_C = key_tile
                                try:
                                    row[f"keys_triton_us_tile{key_tile}"] = graph_time_us(keys_triton, device)
                                finally:
                                    candidate_keys_triton.TILE_C = default_tile
            finally:
                label_topk_triton.MAX_CANDIDATES, label_topk_triton.MAX_WALK_CANDIDATES = limits
            results.append(row)

            def us(key):
                value = row.get(key)
                return f"{value:.1f}" if value else "n/a"
            tiles = {key[len("keys_triton_us_"):]: round(value, 1) for key, value in row.items()
                     if key.startswith("keys_triton_us_tile")}
            tiles.update({key: {k: round(v, 1) if isinstance(v, float) else v for k, v in value.items()}
                          for key, value in row.items() if key.startswith("score_tile")})
            print(" | ".join([shape, str(width), us("topk_triton_us"), us("topk_twin_us"), us("walk_triton_us"),
                              us("walk_twin_us"), us("keys_triton_us"), us("keys_twin_us"), json.dumps(agree)])
                  + (f" | {json.dumps(tiles)}" if tiles else ""), flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "candidate_timing.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "bits": args.bits,
         "channels": args.channels, "top-k window": not args.no_window, "results": results}, indent=1))


if __name__ == "__main__":
    main()
