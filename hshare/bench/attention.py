"""``hshare bench attention`` (issue: Triton kernels): decode attention against dense SDPA,
measured in the same run (the numbers quoted in ``benchmarks/RESULTS.md``).

The time of one (layer, decode step) averaged over a whole sharing cycle, everything the patched
attention does at decode: label append, row windows (once per step, shared by the layers), label
scoring and top-k on the selecting fraction of (layer, step) pairs and on the source heads only,
critical indices and gather-attention. The dense reference is SDPA with every backend that runs;
the fastest is quoted. Steps whose per-layer KV is below ``dense_fallback_mib`` run dense; the
table says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hshare.bench.results import environment, speedup_panels, write
from hshare.bench.timing import dense_graph_us, dense_sdpa_us, graph_time_us, time_us
from hshare.config import HShareConfig
from hshare.kernels import gather_attention, score_heads
from hshare.labels import LabelCache
from hshare.selection import RowWindows, select_heavy

MHA_SHAPES = [(b, 32, 32, n) for b in (8, 16) for n in (1024, 2048, 4096)]  # Llama-2-7B
GQA_SHAPES = [(b, 32, 8, n) for b in (16, 64) for n in (4096, 16384)]  # Llama-3-8B
SMOKE_ATTENTION_SHAPES = [(2, 4, 2, 256), (2, 4, 4, 128)]
PRESETS = ("ds", "hshare-1_2-1_2-1_2", "hshare-3_4-3_4-1_2")


@dataclass
class AttentionRow:
    shape: str
    kv_mib_per_layer: float
    dense_us: dict
    fastest_dense: str
    preset: str
    path: str
    append_us: float
    windows_us: float
    selection_us: float
    selecting_fraction: float
    gather_us: float
    step_us: float
    speedup: float
    gather_tbps: float
    dense_graph_us: float | None
    step_graph_us: float | None
    speedup_graph: float | None
    components_graph_us: dict | None


def bench_attention(shapes, dtype=torch.float16, device="cuda", budget_ratio=8, layers=32,
                    presets=PRESETS) -> list[AttentionRow]:
    """Per (layer, decode step) time of each preset over a sharing cycle against dense SDPA."""
    device = torch.device(device)
    rows = []
    for batch, q_heads, kv_heads, n in shapes:
        torch.manual_seed(0)
        dim = 128 if device.type == "cuda" else 16
        q = torch.randn(batch, q_heads, 1, dim, device=device, dtype=dtype)
        k = torch.randn(batch, kv_heads, n, dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        dense = dense_sdpa_us(q, k, v)
        fastest = min(dense, key=dense.get)
        dense_graph = dense_graph_us(q, k, v, fastest)
        kv_bytes = k.numel() * k.element_size() * 2
        for preset in presets:
            config = HShareConfig.from_preset(preset)
            budget = n // budget_ratio
            sink, local = max(1, budget // 32), max(1, budget // 8)
            config = config.replace(sink=sink, local=local, heavy=budget - sink - local,
                                    label_channels=min(16, dim))
            row = bench_preset(q, k, v, config, layers)
            fallback = kv_bytes < config.dense_fallback_bytes(device)
            step = dense[fastest] + row["append_us"] if fallback else row["step_us"]
            step_graph = row["step_graph_us"]
            if fallback and step_graph is not None and dense_graph is not None:
                step_graph = dense_graph + row["append_graph_us"]
            rows.append(AttentionRow(
                shape=f"B{batch} {q_heads}/{kv_heads} n{n} N_c{budget}", kv_mib_per_layer=kv_bytes / 2**20,
                dense_us=dense, fastest_dense=fastest, preset=preset, path="dense fallback" if fallback else "sparse",
                append_us=row["append_us"], windows_us=row["windows_us"] / layers, selection_us=row["selection_us"],
                selecting_fraction=row["fraction"], gather_us=row["gather_us"], step_us=step,
                speedup=dense[fastest] / step,
                gather_tbps=batch * kv_heads * budget * dim * k.element_size() * 2 / row["gather_us"] / 1e6,
                dense_graph_us=dense_graph, step_graph_us=step_graph,
                speedup_graph=dense_graph / step_graph if dense_graph and step_graph else None,
                components_graph_us=row["components_graph_us"],
            ))
    return rows


def bench_preset(q, k, v, config: HShareConfig, layers: int) -> dict:
    """Components of one (layer, step) of `config` on one layer's cache (selection per KV head)."""
    batch, q_heads, _, dim = q.shape
    kv_heads, n = k.shape[1], k.shape[2]
    device = q.device
    channels = torch.randperm(dim, device=device)[:config.label_channels].expand(1, kv_heads, -1).contiguous()
    labels = LabelCache(channels, config.label_bits, kv_heads)
    labels.append(k[:, :, :n - 1])
    new_key = k[:, :, n - 1:]

    def append():
        labels.append(new_key)
        labels.crop(n - 1)

    append_us = time_us(append, device)  # leaves n - 1 labels
    append_graph_us = graph_time_us(append, device)
    labels.append(new_key)
    valid = torch.ones(batch, n, dtype=torch.bool, device=device)
    windows = RowWindows.build(valid, config.sink, config.local, config.budget)
    source_heads = max(1, round(config.head_sharing * kv_heads))
    heads = torch.arange(source_heads, device=device)[None]
    query_labels = labels.query_labels(q)[:, :source_heads, 0]

    def select():
        scores = score_heads(query_labels, labels.codes.view(), labels.scale.view(), labels.zero.view(),
                             config.label_bits, None, None if source_heads == kv_heads else heads)
        return select_heavy(scores, windows.middle[:, None], config.heavy)

    heavy = select()
    if source_heads < kv_heads:  # copying heads take a source head's columns
        heavy = heavy[:, torch.arange(kv_heads, device=device) % source_heads]
    scale = dim ** -0.5

    def attend():
        return gather_attention(q[:, :, 0], k, v, windows.critical_indices(heavy), scale)

    selecting_layers = max(1, round(config.layer_sharing * layers)) / layers
    fraction = selecting_layers * config.query_sharing
    times = {
        "append_us": append_us,
        "windows_us": time_us(lambda: RowWindows.build(valid, config.sink, config.local, config.budget), device),
        "selection_us": time_us(select, device),
        "gather_us": time_us(attend, device),
        "fraction": fraction,
    }
    times["step_us"] = (times["append_us"] + times["windows_us"] / layers + fraction * times["selection_us"]
                        + times["gather_us"])
    graphs = [append_graph_us, graph_time_us(select, device), graph_time_us(attend, device)]
    times["append_graph_us"] = append_graph_us
    times["components_graph_us"] = dict(zip(("append", "selection", "indices_and_gather"), graphs))
    times["step_graph_us"] = None
    if all(t is not None for t in graphs):  # windows: once per step for all layers, eager share
        times["step_graph_us"] = graphs[0] + times["windows_us"] / layers + fraction * graphs[1] + graphs[2]
    return times


def print_attention(rows: list[AttentionRow]) -> None:
    print(f"{'shape':<30}{'KV MiB':>8}{'dense':>8} {'backend':<10}{'preset':<22}{'path':<16}{'append':>8}"
          f"{'select':>8}{'x frac':>7}{'gather':>8}{'TB/s':>6}{'step':>8}{'vs dense':>9}{'graph: dense':>13}"
          f"{'step':>8}{'vs dense':>9}")
    for r in rows:
        print(f"{r.shape:<30}{r.kv_mib_per_layer:>8.0f}{r.dense_us[r.fastest_dense]:>8.1f} {r.fastest_dense:<10}"
              f"{r.preset:<22}{r.path:<16}{r.append_us:>8.1f}{r.selection_us:>8.1f}{r.selecting_fraction:>7.3f}"
              f"{r.gather_us:>8.1f}{r.gather_tbps:>6.2f}{r.step_us:>8.1f}{r.speedup:>8.2f}x"
              + (f"{r.dense_graph_us:>13.1f}{r.step_graph_us:>8.1f}{r.speedup_graph:>8.2f}x"
                 if r.speedup_graph else ""))


def figure(results: dict):
    """Speed-up of each preset against the fastest dense SDPA, grouped by shape, eager and CUDA graph."""
    rows = results["attention"]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    width = 0.8 / len(presets)

    def draw(ax, suffix: str) -> None:
        for i, preset in enumerate(presets):
            values = [next(r[f"speedup{suffix}"] or 0 for r in rows if r["shape"] == s and r["preset"] == preset)
                      for s in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], values, width, label=preset)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=30, ha="right")
        ax.legend()

    return speedup_panels(results, "decode attention per (layer, step) vs fastest dense SDPA", draw)


def main_attention(out: Path, smoke: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    shapes = SMOKE_ATTENTION_SHAPES if smoke else MHA_SHAPES + GQA_SHAPES
    dtype = torch.float16 if device == "cuda" else torch.float32
    rows = bench_attention(shapes, dtype=dtype, device=device)
    print_attention(rows)
    results = {"env": environment(), "attention": [asdict(r) for r in rows]}
    write(results, out, "bench_attention")
    return results
