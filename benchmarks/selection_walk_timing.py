"""Times a selecting head's selection with successors (`SharingConfig.successors`, what a selection step of the
refinement presets runs) on one GPU: the label top-k of C columns then their walk scoring them again (two launches,
C label rows read twice: `label_topk_triton` and `candidate_label_walk_triton` as the step ran them before) against
`label_topk.decode_label_topk_walk` (the top-k writes its columns' keys, the walk reads them), and checks that both
give the same columns.

Each path is replayed as a CUDA graph (`graph_time_us`, L2 flushed). Labels as `label_topk_timing.make_step` (16
channels at 4 bits by default, bf16 scale / zero, the window [16, n - 64)); C = 4 x heavy, the best `heavy` returned
too, as the presets run it.

    python3 benchmarks/selection_walk_timing.py                      # B16 x 16 source heads x 4k, B4 x 4 x 32k, ...
    python3 benchmarks/selection_walk_timing.py --shapes 16x16x4096 --heavy 432
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from hshare.bench.timing import graph_time_us
from hshare.kernels.label_topk import decode_label_topk_walk
from hshare.kernels.label_topk_triton import candidate_label_walk_triton, label_topk_triton

from label_topk_timing import make_step

# (rows x source heads x n, heavy): Llama-2-7B's selecting layer at B16 x 4k (16 of 32 heads select, N_c 512), and
# Llama-3-8B's at B4 x 32k and B1 x 128k (4 of 8 KV heads, N_c 1024)
CASES = "16x16x4096:432,4x4x32768:944,1x4x131072:944"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=CASES, help="rows x heads x n:heavy, comma-separated")
    parser.add_argument("--candidates", type=int, default=4, help="C = this x heavy")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8, 16))
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}; labels "
          f"{args.channels} x {args.bits} bits; C = {args.candidates} x heavy")
    header = ("rows x heads x n", "heavy", "C", "top-k, then the walk scoring again us", "scored once us", "ratio",
              "same columns")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    results = []
    for case in args.cases.split(","):
        shape, heavy = case.split(":")
        rows, heads, n = map(int, shape.split("x"))
        heavy = int(heavy)
        count = args.candidates * heavy
        codes, scale, zero, query, chans, _, selectable = make_step(rows, heads, n, args.bits, args.channels, 0.0,
                                                                   device)

        def twice():
            columns = label_topk_triton(None, codes, scale, zero, args.bits, count, None, None, None, selectable,
                                        query=query, channels=chans)
            return candidate_label_walk_triton(query, chans, codes, scale, zero, args.bits, columns, None, None,
                                               selectable, heavy, ascending=True)

        def once():
            return decode_label_topk_walk(query, chans, codes, scale, zero, args.bits, count, selectable, top=heavy)

        with torch.no_grad():
            same = all(torch.equal(a, b) for a, b in zip(twice(), once()))
            twice_us = graph_time_us(twice, device)
            once_us = graph_time_us(once, device)
        print(" | ".join((shape, str(heavy), str(count), f"{twice_us:.1f}", f"{once_us:.1f}",
                          f"{once_us / twice_us:.2f}", "yes" if same else "NO")), flush=True)
        results.append(dict(shape=shape, heavy=heavy, candidates=count, twice_us=twice_us, once_us=once_us,
                            same=same))
        del codes, scale, zero, query, chans, selectable
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(device=torch.cuda.get_device_name(device), bits=args.bits, channels=args.channels,
                           rows=results), handle, indent=1)


if __name__ == "__main__":
    main()
