"""``hshare bench attention`` and ``hshare bench prefix``: decode attention against dense SDPA,
measured in the same run (the numbers quoted in ``benchmarks/RESULTS.md``).

attention (issue: Triton kernels): the time of one (layer, decode step) averaged over a whole
    sharing cycle, everything the patched attention does at decode: label append, row windows
    (once per step, shared by the layers), label scoring and top-k on the selecting fraction of
    (layer, step) pairs and on the source heads only, critical indices and gather-attention. The
    dense reference is SDPA with every backend that runs; the fastest is quoted. Steps whose
    per-layer KV is below ``dense_fallback_mib`` run dense; the table says so.
prefix (issue: shared prefix): the attention op of a batch sharing a P-token prefix with an own
    part of 256 tokens per row: batched prefix attention (one product per KV head) + own part
    with the LSE merge, against per-row dense SDPA over a materialised ``[prefix; own]``; and the
    KV bytes a patched ``generate`` holds for many samples of one long prompt against
    transformers' DynamicCache.

Results print as a table and are written as JSON (and a PNG plot where matplotlib is installed;
``hshare bench plot results.json`` draws it later).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from hshare.config import HShareConfig
from hshare.kernels import PrefixKV, gather_attention, score_heads, shared_decode_attention, shared_prefix_decode_states
from hshare.labels import LabelCache
from hshare.selection import RowWindows, select_heavy

MHA_SHAPES = [(b, 32, 32, n) for b in (8, 16) for n in (1024, 2048, 4096)]  # Llama-2-7B
GQA_SHAPES = [(b, 32, 8, n) for b in (16, 64) for n in (4096, 16384)]  # Llama-3-8B
PREFIX_SHAPES = [(b, p) for b in (2, 64, 256) for p in (2048, 8192)]
SMOKE_ATTENTION_SHAPES = [(2, 4, 2, 256), (2, 4, 4, 128)]
SMOKE_PREFIX_SHAPES = [(2, 64), (4, 96)]
PRESETS = ("ds", "hshare-1_2-1_2-1_2", "hshare-3_4-3_4-1_2")


def time_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of `fn` in microseconds (CUDA: triton's do_bench with L2 flushes)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median") * 1e3
    return _cpu_time_us(fn)


def graph_time_us(fn: Callable[[], object], device: torch.device, warmup_ms: int = 25,
                  rep_ms: int = 100) -> float | None:
    """GPU time of `fn` replayed as a CUDA graph (no host launch overhead); None off CUDA or when
    `fn` cannot be captured (or, in a sweep, a launch configuration does not compile or fit)."""
    if device.type != "cuda":
        return None
    import triton.testing

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 - a host sync or allocation inside fn: not capturable
        return None
    return triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def _cpu_time_us(fn: Callable[[], object]) -> float:
    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def dense_sdpa_us(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Decode SDPA ``q [B, Hq, 1, d]`` over ``k, v [B, Hkv, n, d]`` with every backend that runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    times = {}
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                SDPBackend.MATH] if q.is_cuda else [SDPBackend.MATH]
    for backend in backends:
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # backends that cannot run this shape explain why at length
            try:
                run()
            except RuntimeError:
                continue
        times[backend.name.lower()] = time_us(run, q.device)
    return times


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
        dense_graph = _dense_graph_us(q, k, v, fastest)
        kv_bytes = k.numel() * k.element_size() * 2
        for preset in presets:
            config = HShareConfig.from_preset(preset)
            budget = n // budget_ratio
            sink, local = max(1, budget // 32), max(1, budget // 8)
            config = config.replace(sink=sink, local=local, heavy=budget - sink - local,
                                    label_channels=min(16, dim))
            row = _bench_preset(q, k, v, config, layers)
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


def _bench_preset(q, k, v, config: HShareConfig, layers: int) -> dict:
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


def _dense_graph_us(q, k, v, backend_name: str) -> float | None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name.upper())

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])

    return graph_time_us(run, q.device)


@dataclass
class PrefixRow:
    batch: int
    prefix: int
    own: int
    dense_us: dict
    fastest_dense: str
    shared_us: float
    prefix_part_us: float
    own_part_us: float
    speedup: float
    max_abs_err: float
    dense_graph_us: float | None
    shared_graph_us: float | None
    sparse_unshared: dict | None = None


def bench_prefix(shapes, own=256, q_heads=32, kv_heads=8, dim=128, dtype=torch.bfloat16,
                 device="cuda", sparse_choice=True) -> list[PrefixRow]:
    """Decode attention of B rows sharing a P-token prefix (own part `own` tokens each).

    With `sparse_choice`, also the per-(layer, step) time of a sparse config that treats the
    prefix as part of each row's sparse context (no sharing; N_c = (P + own) / 8): the shared
    alternative is the exact prefix + the own part (all of it fits N_c) timed above.
    """
    device = torch.device(device)
    rows = []
    for batch, prefix in shapes:
        torch.manual_seed(0)
        q = torch.randn(batch, q_heads, 1, dim, device=device, dtype=dtype)
        prefix_k = torch.randn(1, kv_heads, prefix, dim, device=device, dtype=dtype)
        prefix_v = torch.randn_like(prefix_k)
        own_k = torch.randn(batch, kv_heads, own, dim, device=device, dtype=dtype)
        own_v = torch.randn_like(own_k)
        own_columns = torch.arange(own, device=device).expand(batch, kv_heads, own).contiguous()
        scale = dim ** -0.5

        def prefix_part():  # component: level 1 (every row, in order) alone, unmerged split states
            return shared_prefix_decode_states(q[:, :, 0], prefix_k, prefix_v, scale)

        def shared():  # what decode runs: the prefix level and the own part in one pass, merged
            return shared_decode_attention(q[:, :, 0], PrefixKV(prefix_k, prefix_v), own_k, own_v, own_columns,
                                           scale)[0]

        full_k = torch.cat((prefix_k.expand(batch, -1, -1, -1), own_k), 2)
        full_v = torch.cat((prefix_v.expand(batch, -1, -1, -1), own_v), 2)
        dense = dense_sdpa_us(q, full_k, full_v)
        fastest = min(dense, key=dense.get)
        checked = slice(0, 4)  # fp32 reference on a few rows (B256 P8k would need 33 GiB)
        reference = F.scaled_dot_product_attention(q[checked].float(), full_k[checked].float(),
                                                   full_v[checked].float(), enable_gqa=True)[:, :, 0]
        err = float((shared()[checked].float() - reference).abs().max())
        partial = prefix_part()
        shared_time = time_us(shared, device)
        rows.append(PrefixRow(
            batch=batch, prefix=prefix, own=own, dense_us=dense, fastest_dense=fastest, shared_us=shared_time,
            prefix_part_us=time_us(prefix_part, device),
            own_part_us=time_us(lambda: gather_attention(q[:, :, 0], own_k, own_v, own_columns, scale, partial),
                                device),
            speedup=dense[fastest] / shared_time, max_abs_err=err,
            dense_graph_us=_dense_graph_us(q, full_k, full_v, fastest), shared_graph_us=graph_time_us(shared, device),
            sparse_unshared=_sparse_unshared(q, full_k, full_v) if sparse_choice else None,
        ))
        del full_k, full_v
    return rows


def _sparse_unshared(q, full_k, full_v, layers=32) -> dict:
    """ds and 1/2-1/2-1/2 over the materialised [prefix; own] of every row (eager and graph us)."""
    n = full_k.shape[2]
    budget = n // 8
    sink, local = max(1, budget // 32), max(1, budget // 8)
    result = {}
    for preset in ("ds", "hshare-1_2-1_2-1_2"):
        config = HShareConfig.from_preset(preset).replace(sink=sink, local=local, heavy=budget - sink - local)
        row = _bench_preset(q, full_k, full_v, config, layers)
        result[preset] = {"step_us": row["step_us"], "step_graph_us": row["step_graph_us"]}
    return result


def prefix_memory(samples=128, prompt=4096, new_tokens=256, device="cuda", dtype=torch.bfloat16,
                  prefix="auto") -> dict:
    """KV bytes of a patched generate (prefix held once) against transformers' DynamicCache, for
    `samples` sampled continuations of one `prompt`-token prompt (a random 2-layer Llama-3-shaped
    model: bytes per token scale with layers, the ratio does not)."""
    import hshare
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    small = device == "cpu"
    config = LlamaConfig(vocab_size=512, hidden_size=256 if small else 1024, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=prompt + new_tokens + 8)
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    ids = torch.randint(3, 512, (1, prompt), device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, num_return_sequences=samples,
                  pad_token_id=0)
    plain = model.generate(ids, return_dict_in_generate=True, **kwargs).past_key_values
    dynamic = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in plain.layers)
    del plain
    with hshare.patched(model, "dense", prefix=prefix):
        cache = hshare.new_cache(model)
        model.generate(ids, past_key_values=cache, **kwargs)
    held = cache.kv_bytes()
    return {"samples": samples, "prompt": prompt, "new_tokens": new_tokens, "dynamic_cache_bytes": dynamic,
            "hshare_bytes": held, "prefix_tokens": cache.prefix.width if cache.prefix else 0,
            "ratio": dynamic / held}


def generate_speed(samples=64, prompt=4096, new_tokens=32, layers=4, device="cuda", dtype=torch.bfloat16) -> list:
    """End to end: ``generate`` of `samples` sampled continuations of one `prompt`-token prompt on a
    random Llama-3-8B-shaped model cut to `layers` layers (hidden 4096, 32/8 heads, d 128), unpatched
    against patched configs. Prefill time = a 1-token generate; decode tok/s from the extra tokens."""
    import hshare
    from transformers import LlamaConfig, LlamaForCausalLM

    small = device == "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256 if small else 4096,
                         intermediate_size=512 if small else 14336, num_hidden_layers=layers,
                         num_attention_heads=8 if small else 32, num_key_value_heads=2 if small else 8,
                         max_position_embeddings=prompt + new_tokens + 8)
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    ids = torch.randint(3, 1024, (1, prompt), device=device)

    def run(tokens: int) -> float:
        kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, num_return_sequences=samples,
                      pad_token_id=0)
        model.generate(ids, **kwargs)  # warm-up (kernels, allocator)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    rows = []
    for name, preset in (("unpatched", None), ("dense, prefix=on", "dense"),
                         ("hshare-1_2-1_2-1_2, prefix=on", "hshare-1_2-1_2-1_2")):
        context = hshare.patched(model, preset, prefix="on") if preset else contextlib.nullcontext()
        with context:
            prefill = run(1)
            total = run(new_tokens + 1)
        rows.append({"config": name, "prefill_s": prefill, "decode_tok_s": samples * new_tokens / (total - prefill),
                     "samples": samples, "prompt": prompt, "new_tokens": new_tokens, "layers": layers})
    return rows


# ---- output -------------------------------------------------------------------------------------
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


def print_generate(rows: list[dict]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"generate, {r0['samples']} samples of a {r0['prompt']}-token prompt, {r0['layers']} layers (Llama-3-8B shaped):")
    base = rows[0]["decode_tok_s"]
    for r in rows:
        print(f"  {r['config']:<36} prefill {r['prefill_s'] * 1e3:8.1f} ms   decode {r['decode_tok_s']:9.1f} tok/s"
              f"  ({r['decode_tok_s'] / base:.2f}x)")


def print_prefix(rows: list[PrefixRow], memory: dict | None) -> None:
    print(f"{'B':>5}{'P':>7}{'own':>5}{'dense':>9} {'backend':<10}{'shared':>8}{'prefix':>8}{'own':>8}"
          f"{'speed-up':>9}{'max err':>9}{'graph: dense':>13}{'shared':>8}   sparse unshared ds / 1_2^3 (graph)")
    for r in rows:
        print(f"{r.batch:>5}{r.prefix:>7}{r.own:>5}{r.dense_us[r.fastest_dense]:>9.1f} {r.fastest_dense:<10}"
              f"{r.shared_us:>8.1f}{r.prefix_part_us:>8.1f}{r.own_part_us:>8.1f}{r.speedup:>8.2f}x{r.max_abs_err:>9.1e}"
              + (f"{r.dense_graph_us:>13.1f}{r.shared_graph_us:>8.1f}" if r.dense_graph_us and r.shared_graph_us else "")
              + ("   " + " / ".join(f"{v['step_us']:.1f} ({v['step_graph_us'] or 0:.1f})"
                                   for v in r.sparse_unshared.values()) if r.sparse_unshared else ""))
    if memory:
        print(f"KV for {memory['samples']} samples of a {memory['prompt']}-token prompt + {memory['new_tokens']} new: "
              f"DynamicCache {memory['dynamic_cache_bytes'] / 2**20:.1f} MiB, hshare "
              f"{memory['hshare_bytes'] / 2**20:.1f} MiB ({memory['ratio']:.1f}x smaller)")


def environment() -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info["device"] = "cpu"
    return info


def write(results: dict, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=1))
    try:
        plot(path)
    except ImportError:
        print(f"(matplotlib not installed: run `hshare bench plot {path}` where it is)")
    return path


def plot(path: Path) -> Path:
    """Speed-up against the fastest dense backend: eager (what ``generate`` runs) and CUDA-graph
    replay (GPU time alone), one bar per row of a results JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(Path(path).read_text())
    fig, axes = plt.subplots(1, 2, figsize=(15, 5), sharey=True)
    device = results["env"].get("device")
    for ax, (suffix, mode) in zip(axes, (("", "eager"), ("_graph", "CUDA graph"))):
        if "attention" in results:
            rows = results["attention"]
            presets = list(dict.fromkeys(r["preset"] for r in rows))
            shapes = list(dict.fromkeys(r["shape"] for r in rows))
            width = 0.8 / len(presets)
            for i, preset in enumerate(presets):
                values = [next(r[f"speedup{suffix}"] or 0 for r in rows if r["shape"] == s and r["preset"] == preset)
                          for s in shapes]
                ax.bar([x + i * width for x in range(len(shapes))], values, width, label=preset)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=30, ha="right")
            ax.legend()
            title = "decode attention per (layer, step) vs fastest dense SDPA"
        else:
            rows = results["prefix"]
            if suffix:
                values = [r["dense_graph_us"] / r["shared_graph_us"] if r["shared_graph_us"] else 0 for r in rows]
            else:
                values = [r["speedup"] for r in rows]
            ax.bar(range(len(rows)), values)
            ax.set_xticks(range(len(rows)), [f"B{r['batch']} P{r['prefix']}" for r in rows])
            title = "shared-prefix decode attention vs per-row dense SDPA"
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{title}\n{mode} - {device}", fontsize=10)
    axes[0].set_ylabel("speed-up (x)")
    fig.tight_layout()
    png = Path(path).with_suffix(".png")
    fig.savefig(png, dpi=110)
    return png


def main_attention(out: Path, smoke: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    shapes = SMOKE_ATTENTION_SHAPES if smoke else MHA_SHAPES + GQA_SHAPES
    dtype = torch.float16 if device == "cuda" else torch.float32
    rows = bench_attention(shapes, dtype=dtype, device=device)
    print_attention(rows)
    results = {"env": environment(), "attention": [asdict(r) for r in rows]}
    write(results, out, "bench_attention")
    return results


def main_prefix(out: Path, smoke: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if smoke:
        rows = bench_prefix(SMOKE_PREFIX_SHAPES, own=16, q_heads=4, kv_heads=2, dim=16, dtype=torch.float32,
                            device=device)
        memory = prefix_memory(samples=4, prompt=160, new_tokens=4, device=device, dtype=torch.float32,
                               prefix="on")
        speed = generate_speed(samples=4, prompt=300, new_tokens=3, layers=2, device=device, dtype=torch.float32)
    else:
        rows = bench_prefix(PREFIX_SHAPES, device=device)
        memory = prefix_memory(device=device)
        speed = generate_speed(device=device)
    print_prefix(rows, memory)
    print_generate(speed)
    results = {"env": environment(), "prefix": [asdict(r) for r in rows], "memory": memory, "generate": speed}
    write(results, out, "bench_prefix")
    return results
