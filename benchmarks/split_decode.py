"""Dense decode attention split over the keys (`split_decode_attention`) against today's dense decode.

On the GPU machine, GQA 32/8 and MHA 32/32, d 128, bf16, rows B in {1, 4, 16, 64} and N keys in
{4096, 32768, 131072} (shapes whose K and V exceed 40 GB are skipped), the odd rows left-padded.
Median time (triton's do_bench) of each path, and the same replayed as a CUDA graph (GPU time alone):

* split: `split_decode_attention` (Triton: (row, KV head, split) programs, then the LSE merge);
* masked: SDPA on the folded GQA query with a bool mask ``[B, 1, 1, N]`` (SDPA's masked kernel, the path before);
* sdpa: SDPA without a mask on the folded GQA query (the dense kernel without a mask; it attends to
  the padding, so it is a speed reference only).

The floor is K and V read once at 3.0e12 B/s; each path's share of the floor is floor / time. The
split result is checked on each shape against the twin in fp32 on its first and last rows (max
error of out and of the LSE). Prints a table and writes the rows to ``$OUT/split_decode.json``
(OUT: default the current folder).

``--sweep`` also times the split path's launch configurations (tile of keys, warps, stages at the
planned split count; then half and twice the planned splits) as CUDA graphs, to choose its defaults.

Run: ``python3 benchmarks/split_decode.py [--quick] [--shapes gqa:1:131072 mha:4:4096 ...] [--sweep] [--list]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HEADS = {"gqa": (32, 8), "mha": (32, 32)}  # (Hq, Hkv)
DIM = 128
BATCHES = (1, 4, 16, 64)
LENGTHS = (4096, 32768, 131072)
QUICK = ("gqa:1:131072", "gqa:16:32768", "mha:4:4096", "mha:64:4096")
MAX_KV_BYTES = 40e9
FLOOR_BYTES_PER_S = 3.0e12
SWEEP = ((32, 4, 3), (32, 4, 2), (64, 4, 3), (64, 4, 2), (64, 8, 3), (128, 8, 2))  # (block_n, num_warps, num_stages)


def parse_shape(text: str) -> tuple[str, int, int]:
    """``kind:B:N`` (kind gqa or mha) -> ``(kind, B, N)``."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in HEADS or not parts[1].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"shape {text!r}; accepted: kind:B:N with kind gqa or mha, e.g. gqa:16:32768")
    return parts[0], int(parts[1]), int(parts[2])


def kv_bytes(kind: str, batch: int, n_keys: int) -> int:
    return 2 * batch * HEADS[kind][1] * n_keys * DIM * torch.bfloat16.itemsize


def shapes_of(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    if args.shapes:
        return args.shapes
    if args.quick:
        return [parse_shape(text) for text in QUICK]
    return [(kind, batch, n) for kind in HEADS for batch in BATCHES for n in LENGTHS
            if kv_bytes(kind, batch, n) <= MAX_KV_BYTES]


def inputs(kind: str, batch: int, n_keys: int, device: str = "cuda") -> tuple:
    """query ``[B, Hq, d]``, key and value ``[B, Hkv, N, d]`` bf16, valid ``[B, N]``: odd rows left-padded."""
    q_heads, kv_heads = HEADS[kind]
    query = torch.randn(batch, q_heads, DIM, device=device, dtype=torch.bfloat16)
    key = torch.randn(batch, kv_heads, n_keys, DIM, device=device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    valid = torch.ones(batch, n_keys, dtype=torch.bool, device=device)
    for row in range(1, batch, 2):
        valid[row, : n_keys // 2 * row // batch] = False
    return query, key, value, valid


def twin_error(query, key, value, valid, scale, out, lse) -> tuple[float, float]:
    """Max |out - twin| and |lse - twin| on the first and last rows, the twin in fp32."""
    from hshare.kernels.split_decode import split_decode_attention_torch

    rows = sorted({0, query.shape[0] - 1})
    ref_out, ref_lse = split_decode_attention_torch(query[rows].float(), key[rows].float(), value[rows].float(),
                                                    valid[rows], scale, return_lse=True)
    finite = torch.isfinite(ref_lse)
    return ((out[rows].float() - ref_out).abs().max().item(),
            (lse[rows] - ref_lse)[finite].abs().max().item())


def measure(kind: str, batch: int, n_keys: int, sweep: bool = False) -> dict:
    import torch.nn.functional as F

    from hshare.bench import graph_time_us, time_us
    from hshare.kernels.gather_attention_triton import num_sms
    from hshare.kernels.split_decode import split_decode_attention
    from hshare.kernels.split_decode_triton import plan_split_decode, split_decode_attention_triton

    query, key, value, valid = inputs(kind, batch, n_keys)
    q_heads, kv_heads = HEADS[kind]
    scale = DIM ** -0.5
    mask = valid[:, None, None, :]
    folded = query.view(batch, kv_heads, q_heads // kv_heads, DIM)
    paths = {
        "split": lambda: split_decode_attention(query, key, value, valid, scale),
        "masked": lambda: F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale),
        "sdpa": lambda: F.scaled_dot_product_attention(folded, key, value, scale=scale),
    }
    floor_us = kv_bytes(kind, batch, n_keys) / FLOOR_BYTES_PER_S * 1e6
    row = dict(kind=kind, q_heads=q_heads, kv_heads=kv_heads, batch=batch, n_keys=n_keys,
               kv_gb=kv_bytes(kind, batch, n_keys) / 1e9, floor_us=floor_us,
               splits=plan_split_decode(batch, kv_heads, n_keys, num_sms(query.device)))
    for name, fn in paths.items():
        row[f"{name}_us"] = time_us(fn, query.device)
        row[f"{name}_graph_us"] = graph_time_us(fn, query.device)
        row[f"{name}_share"] = floor_us / row[f"{name}_us"]
    out, lse = split_decode_attention(query, key, value, valid, scale, return_lse=True)
    row["max_err_out"], row["max_err_lse"] = twin_error(query, key, value, valid, scale, out, lse)
    if sweep:
        configs = [dict(block_n=tile, num_warps=warps, num_stages=stages) for tile, warps, stages in SWEEP]
        configs += [dict(splits=splits) for splits in (max(1, row["splits"] // 2), 2 * row["splits"])]
        row["sweep"] = {}
        for config in configs:
            name = " ".join(f"{option}={setting}" for option, setting in config.items())
            row["sweep"][name] = graph_time_us(
                lambda: split_decode_attention_triton(query, key, value, valid, scale, **config), query.device)
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':<18}{'KV GB':>7}{'splits':>7}{'floor':>9}{'split':>9}{'masked':>9}{'sdpa':>9}"
          f"{'split%':>8}{'mask%':>7}{'sdpa%':>7}{'split g':>9}{'mask g':>9}{'err':>9}")
    for r in rows:
        graph = [f"{r[k]:9.1f}" if r[k] is not None else f"{'-':>9}" for k in ("split_graph_us", "masked_graph_us")]
        print(f"{r['kind']} B{r['batch']} N{r['n_keys']:<8}".ljust(18) + f"{r['kv_gb']:7.2f}{r['splits']:7d}"
              f"{r['floor_us']:9.1f}{r['split_us']:9.1f}{r['masked_us']:9.1f}{r['sdpa_us']:9.1f}"
              f"{100 * r['split_share']:7.0f}%{100 * r['masked_share']:6.0f}%{100 * r['sdpa_share']:6.0f}%"
              + "".join(graph) + f"{r['max_err_out']:9.1e}")
    print("times in us (median of do_bench; 'g': CUDA-graph replay); %: share of the memory floor (floor / time)")
    for r in rows:
        if "sweep" in r:
            timed = ", ".join(f"{config}: {us if us is None else round(us, 1)}" for config, us in r["sweep"].items())
            print(f"sweep {r['kind']} B{r['batch']} N{r['n_keys']} (graph us, default {r['split_graph_us']}): {timed}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a few shapes: {' '.join(QUICK)}")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="KIND:B:N",
                        help="the shapes to run, e.g. gqa:16:32768 mha:4:4096 (kind gqa = 32/8, mha = 32/32)")
    parser.add_argument("--sweep", action="store_true", help="also time the split path's launch configurations")
    parser.add_argument("--list", action="store_true", help="print the shapes and their split plans, run nothing")
    args = parser.parse_args(argv)
    shapes = shapes_of(args)
    if args.list:
        from hshare.kernels.split_decode_triton import plan_split_decode

        sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
        for kind, batch, n_keys in shapes:
            print(f"{kind}:{batch}:{n_keys}  KV {kv_bytes(kind, batch, n_keys) / 1e9:.2f} GB  splits "
                  f"{plan_split_decode(batch, HEADS[kind][1], n_keys, sms)} ({sms} SMs)")
        return 0
    if not torch.cuda.is_available():
        print("split_decode.py times CUDA kernels: run it on a GPU (--list works anywhere)", file=sys.stderr)
        return 2
    rows = []
    path = os.path.join(os.environ.get("OUT", "."), "split_decode.json")
    for kind, batch, n_keys in shapes:
        rows.append(measure(kind, batch, n_keys, args.sweep))
        torch.cuda.empty_cache()
        with open(path, "w") as f:  # after every shape: a cut-off run keeps what it measured
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=__import__("triton").__version__, rows=rows), f, indent=1)
        print(f"{kind}:{batch}:{n_keys} done", flush=True)
    print_table(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
