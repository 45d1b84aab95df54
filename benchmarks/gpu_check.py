"""GPU check of the plain-PyTorch path: CUDA correctness and the decode-step cost it has today.

Run on the device machine (see benchmarks/RESULTS.md for the command). Prints a short table and
writes JSON to $OUT (or the current directory):
1. a tiny random Llama on CUDA in bf16 and fp16: patched generate with a budget covering the
   context gives the unpatched tokens; a sparse budget runs without NaN;
2. one decode step of attention (Llama-2-7B and Llama-3-8B shapes, d 128, fp16, N_c = n/8): dense
   SDPA against the sparse path of one layer: label scores + top-k (torch twin) and gather-attention
   (torch twin and Triton kernel, with its achieved bandwidth on the bytes it must read), with no
   sharing (ds) and the per-(layer, step) average of 1/2-1/2-1/2 sharing (selection / 8).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton.testing
from transformers import LlamaConfig, LlamaForCausalLM

import hshare
from hshare.kernels import gather_attention_torch, label_scores, quantize_labels, score_heads
from hshare.kernels.gather_attention_triton import gather_attention_triton
from hshare.selection import RowWindows, select_heavy


def check_generate(dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    ids = torch.randint(3, 512, (4, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    mask[3, :170] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kwargs)
    with hshare.patched(model, "ds", sink=4, local=8, heavy=1000):
        wide = model.generate(ids, **kwargs)
    with hshare.patched(model, "hshare-1_2-1_2-1_2", sink=4, local=16, heavy=40, dense_fallback_mib=0):
        cache = hshare.new_cache(model)
        out = model.generate(ids, past_key_values=cache, output_logits=True, return_dict_in_generate=True,
                             **kwargs)
    return {
        "dtype": str(dtype),
        "wide_budget_equals_dense": bool(torch.equal(wide, ref)),
        "sparse_nan": bool(any(l.isnan().any() for l in out.logits)),
        "sparse_steps": cache.stats.sparse_steps,
        "agreement": float((out.sequences[:, 300:] == ref[:, 300:]).float().mean()),
    }


def check_prefix_generate(dtype: torch.dtype) -> dict:
    """Shared prefix held once on CUDA: dense config gives the unpatched tokens; sparse runs clean."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    prefix = torch.randint(3, 512, (600,), device="cuda")
    rows = [torch.cat((prefix, torch.randint(3, 512, (n,), device="cuda"))) for n in (5, 90, 1, 33)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kwargs)
    with hshare.patched(model, "dense", prefix="on"):
        cache = hshare.new_cache(model)
        shared = model.generate(ids, past_key_values=cache, **kwargs)
    with hshare.patched(model, "hshare-1_2-1_2-1_2", sink=4, local=16, heavy=40, prefix="on", dense_fallback_mib=0):
        sparse_cache = hshare.new_cache(model)
        out = model.generate(ids, past_key_values=sparse_cache, output_logits=True, return_dict_in_generate=True,
                             **kwargs)
    return {"dtype": str(dtype), "prefix_tokens": cache.prefix.width if cache.prefix else 0,
            "dense_prefix_agreement": float((shared[:, width:] == ref[:, width:]).float().mean()),
            "sparse_prefix_nan": bool(any(l.isnan().any() for l in out.logits)),
            "sparse_prefix_steps": sparse_cache.stats.sparse_steps}


def time_attention_step(batch=16, heads=32, n=4096, dim=128, budget=512, channels=16, kv_heads=None) -> dict:
    torch.manual_seed(0)
    dt = torch.float16
    kv_heads = kv_heads or heads
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=dt)
    k = torch.randn(batch, kv_heads, n, dim, device="cuda", dtype=dt)
    v = torch.randn(batch, kv_heads, n, dim, device="cuda", dtype=dt)
    dense = triton.testing.do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != heads),
        return_mode="median") * 1e3
    codes, scale, zero = quantize_labels(k[..., :channels], 4)
    valid = torch.ones(batch, n, dtype=torch.bool, device="cuda")
    windows = RowWindows.build(valid, 16, 64, budget)
    q_lab = q.reshape(batch, kv_heads, heads // kv_heads, dim)[..., :channels].float().sum(2)  # [B, Hkv, r]
    rows, all_heads = torch.arange(batch, device="cuda"), torch.arange(kv_heads, device="cuda")[None]

    def select_twin():
        scores = label_scores(q_lab[:, :, None], codes, scale, zero, 4)[:, :, 0]
        return select_heavy(scores, windows.middle[:, None], budget - 80)

    def select():  # Triton label scores (in place, source heads) + torch.topk
        scores = score_heads(q_lab, codes, scale, zero, 4, rows, all_heads)
        return select_heavy(scores, windows.middle[:, None], budget - 80)

    heavy = select()
    overlap = (torch.zeros(batch, kv_heads, n + 1, device="cuda").scatter_(-1, heavy.clamp(min=0), 1)
               .gather(-1, select_twin().clamp(min=0)).mean())
    indices = windows.critical_indices(heavy)
    selection_twin = triton.testing.do_bench(select_twin, return_mode="median") * 1e3
    selection = triton.testing.do_bench(select, return_mode="median") * 1e3
    scores_only = triton.testing.do_bench(lambda: score_heads(q_lab, codes, scale, zero, 4, rows, all_heads),
                                          return_mode="median") * 1e3
    q1 = q[:, :, 0]
    twin = triton.testing.do_bench(lambda: gather_attention_torch(q1, k, v, indices, dim ** -0.5),
                                   return_mode="median") * 1e3
    idx32 = indices.to(torch.int32)
    gather = triton.testing.do_bench(lambda: gather_attention_triton(q1, k, v, idx32, dim ** -0.5),
                                     return_mode="median") * 1e3
    ref = gather_attention_torch(q1.float(), k.float(), v.float(), indices, dim ** -0.5)[0]
    got = gather_attention_triton(q1, k, v, idx32, dim ** -0.5)[0].float()
    bytes_read = batch * kv_heads * budget * dim * 2 * 2 + idx32.numel() * 4
    shared = selection / 8 + gather  # 1/2-1/2-1/2: selection on ~1/8 of (layer, head, step) triples
    return {"shape": f"B{batch} H{heads}/{kv_heads} n{n} d{dim} N_c{budget}", "dense_sdpa_us": dense,
            "selection_twin_us": selection_twin, "label_scores_triton_us": scores_only,
            "selection_overlap_with_twin": float(overlap), "selection_us": selection, "gather_twin_us": twin, "gather_triton_us": gather,
            "gather_TBps": bytes_read / gather / 1e6, "gather_rel_err": float((got - ref).norm() / ref.norm()),
            "ds_us": selection + gather, "hshare_1_2_us": shared, "ds_speedup": dense / (selection + gather),
            "hshare_speedup": dense / shared, "gather_only_speedup": dense / gather}


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__, "transformers", __import__("transformers").__version__)
    results = {"generate": [check_generate(torch.bfloat16), check_generate(torch.float16)],
               "prefix_generate": [check_prefix_generate(torch.bfloat16), check_prefix_generate(torch.float16)],
               "attention_step": [time_attention_step(), time_attention_step(batch=8, n=2048, budget=256),
                                  time_attention_step(batch=8, n=1024, budget=128),
                                  time_attention_step(batch=64, n=4096, budget=512, kv_heads=8),
                                  time_attention_step(batch=16, n=16384, budget=2048, kv_heads=8)]}
    for row in results["generate"]:
        print(f"{row['dtype']:<16} wide==dense {row['wide_budget_equals_dense']}  nan {row['sparse_nan']}  "
              f"sparse steps {row['sparse_steps']}  agreement {row['agreement']:.2f}")
    print(f"{'shape':<36}{'dense':>8}{'sel.tw':>8}{'scores':>8}{'select':>8}{'same':>6}{'twin':>8}{'triton':>8}"
          f"{'TB/s':>6}{'err':>9}{'ds':>8}{'1/2^3':>8}{'ds x':>6}{'hs x':>6}{'gat x':>6}")
    for row in results["prefix_generate"]:
        print(f"{row['dtype']:<16} prefix {row['prefix_tokens']}  dense agreement {row['dense_prefix_agreement']:.3f}  "
              f"sparse nan {row['sparse_prefix_nan']}  sparse steps {row['sparse_prefix_steps']}")
    for row in results["attention_step"]:
        print(f"{row['shape']:<36}{row['dense_sdpa_us']:>8.1f}{row['selection_twin_us']:>8.1f}"
              f"{row['label_scores_triton_us']:>8.1f}{row['selection_us']:>8.1f}"
              f"{row['selection_overlap_with_twin']:>6.3f}"
              f"{row['gather_twin_us']:>8.1f}{row['gather_triton_us']:>8.1f}{row['gather_TBps']:>6.2f}"
              f"{row['gather_rel_err']:>9.1e}{row['ds_us']:>8.1f}{row['hshare_1_2_us']:>8.1f}"
              f"{row['ds_speedup']:>6.2f}{row['hshare_speedup']:>6.2f}{row['gather_only_speedup']:>6.2f}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    ok = all(r["wide_budget_equals_dense"] and not r["sparse_nan"] for r in results["generate"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
