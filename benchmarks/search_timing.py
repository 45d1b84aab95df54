"""Where a candidate top-k program's time goes once its keys are scored: the exact top-r search over keys held in
registers (`key_search_triton`), stage by stage, at a few and at many programs (on the GPU).

Each program loads its row of order-preserving keys ``[P, C_PAD]`` int32 (INT32_MIN past C) and of candidate
columns, then runs up to a stage: `load` (their count, bounds and moments in one reduction; write the first r
columns), `stats` (+ the first pivot), `search` (+ the exact threshold), `full` (`_top_columns`: + the writes in
candidate order), checked against the twin (`label_topk.select_heavy_columns_torch`). Each stage is one launch
replayed as a CUDA graph (`graph_time_us`): `load` is mostly the replay's own cost.

    python3 benchmarks/search_timing.py --programs 8,512 --width 1728 --heavy 432
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from hshare.bench.timing import graph_time_us
from hshare.kernels.key_search_triton import _exact_threshold, _first_value, _key_stats, _top_columns
from hshare.kernels.label_topk import score_keys_torch, select_heavy_columns_torch

STAGES = ("load", "stats", "search", "full")


@triton.jit
def _stage(key_ptr, col_ptr, out_ptr, heavy, C_PAD: tl.constexpr, STAGE: tl.constexpr, TILE: tl.constexpr):
    """Program pid: the top `heavy` of its keys, up to STAGE (0-3: `STAGES`)."""
    pid = tl.program_id(0)
    slots = tl.arange(0, C_PAD)
    key = tl.load(key_ptr + pid.to(tl.int64) * C_PAD + slots)
    cols = tl.load(col_ptr + pid.to(tl.int64) * C_PAD + slots)
    out_row = out_ptr + pid.to(tl.int64) * heavy
    if STAGE == 3:
        _top_columns(out_row, key, cols, heavy, TILE, out_row, False)
    else:
        count, smallest, largest, mean, std = _key_stats(key, key != -2147483648)
        r = tl.minimum(count, heavy)
        threshold = smallest
        if STAGE >= 1:
            first = _first_value(mean, std, count, r.to(tl.float32) - 0.5)
            threshold = threshold + (first > 1e30).to(tl.int32)
        if STAGE >= 2:
            threshold, ties, _ = _exact_threshold(key, 1, out_row, 0, r, smallest, count, largest.to(tl.int64) + 1,
                                               first, False, TILE)
            threshold += (ties == 0).to(tl.int32)
        tl.store(out_row + slots, cols.to(tl.int64), mask=(slots < heavy) & (key >= threshold))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="8,32,512")
    parser.add_argument("--width", type=int, default=1728)
    parser.add_argument("--heavy", type=int, default=432)
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--scores", default="normal,labels", help="normal: N(0,1); labels: 16 4-bit codes . query")
    args = parser.parse_args()
    device = torch.device("cuda")
    pad = triton.next_power_of_2(args.width)
    print(f"{torch.cuda.get_device_name(device)}, C = {args.width}, heavy {args.heavy}")
    print("programs | scores | warps | " + " | ".join(f"{s} us" for s in STAGES) + " | equals the twin")
    for programs in map(int, args.programs.split(",")):
        for kind in args.scores.split(","):
            if kind == "normal":
                scores = torch.randn(programs, args.width, device=device)
            else:  # label scores: integer codes times a query, the labels' dot over 16 channels
                codes = torch.randint(0, 16, (programs, args.width, 16), device=device).float()
                scores = (codes @ torch.randn(programs, 16, 1, device=device)).squeeze(-1)
            key = torch.full((programs, pad), -2**31, dtype=torch.int32, device=device)
            key[:, :args.width] = score_keys_torch(scores)
            cols = torch.full((programs, pad), -1, dtype=torch.int32, device=device)
            cols[:, :args.width] = torch.arange(args.width, dtype=torch.int32, device=device)
            out = torch.empty(programs, args.heavy, dtype=torch.int64, device=device)
            everywhere = torch.ones_like(scores, dtype=torch.bool)
            want = select_heavy_columns_torch(scores[:, None], everywhere, args.heavy)[:, 0]
            for warps in map(int, args.warps.split(",")):
                def launch(stage: int, warps: int = warps) -> None:
                    _stage[(programs,)](key, cols, out, args.heavy, C_PAD=pad, STAGE=stage, TILE=min(4096, pad),
                                        num_warps=warps)
                times = [graph_time_us(lambda: launch(stage), device) for stage in range(len(STAGES))]
                launch(len(STAGES) - 1)
                print(f"{programs} | {kind} | {warps} | " + " | ".join(f"{t:.1f}" for t in times)
                      + f" | {torch.equal(out, want)}")


if __name__ == "__main__":
    main()
