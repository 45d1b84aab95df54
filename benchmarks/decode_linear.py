"""The weight products of a decode step: `kernels.decode_linear_triton` against cuBLAS (``F.linear``).

On the GPU machine, bf16, the linear layers of Llama-3-8B and Llama-2-7B (q/k/v/o, gate/up, down, the
LM head) at rows M in {1, 4, 16}. Each product is timed cold, as a decode step meets it: one CUDA graph
runs the product over enough distinct copies of the weight to exceed the L2 cache many times, and is
replayed; the time per product is the replay's over the copies (CUDA events, median of replays). Every
tile of a sweep (`sweep_tiles`) is timed; "planned" is the best of the tiles a plan times
(`kernels.decode_linear.candidate_tiles`), what the library runs where it beats cuBLAS; the sweep's best
is checked against an fp32 product.

The bandwidth column is the weight's bytes over the time; the copy bandwidth (a device copy of 1 GiB,
read + write) is measured in the same run. Prints a table and writes ``$OUT/decode_linear.json``.

Run: ``python3 benchmarks/decode_linear.py [--rows 1 4 16] [--shapes l3-q/o ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import torch
import torch.nn.functional as F
import triton

from hshare.kernels.decode_linear import LinearTile, candidate_tiles
from hshare.kernels.decode_linear_triton import decode_linear_triton

def sweep_tiles(rows: int, n: int, k: int, sms: int) -> list[LinearTile]:
    """Every launch configuration this sweep times: column blocks of 32-128, K chunks of 128-512, and the
    split that brings the programs to about one, two or four waves."""
    tiles = []
    for block_n in (32, 64, 128):
        blocks = triton.cdiv(n, block_n)
        for waves in (1, 2, 4):
            split = max(1, min(16, round(waves * sms / blocks)))
            for block_k in (128, 256, 512):
                if block_n * block_k > 64 * 256 or split * block_k > k:
                    continue
                for warps in (4, 8):
                    tiles.append(LinearTile(block_n, block_k, split, warps, 3))
    return sorted(set(tiles), key=lambda t: (t.block_n, t.block_k, t.split, t.num_warps))


SHAPES = {  # name: (N, K)
    "l3-q/o": (4096, 4096), "l3-k/v": (1024, 4096), "l3-gate/up": (14336, 4096), "l3-down": (4096, 14336),
    "l3-head": (128256, 4096), "l2-gate/up": (11008, 4096), "l2-down": (4096, 11008), "l2-head": (32000, 4096),
}
COLD_BYTES = 1 << 30  # distinct weight bytes one timed graph reads


def graph_time(fn, copies: int, replays: int = 15) -> float:
    """Seconds per call of ``fn(i)`` for i in range(copies), captured once as a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(copies, 2)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / copies)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    seconds = graph_time(lambda i: dst.copy_(src), 4)
    return 2 * src.numel() * src.element_size() / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", ".")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name(0)}, {sms} SMs, copy bandwidth {copy / 1e12:.2f} TB/s")
    print(f"{'shape':<12}{'M':>4}{'cuBLAS us':>11}{'TB/s':>7}{'planned us':>11}{'TB/s':>7}{'sweep us':>10}{'TB/s':>7}"
          f"  sweep tile   max err")
    rows_out = []
    for name in args.shapes:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, COLD_BYTES // nbytes)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_cublas = graph_time(lambda i: F.linear(x, weights[i]), copies)
            timed = {}
            planned = candidate_tiles(n, k, sms)
            for tile in dict.fromkeys(sweep_tiles(m, n, k, sms) + planned):
                try:
                    timed[tile] = graph_time(lambda i: decode_linear_triton(x, weights[i], None, tile), copies)
                except Exception as error:  # a tile that does not compile or fit is skipped, and said
                    print(f"  {name} M{m} {tile}: {type(error).__name__}: {str(error)[:120]}")
            tile = min(timed, key=timed.get)
            t_best, t_planned = timed[tile], min(timed[t] for t in planned if t in timed)
            ref = F.linear(x.float(), weights[0].float())
            err = (decode_linear_triton(x, weights[0], None, tile).float() - ref).abs().max().item()
            err_cublas = (F.linear(x, weights[0]).float() - ref).abs().max().item()
            row = dict(shape=name, n=n, k=k, rows=m, cublas_s=t_cublas, planned_s=min(t_planned, t_cublas),
                       triton_s=t_best, tile=tile.__dict__, cublas_tbps=nbytes / t_cublas / 1e12,
                       planned_tbps=nbytes / min(t_planned, t_cublas) / 1e12, triton_tbps=nbytes / t_best / 1e12,
                       max_err=err, max_err_cublas=err_cublas, copy_tbps=copy / 1e12, tiles_timed=len(timed))
            rows_out.append(row)
            print(f"{name:<12}{m:>4}{t_cublas * 1e6:>11.1f}{row['cublas_tbps']:>7.2f}{row['planned_s'] * 1e6:>11.1f}"
                  f"{row['planned_tbps']:>7.2f}{t_best * 1e6:>10.1f}{row['triton_tbps']:>7.2f}  {tile.block_n}x"
                  f"{tile.block_k}/s{tile.split}/w{tile.num_warps}  {err:.1e} (cuBLAS {err_cublas:.1e})", flush=True)
        del weights
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "decode_linear.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), copy_tbps=copy / 1e12, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
