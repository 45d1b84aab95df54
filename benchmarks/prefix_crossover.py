"""Shared prefix or per-row dense decode: where holding a prefix once starts to pay under CUDA graphs.

On the GPU machine, for rows B sharing a P-token prefix plus an own part of 256 tokens, GQA 32/8 and MHA
32/32, d 128, bf16: the GPU time (one decode attention, replayed as a CUDA graph) of

* shared: `shared_decode_attention` (the prefix once for all rows and each row's own part, one launch,
  merged by LSE): what a decode step runs with the prefix stored once;
* dense: `split_decode_attention` over each row's materialised ``[prefix; own]`` columns: what the
  step runs when the prefix is stored per row.

"saved" is what ``prefix.min_saved_tokens`` compares: (B - 1) x P token reads per layer and step. The
table says, per shape, shared / dense; the smallest saved count from which every measured shape with at
least that many saved tokens is no slower shared is the graphs' entry of `AUTO_PREFIX_MIN_SAVED_TOKENS`.
The shared result is checked against the dense one on every shape (max abs error). Writes
``$OUT/prefix_crossover.json``.

Run: ``python3 benchmarks/prefix_crossover.py``.
"""

from __future__ import annotations

import json
import os

import torch

from hshare.bench.timing import graph_time_us
from hshare.kernels import PrefixKV, shared_decode_attention, split_decode_attention

HEADS = {"gqa": (32, 8), "mha": (32, 32)}
BATCHES = (2, 4, 16, 64)
PREFIXES = (256, 512, 1024, 2048, 4096)
OWN = 256
DIM = 128


def measure(q_heads: int, kv_heads: int, batch: int, prefix: int, device: torch.device) -> dict:
    """GPU time of one shared and one dense decode attention at this shape (graph replays, us)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    query = torch.randn(batch, q_heads, DIM, device=device, dtype=dtype)
    prefix_k = torch.randn(1, kv_heads, prefix, DIM, device=device, dtype=dtype)
    prefix_v = torch.randn_like(prefix_k)
    own_k = torch.randn(batch, kv_heads, OWN, DIM, device=device, dtype=dtype)
    own_v = torch.randn_like(own_k)
    own_columns = torch.arange(OWN, device=device).expand(batch, kv_heads, OWN).contiguous()
    full_k = torch.cat((prefix_k.expand(batch, -1, -1, -1), own_k), 2)
    full_v = torch.cat((prefix_v.expand(batch, -1, -1, -1), own_v), 2)
    scale = DIM ** -0.5

    def shared():
        return shared_decode_attention(query, PrefixKV(prefix_k, prefix_v), own_k, own_v, own_columns, scale)[0]

    def dense():
        return split_decode_attention(query, full_k, full_v, None, scale)

    error = float((shared().float() - dense().float()).abs().max())
    shared_us, dense_us = graph_time_us(shared, device), graph_time_us(dense, device)
    return dict(heads=f"{q_heads}/{kv_heads}", batch=batch, prefix=prefix, own=OWN, saved=(batch - 1) * prefix,
                shared_us=shared_us, dense_us=dense_us, shared_over_dense=shared_us / dense_us, max_abs_err=error)


def crossover(rows: list[dict]) -> int | None:
    """The smallest saved count such that every row saving at least as many is no slower shared."""
    for saved in sorted({row["saved"] for row in rows}):
        if all(row["shared_over_dense"] <= 1.0 for row in rows if row["saved"] >= saved):
            return saved
    return None


def main() -> None:
    device = torch.device("cuda")
    rows = [measure(*HEADS[kind], batch, prefix, device) for kind in HEADS for batch in BATCHES for prefix in PREFIXES]
    print("| heads | B | P | saved | dense us | shared us | shared / dense | max abs err |")
    print("|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["heads"], r["saved"])):
        print(f"| {row['heads']} | {row['batch']} | {row['prefix']} | {row['saved']} | {row['dense_us']:.1f} | "
              f"{row['shared_us']:.1f} | {row['shared_over_dense']:.2f} | {row['max_abs_err']:.1e} |")
    result = {"device": torch.cuda.get_device_name(), "rows": rows, "crossover_saved_tokens": crossover(rows)}
    print(f"crossover: shared is no slower from {result['crossover_saved_tokens']} saved tokens")
    with open(os.path.join(os.environ.get("OUT", "."), "prefix_crossover.json"), "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
