"""What the "auto" planner's scoring budget plans on evidence without structure: random keep-sets, as a
random-weight model's prefill gives (every layer and head pair alike but for noise), at a benchmark's shape.

The budget's merge takes a head copy or a layer copy by similarity. Merged on the evidence rows that chose
the pairs, the best of a layer's many head pairs reads higher than a layer copy (a mean over every head) though
both are alike: the budget goes to head copies spread over most layers. Merged on held-out rows (the planner's
default from two evidence rows on), it does not. Prints layer copies and selecting layers for both, per budget.

    python3 benchmarks/budget_plan_noise.py                          # Llama-2-7B B16 x 4k at N_c 512
    python3 benchmarks/budget_plan_noise.py --layers 32 --heads 8 --columns 32832 --heavy 944
"""

from __future__ import annotations

import argparse

import torch

from hshare.planner import budget_copies, head_similarity, layer_overlaps, sources_for_ratio


def similarities(keep: list[torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([Ls, H, H], [Ls, Ls])`` head similarities and layer overlaps of per-layer keep-sets ``[1, H, W, k]``."""
    heads = torch.stack([head_similarity(kept, n)[0] for kept in keep])
    layers = torch.zeros(len(keep), len(keep))
    for i in range(1, len(keep)):
        layers[i, :i] = layer_overlaps(keep[i], keep[:i], n)[0]
    return heads, layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32, help="selection heads a layer")
    parser.add_argument("--rows", type=int, default=4, help="evidence rows (planner.rows)")
    parser.add_argument("--columns", type=int, default=4160)
    parser.add_argument("--heavy", type=int, default=432)
    parser.add_argument("--budgets", default="0.25,0.125")
    parser.add_argument("--layer-sharing", type=float, default=1 / 8, help="the ratios' bound (at least this selects)")
    parser.add_argument("--head-sharing", type=float, default=1 / 3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(args.seed)
    keep = [torch.rand(1, args.heads, args.rows, args.columns, generator=generator).topk(args.heavy, -1).indices
            for _ in range(args.layers)]
    head_copies = args.heads - sources_for_ratio(args.head_sharing, args.heads)
    layer_copies = args.layers - sources_for_ratio(args.layer_sharing, args.layers)
    every_row = similarities(keep, args.columns)
    even = similarities([kept[:, :, 0::2] for kept in keep], args.columns)
    odd = similarities([kept[:, :, 1::2] for kept in keep], args.columns)
    print("| budget | merged on | layer copies | selecting layers |")
    print("|---|---|---|---|")
    for budget in map(float, args.budgets.split(",")):
        for name, order, held in (("every row", every_row, None), ("held-out rows", even, odd)):
            _, layers = budget_copies(*order, args.layers, args.heads, head_copies, layer_copies, budget,
                                      held_out=held)
            print(f"| {budget:g} | {name} | {layers} | {args.layers - layers} |")


if __name__ == "__main__":
    main()
