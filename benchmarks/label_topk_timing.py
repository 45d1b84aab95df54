"""Times a selection step's label scoring + heavy top-k on one GPU: today's path (`decode_label_scores`,
the ``[A, H, n]`` fp32 scores, then `select_heavy`: the Triton top-k up to its column limit,
``torch.topk`` beyond) against the fused `decode_label_topk` (one launch for rows of one chunk, two
beyond; no score tensor), with per-row column bounds and the selectable mask, and with bounds alone.

Each path is replayed as a CUDA graph (`hshare.bench.timing.graph_time_us`: GPU time, L2 flushed
before each replay, so the labels come from HBM). The floor of a selection is its label bytes
(codes, scale and zero of every scored column; the mask's bytes too for the paths that read it) over
the bandwidth of a device copy measured in the same run; "% floor" is floor time / measured time.
The fused columns are checked against today's scores (the top-k contract, tie-robust).

    python3 benchmarks/label_topk_timing.py                       # the default shapes and budgets
    python3 benchmarks/label_topk_timing.py --shapes 4x8x32768 --heavy 944 --chunk 8192 --warps 16
    python3 benchmarks/label_topk_timing.py --trend 2.0           # scores growing with the position
    python3 benchmarks/label_topk_timing.py --kernels             # also the fused path's time per kernel

Labels are random codes of ``--channels`` heavy channels at ``--bits`` with bf16 scale / zero (the
cache's layout for bf16 keys; 16 bits: bf16 codes stored channel-major, as Loki's projected keys are); queries bf16, head dim 128, one query head per selection head; the
selectable window of every row is ``[16, n - 64)`` (sink 16, local 64).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from hshare.bench.timing import copy_bandwidth, graph_time_us
from hshare.kernels import decode_label_scores, select_heavy
from hshare.kernels.label_topk import decode_label_topk
from hshare.kernels.label_topk_triton import label_topk_triton

SHAPES = ["4x8x32768", "1x8x131072", "16x32x4096"]
HEAVY = [944, 1968]
SINK, LOCAL, HEAD_DIM = 16, 64, 128


def make_step(rows: int, heads: int, n: int, bits: int, channels: int, trend: float, device: torch.device):
    """A label cache ``[rows, heads, n, .]``, the decode query, heavy channels and the selectable window."""
    if bits == 16:  # channel-major, as Loki stores its projected keys
        codes = torch.randn(rows, heads, channels, n, device=device).to(torch.bfloat16).transpose(-1, -2)
        scale = zero = None
    else:
        codes = torch.randint(0, 256, (rows, heads, n, channels * bits // 8), dtype=torch.uint8, device=device)
        scale = (torch.rand(rows, heads, n, device=device) * 0.2 + 0.05).to(torch.bfloat16)
        position = torch.linspace(0.0, 1.0, n, device=device)
        zero = (torch.randn(rows, heads, n, device=device) * 0.5 + trend * position).to(torch.bfloat16)
    query = torch.randn(rows, heads, HEAD_DIM, device=device).to(torch.bfloat16)
    if trend:
        query = query.abs()  # a positive label sum: the zero points' trend reaches the scores
    chans = torch.stack([torch.randperm(HEAD_DIM, device=device)[:channels] for _ in range(heads)])[None]
    window = torch.tensor([SINK, n - LOCAL], device=device).expand(rows, 2).contiguous()
    columns = torch.arange(n, device=device)
    selectable = ((columns >= SINK) & (columns < n - LOCAL)).expand(rows, n).contiguous()
    return codes, scale, zero, query, chans, window, selectable


def label_bytes(rows: int, heads: int, n: int, bits: int, channels: int) -> int:
    """Bytes of the labels a selection scores: codes, and bf16 scale and zero below 16 bits."""
    per_column = channels * bits // 8 + (0 if bits == 16 else 4)
    return rows * heads * n * per_column


def kernel_times_us(fn, repeats: int = 20) -> Counter:
    """GPU microseconds per kernel name of one call of `fn` (mean of `repeats` eager calls under the
    profiler; L2 is not flushed between them, so the second launch's label reads may hit it)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return Counter({event.key: event.device_time_total / repeats for event in prof.key_averages()
                    if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0})


def valid_top_k(columns: torch.Tensor, scores: torch.Tensor, selectable: torch.Tensor, heavy: int) -> bool:
    """`columns` keep min(heavy, |window|) distinct finite window columns, none scored below an unchosen
    one beyond rounding (the scores of today's path, the fused path's own may differ in the last bit)."""
    ok = selectable[:, None] & torch.isfinite(scores)
    n = scores.shape[-1]
    picked = columns >= 0
    hits = torch.zeros(*scores.shape[:-1], n + 1, dtype=torch.long, device=scores.device)
    hits.scatter_add_(-1, torch.where(picked, columns, torch.full_like(columns, n)), picked.long())
    chosen = hits[..., :n] > 0
    if (bool((hits[..., :n] > 1).any()) or not torch.equal(picked.sum(-1), ok.sum(-1).clamp(max=heavy))
            or bool((chosen & ~ok).any())):
        return False
    inf = torch.tensor(float("inf"), device=scores.device)
    lowest = torch.where(chosen, scores, inf).amin(-1)
    best_left = torch.where(ok & ~chosen, scores, -inf).amax(-1)
    tol = 1e-5 * scores.abs().amax().clamp(min=1.0)
    return bool((lowest >= best_left - tol).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="rows x heads x n, comma-separated")
    parser.add_argument("--heavy", default=",".join(map(str, HEAVY)), help="heavy budgets, comma-separated")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8, 16))
    parser.add_argument("--channels", type=int, default=16, help="label channels r")
    parser.add_argument("--trend", type=float, default=0.0, help="score drift over the positions (0: none)")
    parser.add_argument("--chunk", type=int, default=None, help="fused: columns per program (a power of two)")
    parser.add_argument("--tile", type=int, default=None, help="fused: candidates per tile of the last program")
    parser.add_argument("--warps", type=int, default=None, help="fused: warps per program")
    parser.add_argument("--tail-warps", type=int, default=None, help="fused: warps per program of the select launch")
    parser.add_argument("--maxnreg", type=int, default=None, help="fused: registers a thread at most")
    parser.add_argument("--kernels", action="store_true", help="fused: also print its GPU time per kernel")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only checks the script (no timings)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; device copy {bandwidth / 1e9:.0f} GB/s; "
          f"labels {args.channels} x {args.bits} bits, bf16 scale / zero")
    header = ("rows x heads x n", "heavy", "labels MiB", "floor us", "today us", "fused us", "fused, bounds us",
              "speedup", "today % floor", "fused % floor", "bounds % floor", "valid")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    results = []
    overrides = dict(chunk=args.chunk, tile=args.tile, num_warps=args.warps, tail_warps=args.tail_warps,
                     max_registers=args.maxnreg)
    for shape in args.shapes.split(","):
        rows, heads, n = map(int, shape.split("x"))
        codes, scale, zero, query, chans, window, selectable = make_step(
            rows, heads, n, args.bits, args.channels, args.trend, device)
        labels = label_bytes(rows, heads, n, args.bits, args.channels)
        mask_bytes = rows * n
        all_rows = torch.arange(rows, device=device)
        all_heads = torch.arange(heads, device=device)[None]
        today_codes = codes.contiguous()  # the scores' kernel reads codes contiguous per column
        for heavy in map(int, args.heavy.split(",")):
            def today():
                scores = decode_label_scores(query, chans, today_codes, scale, zero, args.bits)
                return select_heavy(scores, selectable[:, None], heavy)

            def fused(bounds_only=False):
                mask = None if bounds_only else selectable
                if any(v is not None for v in overrides.values()):
                    return label_topk_triton(None, codes, scale, zero, args.bits, heavy, all_rows, all_heads, window,
                                             mask, query=query, channels=chans, **overrides)
                return decode_label_topk(query, chans, codes, scale, zero, args.bits, heavy, window, mask)

            with torch.no_grad():
                scores = decode_label_scores(query, chans, today_codes, scale, zero, args.bits)
                valid = (valid_top_k(fused(), scores, selectable, heavy)
                         and valid_top_k(fused(True), scores, selectable, heavy))
                del scores
                today_us = graph_time_us(today, device)
                fused_us = graph_time_us(fused, device)
                bounds_us = graph_time_us(lambda: fused(True), device)
            floor_us = labels / bandwidth * 1e6
            floor_mask_us = (labels + mask_bytes) / bandwidth * 1e6

            def share(floor, measured):
                return f"{100 * floor / measured:.0f}%" if measured else "n/a"

            def us(value):
                return f"{value:.1f}" if value else ("not capturable" if device.type == "cuda" else "n/a")

            speedup = f"{today_us / fused_us:.2f}x" if today_us and fused_us else "n/a"
            print(" | ".join((shape, str(heavy), f"{labels / 2**20:.1f}", f"{floor_us:.1f}", us(today_us), us(fused_us),
                              us(bounds_us), speedup, share(floor_mask_us, today_us), share(floor_mask_us, fused_us),
                              share(floor_us, bounds_us), "yes" if valid else "NO")), flush=True)
            kernels = {}
            if args.kernels and device.type == "cuda":
                with torch.no_grad():
                    kernels = kernel_times_us(fused)
                print("  fused kernels (us, profiler, L2 warm): "
                      + ", ".join(f"{name} {value:.1f}" for name, value in kernels.most_common()), flush=True)
            results.append(dict(shape=shape, heavy=heavy, label_bytes=labels, mask_bytes=mask_bytes,
                                bandwidth_gb_s=bandwidth / 1e9, floor_us=floor_us, today_us=today_us,
                                fused_us=fused_us, fused_bounds_us=bounds_us, valid=valid, kernels=dict(kernels)))
        del codes, scale, zero, query, chans, window, selectable
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(device=name, bits=args.bits, channels=args.channels,
                           trend=args.trend, rows=results), handle, indent=1)


if __name__ == "__main__":
    main()
