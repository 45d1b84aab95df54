"""The weight products of a decode step: a weight-streaming Triton product for few rows against cuBLAS (``F.linear``).

The kernel here is an experiment, not a library path: program (block of ``block_n`` output columns, split
of K) streams its ``[block_n, K / split]`` slab of the weight once, contiguous along K, and multiplies it with
all M <= 16 rows (padded to 16 for the tensor cores) in fp32; with ``split > 1`` the splits write fp32
partials and a second launch sums them in a fixed order.

On the GPU machine, bf16, the linear layers of Llama-3-8B and Llama-2-7B (q/k/v/o, gate/up, down, the
LM head) at rows M in {1, 4, 16}. Each product is timed cold, as a decode step meets it: one CUDA graph
runs the product over enough distinct copies of the weight to exceed the L2 cache many times, and is
replayed; the time per product is the replay's over the copies (CUDA events, median of replays). Every
candidate tile of `candidate_tiles` is timed; the best is checked against an fp32 product.

The bandwidth column is the weight's bytes over the time; the copy bandwidth (a device copy of 1 GiB,
read + write) is measured in the same run. Prints a table and writes ``$OUT/decode_linear.json``.

Run: ``python3 benchmarks/decode_linear.py [--rows 1 4 16] [--shapes l3-q/o ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of one program's tile (tl.dot's smallest M)


@dataclass(frozen=True)
class LinearTile:
    """A launch configuration of `decode_linear_triton`: output columns per program, the K chunk of one
    load, the number of K splits, warps and pipeline stages."""

    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearTile.{name}={value} must be a power of two >= 16")
        if self.split < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"LinearTile {self} needs split, num_warps and num_stages >= 1")


@triton.jit
def _decode_linear(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, k_per_split, s_xm, s_wn, s_om,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (column block, K split): the fp32 product of its weight slab with the M rows."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    start = tl.program_id(1) * k_per_split
    col_ok = cols < N
    row_ok = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w_base = w_ptr + cols.to(tl.int64)[:, None] * s_wn
    for k0 in range(start, start + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    ok = row_ok[:, None] & col_ok[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * s_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part = part_ptr + (tl.program_id(1) * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(part, acc, mask=ok)


@triton.jit
def _sum_splits(part_ptr, bias_ptr, out_ptr, M, N, split, s_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, column block): the sum of the `split` fp32 partials in split order, plus the bias."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(split):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def decode_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         tile: LinearTile) -> torch.Tensor:
    """``x [..., K]`` (at most `MAX_ROWS` rows in all) times ``weight [N, K]`` (unit stride on K) transposed,
    plus ``bias [N]``: ``[..., N]`` in x's dtype (contract: `decode_linear.decode_linear_torch`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"decode_linear_triton takes at most {MAX_ROWS} rows, got {m}")
    if weight.stride(-1) != 1 or flat.stride(-1) != 1:
        raise ValueError("decode_linear_triton needs a unit stride on K of the input and the weight")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m * n == 0:
        return out.reshape(*lead, n)
    chunk = triton.cdiv(triton.cdiv(k, tile.split), tile.block_k) * tile.block_k  # K per split, whole chunks
    split = triton.cdiv(k, chunk)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    bias_arg = bias if bias is not None else out
    _decode_linear[(triton.cdiv(n, tile.block_n), split)](
        flat, weight, bias_arg, out, part, m, n, k, chunk, flat.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None and split == 1, PARTIAL=split > 1, BLOCK_M=MAX_ROWS, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if split > 1:
        block = 256
        _sum_splits[(m, triton.cdiv(n, block))](part, bias_arg, out, m, n, split, out.stride(0),
                                                HAS_BIAS=bias is not None, BLOCK=block)
    return out.reshape(*lead, n)


def candidate_tiles(rows: int, n: int, k: int, sms: int) -> list[LinearTile]:
    """The launch configurations worth timing for an ``[rows, k] x [n, k]^T`` product on a GPU of `sms`
    multiprocessors: column blocks of 32-128, K chunks of 128-512, and the split that brings the programs
    to about one, two or four waves."""
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
    print(f"{'shape':<12}{'M':>4}{'cuBLAS us':>11}{'TB/s':>7}{'triton us':>11}{'TB/s':>7}{'x':>6}  tile   max err")
    rows_out = []
    for name in args.shapes:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, COLD_BYTES // nbytes)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_cublas = graph_time(lambda i: F.linear(x, weights[i]), copies)
            best = None
            tiles = candidate_tiles(m, n, k, sms)
            for tile in tiles:
                try:
                    t = graph_time(lambda i: decode_linear_triton(x, weights[i], None, tile), copies)
                except Exception as error:  # a tile that does not compile or fit is skipped, and said
                    print(f"  {name} M{m} {tile}: {type(error).__name__}: {str(error)[:120]}")
                    continue
                if best is None or t < best[0]:
                    best = (t, tile)
            t_best, tile = best
            ref = F.linear(x.float(), weights[0].float())
            err = (decode_linear_triton(x, weights[0], None, tile).float() - ref).abs().max().item()
            err_cublas = (F.linear(x, weights[0]).float() - ref).abs().max().item()
            row = dict(shape=name, n=n, k=k, rows=m, cublas_s=t_cublas, triton_s=t_best, tile=tile.__dict__,
                       cublas_tbps=nbytes / t_cublas / 1e12, triton_tbps=nbytes / t_best / 1e12,
                       max_err=err, max_err_cublas=err_cublas, copy_tbps=copy / 1e12, tiles_timed=len(tiles))
            rows_out.append(row)
            print(f"{name:<12}{m:>4}{t_cublas * 1e6:>11.1f}{row['cublas_tbps']:>7.2f}{t_best * 1e6:>11.1f}"
                  f"{row['triton_tbps']:>7.2f}{t_cublas / t_best:>6.2f}  {tile.block_n}x{tile.block_k}/s{tile.split}"
                  f"/w{tile.num_warps}  {err:.1e} (cuBLAS {err_cublas:.1e})", flush=True)
        del weights
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "decode_linear.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), copy_tbps=copy / 1e12, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
