"""``hshare bench prefix`` (issue: shared prefix): the attention op of a batch sharing a P-token
prefix with an own part of 256 tokens per row: batched prefix attention (one product per KV head) +
own part with the LSE merge, against per-row dense SDPA over a materialised ``[prefix; own]``
(measured in the same run; the numbers quoted in ``benchmarks/RESULTS.md``); the KV bytes a patched
``generate`` holds for many samples of one long prompt against transformers' DynamicCache; and
``generate`` of those samples end to end, unpatched against patched with the prefix on.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hshare import compat
from hshare.bench.attention import PREFIX_BENCH_LAYERS, AttentionProbes, measure_preset
from hshare.bench.results import environment, speedup_panels, write
from hshare.bench.timing import dense_graph_us, dense_sdpa_us, graph_time_us, time_us
from hshare.config import HShareConfig
from hshare.kernels import PrefixKV, gather_attention, shared_decode_attention, shared_prefix_decode_states

PREFIX_SHAPES = [(b, p) for b in (2, 64, 256) for p in (2048, 8192)]
SMOKE_PREFIX_SHAPES = [(2, 64), (4, 96)]


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
            dense_graph_us=dense_graph_us(q, full_k, full_v, fastest), shared_graph_us=graph_time_us(shared, device),
            sparse_unshared=_sparse_unshared(q, full_k, full_v) if sparse_choice else None,
        ))
        del full_k, full_v
    return rows


def _sparse_unshared(q, full_k, full_v) -> dict:
    """ds and 1/2-1/2-1/2 over every row's own [prefix; own] columns (eager and graph us per layer and
    step), through the attention benchmark's harness (`measure_preset`: the library's real step) at the
    shape, dtype and device of ``q [B, Hq, 1, d]`` and ``full_k, full_v [B, Hkv, n, d]`` (their values
    are not read: the harness draws its own prompt of that shape)."""
    batch, q_heads, _, head_dim = q.shape
    n = full_k.shape[2]
    budget = n // 8
    sink, local = max(1, budget // 32), max(1, budget // 8)
    probes = AttentionProbes(batch, q_heads, full_k.shape[1], n, head_dim, PREFIX_BENCH_LAYERS, full_v.dtype,
                             full_v.device)
    result = {}
    for preset in ("ds", "hshare-1_2-1_2-1_2"):
        config = HShareConfig.from_preset(preset).replace(sink=sink, local=local, heavy=budget - sink - local)
        timing = measure_preset(probes, config)
        result[preset] = {"step_us": timing.step_us, "step_graph_us": timing.step_graph_us}
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
    plain = compat.output_cache(model.generate(ids, return_dict_in_generate=True, **kwargs))
    dynamic = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in plain.layers)
    del plain
    with hshare.patched(model, "dense", prefix=prefix):
        cache = hshare.new_cache(model)
        model.generate(ids, **{compat.CACHE_KWARG: cache}, **kwargs)
    held = cache.kv_bytes()
    return {"samples": samples, "prompt": prompt, "new_tokens": new_tokens, "dynamic_cache_bytes": dynamic,
            "hshare_bytes": held, "prefix_tokens": cache.prefix.width if cache.prefix else 0,
            "ratio": dynamic / held}


def generate_speed(samples=64, prompt=4096, new_tokens=32, layers=4, device="cuda", dtype=torch.bfloat16) -> list:
    """End to end: ``generate`` of `samples` sampled continuations of one `prompt`-token prompt on a
    random Llama-3-8B-shaped model cut to `layers` layers (hidden 4096, 32/8 heads, d 128), unpatched
    against patched configs. Prefill time = a 1-token generate; decode tok/s from the extra tokens.
    (``hshare bench generate --shared`` measures this at full depth, against the compiled StaticCache.)"""
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


def print_generate_speed(rows: list[dict]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"generate, {r0['samples']} samples of a {r0['prompt']}-token prompt, {r0['layers']} layers (Llama-3-8B shaped):")
    base = rows[0]["decode_tok_s"]
    for r in rows:
        print(f"  {r['config']:<36} prefill {r['prefill_s'] * 1e3:8.1f} ms   decode {r['decode_tok_s']:9.1f} tok/s"
              f"  ({r['decode_tok_s'] / base:.2f}x)")


def figure(results: dict):
    """Speed-up of the shared-prefix decode attention against per-row dense SDPA, one bar per shape."""
    rows = results["prefix"]

    def draw(ax, suffix: str) -> None:
        if suffix:
            values = [r["dense_graph_us"] / r["shared_graph_us"] if r["shared_graph_us"] else 0 for r in rows]
        else:
            values = [r["speedup"] for r in rows]
        ax.bar(range(len(rows)), values)
        ax.set_xticks(range(len(rows)), [f"B{r['batch']} P{r['prefix']}" for r in rows])

    return speedup_panels(results, "shared-prefix decode attention vs per-row dense SDPA", draw)


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
    print_generate_speed(speed)
    results = {"env": environment(), "prefix": [asdict(r) for r in rows], "memory": memory, "generate": speed}
    write(results, out, "bench_prefix")
    return results
