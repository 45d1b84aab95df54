"""Launch-configuration sweep of the decode kernels on the GPU (device machine), to choose defaults.

1. Shared-prefix decode kernel (`shared_prefix_decode_states_triton`), GQA 32/8, d 128, bf16, at
   the `hshare bench prefix` shapes: tile configs with the automatic split, then split counts
   with the best tiles. Time of the kernel alone, as a CUDA graph (GPU time), microseconds.
2. Gather-attention (`gather_attention_triton`) over a dense own part (256 tokens, the prefix
   benchmark's own part) and over N_c = 512 random rows of a 4k context (the sparse path):
   BLOCK_N, warps and stages, then the split count over N_c with the best of those.
3. The whole shared step: prefix states + own part in two launches, in one launch
   (`shared_decode_attention_triton`, a few warps/stages), and dense SDPA.
4. The one-launch kernel: prefix tiles and splits, the own part's tile and split count, warps and
   stages.
5. The split merge (`merge_parts`) alone at the split counts of those shapes: rows per program,
   warps.
6. The heavy-token top-k of a selection step (`select_heavy_triton`) against ``torch.topk`` (the
   twin: masked fill, top-k, finite check) at the decode shapes of `hshare bench generate`: warps.

Writes ``$OUT/tune_kernels.json`` and prints short tables. Arguments pick sections
(``prefix gather step fused merge topk``; default all, which takes longer than one 10-minute device call:
run ``prefix gather`` and ``step fused merge`` as two calls; ``step fused merge`` took 7.5 minutes).
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from hshare.bench import dense_graph_us, dense_sdpa_us, graph_time_us
from hshare.kernels import select_heavy_torch
from hshare.kernels.gather_attention_triton import gather_attention_triton, merge_parts
from hshare.kernels.heavy_topk_triton import select_heavy_triton
from hshare.kernels.prefix_attention_triton import plan_prefix, shared_prefix_decode_states_triton
from hshare.kernels.shared_decode_triton import shared_decode_attention_triton

SHAPES = [(2, 2048), (2, 8192), (64, 2048), (64, 8192), (256, 2048), (256, 8192)]
Q_HEADS, KV_HEADS, DIM, OWN = 32, 8, 128, 256


def graph_us(fn) -> float | None:
    return graph_time_us(fn, torch.device("cuda"), warmup_ms=5, rep_ms=30)


def best(results: dict) -> tuple:
    timed = {k: v for k, v in results.items() if v is not None}
    return min(timed, key=timed.get)


def step_inputs(batch: int, prefix: int) -> tuple:
    """query [B, Hq, d], prefix keys/values [1, Hkv, P, d], own keys/values [B, Hkv, OWN, d], columns."""
    q = torch.randn(batch, Q_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(1, KV_HEADS, prefix, DIM, device="cuda", dtype=torch.bfloat16)
    own_k = torch.randn(batch, KV_HEADS, OWN, DIM, device="cuda", dtype=torch.bfloat16)
    cols = torch.arange(OWN, device="cuda").expand(batch, KV_HEADS, OWN).contiguous()
    return q, keys, torch.randn_like(keys), own_k, torch.randn_like(own_k), cols


def main() -> None:
    out_dir = os.environ.get("OUT", ".")
    torch.manual_seed(0)
    scale = DIM ** -0.5
    report = {"device": torch.cuda.get_device_name(), "prefix": [], "gather": [], "step": [], "fused": [], "merge": [],
              "topk": []}
    sections = sys.argv[1:] or ["prefix", "gather", "step", "fused", "merge", "topk"]

    print("prefix kernel (graph us): B P | auto | best tiles (bm, bn, warps, stages) | best splits")
    for batch, prefix in SHAPES if "prefix" in sections else ():
        q = torch.randn(batch, Q_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(1, KV_HEADS, prefix, DIM, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        auto = graph_us(lambda: shared_prefix_decode_states_triton(q, keys, values, scale))
        tiles = {}
        block_ms = (16, 32) if batch * Q_HEADS // KV_HEADS <= 16 else (64, 128)
        for bm, bn, warps, stages in itertools.product(block_ms, (32, 64, 128), (4, 8), (2, 3, 4)):
            tiles[(bm, bn, warps, stages)] = graph_us(lambda: shared_prefix_decode_states_triton(
                q, keys, values, scale, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages))
        bm, bn, warps, stages = best(tiles)
        splits = {}
        for count in (1, 2, 3, 4, 6, 8, 16, 32, 64):
            splits[count] = graph_us(lambda: shared_prefix_decode_states_triton(
                q, keys, values, scale, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, splits=count))
        chosen = best(splits)
        print(f"{batch:4d} {prefix:5d} | {auto:7.1f} | {tiles[(bm, bn, warps, stages)]:7.1f} {(bm, bn, warps, stages)}"
              f" | {splits[chosen]:7.1f} splits={chosen}")
        report["prefix"].append({"batch": batch, "prefix": prefix, "auto_us": auto,
                                 "tiles": {str(k): v for k, v in tiles.items()},
                                 "splits": {str(k): v for k, v in splits.items()},
                                 "best": {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages,
                                          "splits": chosen, "us": splits[chosen]}})

    print("gather kernel (graph us): case | auto | best (block_n, warps, stages) splits | GB/s at best")
    gather_cases = [("own256 B256", 256, 8, 32, 256, 256, True), ("own256 B64", 64, 8, 32, 256, 256, True),
                    ("own256 B2", 2, 8, 32, 256, 256, True), ("Nc512 n4k B16 MHA", 16, 32, 32, 4096, 512, False),
                    ("Nc512 n4k B64 GQA", 64, 8, 32, 4096, 512, False)]
    for name, batch, kv_heads, q_heads, n, budget, dense in gather_cases if "gather" in sections else ():
        q = torch.randn(batch, q_heads, DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, n, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        if dense:
            idx = torch.arange(n, device="cuda").expand(batch, kv_heads, n).contiguous()
        else:
            idx = torch.rand(batch, kv_heads, n, device="cuda").argsort(-1)[..., :budget].sort(-1).values
        auto = graph_us(lambda: gather_attention_triton(q, k, v, idx, scale))
        configs = {}
        for bn, warps, stages in itertools.product((32, 64, 128), (4, 8), (1, 2, 3)):
            configs[(bn, warps, stages)] = graph_us(lambda: gather_attention_triton(
                q, k, v, idx, scale, block_n=bn, num_warps=warps, num_stages=stages))
        chosen = best(configs)
        splits = {}  # the split over N_c (default: about two waves of SMs), with the best tiles
        for count in (1, 2, 4, 8, 16):
            splits[count] = graph_us(lambda: gather_attention_triton(
                q, k, v, idx, scale, block_n=chosen[0], num_warps=chosen[1], num_stages=chosen[2], splits=count))
        split = best(splits)
        moved = batch * kv_heads * budget * DIM * 2 * 2 + idx.numel() * idx.element_size()
        fastest = min(configs[chosen], splits[split])
        print(f"{name:20s} | {auto:7.1f} | {configs[chosen]:7.1f} {chosen} splits={split} {splits[split]:7.1f} | "
              f"{moved / fastest / 1e3:6.0f}")
        report["gather"].append({"case": name, "auto_us": auto, "configs": {str(k): v for k, v in configs.items()},
                                 "splits": {str(k): v for k, v in splits.items()},
                                 "best": {"block_n": chosen[0], "num_warps": chosen[1], "num_stages": chosen[2],
                                          "splits": split, "us": fastest}, "bytes": moved})

    print("whole shared step (graph us): B P | dense | two launches | one launch (warps, stages) | ratio")
    for batch, prefix in SHAPES if "step" in sections else ():
        q, keys, values, own_k, own_v, cols = step_inputs(batch, prefix)
        separate = graph_us(lambda: gather_attention_triton(
            q, own_k, own_v, cols, scale, partial=shared_prefix_decode_states_triton(q, keys, values, scale)))
        fused = {}
        for warps, stages in ((None, None), (4, 2), (4, 3), (8, 3)):
            fused[(warps, stages)] = graph_us(lambda: shared_decode_attention_triton(
                q, keys, values, None, None, own_k, own_v, cols, scale, num_warps=warps, num_stages=stages))
        chosen = best(fused)
        shared = fused[(None, None)]
        full_k = torch.cat((keys.expand(batch, -1, -1, -1), own_k), 2)
        full_v = torch.cat((values.expand(batch, -1, -1, -1), own_v), 2)
        fastest = min((d := dense_sdpa_us(q[:, :, None], full_k, full_v)), key=d.get)
        dense = dense_graph_us(q[:, :, None], full_k, full_v, fastest)
        print(f"{batch:4d} {prefix:5d} | {dense:7.1f} | {separate:7.1f} | {shared:7.1f} best {fused[chosen]:7.1f} "
              f"{chosen} | {dense / shared:5.2f}x")
        report["step"].append({"batch": batch, "prefix": prefix, "dense_graph_us": dense,
                                              "dense_backend": fastest, "two_launches_graph_us": separate,
                                              "one_launch_graph_us": {str(k): v for k, v in fused.items()}})
        del full_k, full_v

    print("one-launch grid (graph us): B P | default | best (prefix block_m, block_n, splits x, own block_n, "
          "own splits, warps, stages)")
    for batch, prefix in SHAPES if "fused" in sections else ():
        q, keys, values, own_k, own_v, cols = step_inputs(batch, prefix)
        folded = batch * Q_HEADS // KV_HEADS
        configs = {}
        for config in itertools.product((16, 32) if folded <= 16 else (64, 128), (32, 64), (0.5, 1, 2), (32, 64),
                                        (None, 2), (4,), (2, 3)):
            block_m, block_n, more_splits, own_block, own_splits, warps, stages = config
            auto_splits = plan_prefix(q, keys, values, scale, block_m=block_m, block_n=block_n).num_splits
            configs[config] = graph_us(lambda: shared_decode_attention_triton(
                q, keys, values, None, None, own_k, own_v, cols, scale, prefix_block_m=block_m,
                prefix_block_n=block_n, prefix_splits=max(1, int(auto_splits * more_splits)), own_block_n=own_block,
                own_splits=own_splits, num_warps=warps, num_stages=stages))
        default = graph_us(lambda: shared_decode_attention_triton(q, keys, values, None, None, own_k, own_v,
                                                                  cols, scale))
        chosen = best(configs)
        print(f"{batch:4d} {prefix:5d} | {default:7.1f} | {configs[chosen]:7.1f} {chosen}")
        report["fused"].append({"batch": batch, "prefix": prefix, "default_us": default,
                                "configs": {str(k): v for k, v in configs.items()}, "best": str(chosen)})

    print("split merge (graph us): B splits | default | best (rows, warps) | GB/s at best")
    for batch, splits in ((2, 36), (64, 9), (256, 4), (256, 12)) if "merge" in sections else ():
        q = torch.randn(batch, Q_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        part_out = torch.randn(batch, Q_HEADS, splits, DIM, device="cuda")
        part_lse = torch.randn(batch, Q_HEADS, splits, device="cuda")
        configs = {}
        for rows, warps in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)):
            configs[(rows, warps)] = graph_us(lambda: merge_parts(q, part_out, part_lse, None, rows=rows,
                                                                  num_warps=warps))
        default = graph_us(lambda: merge_parts(q, part_out, part_lse, None))
        chosen = best(configs)
        moved = part_out.numel() * 4 + part_lse.numel() * 4 + q.numel() * 2
        print(f"{batch:4d} {splits:3d} | {default:6.1f} | {configs[chosen]:6.1f} {chosen} | "
              f"{moved / configs[chosen] / 1e3:6.0f}")
        report["merge"].append({"batch": batch, "splits": splits, "default_us": default,
                                "configs": {str(k): v for k, v in configs.items()}, "best": str(chosen)})

    print("heavy top-k (graph us): rows heads n k | torch.topk | default | by warps")
    # B16 MHA at 1/2 head sharing and without (ds), a longer context, GQA B64
    for rows, heads, n, k in ((16, 16, 4352, 432), (16, 32, 4352, 432), (64, 8, 4352, 432), (16, 16, 16640, 432)) \
            if "topk" in sections else ():
        scores = torch.randn(rows, heads, n, device="cuda")
        selectable = torch.rand(rows, 1, n, device="cuda") < 0.95
        twin = graph_us(lambda: select_heavy_torch(scores, selectable, k))
        default = graph_us(lambda: select_heavy_triton(scores, selectable[:, 0], k))
        configs = {warps: graph_us(lambda: select_heavy_triton(scores, selectable[:, 0], k, num_warps=warps))
                   for warps in (4, 8, 16)}
        timed = " ".join(f"{w}:{t:.1f}" for w, t in configs.items() if t is not None)
        print(f"{rows:4d} {heads:3d} {n:6d} {k:4d} | {twin:7.1f} | {default:7.1f} | {timed}", flush=True)
        report["topk"].append({"rows": rows, "heads": heads, "n": n, "k": k, "torch_us": twin, "default_us": default,
                               "configs": {str(c): t for c, t in configs.items()}})

    with open(os.path.join(out_dir, "tune_kernels.json"), "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
