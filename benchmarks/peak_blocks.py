"""The caching allocator's blocks live at the prefill's memory peak, by allocation site (on the GPU):
StaticCache against a patched path, Llama-3.1-8B shape, one row.

`peak_memory.py` replays the allocation trace (requested sizes); `torch.cuda.max_memory_allocated`
counts blocks, which the allocator may hand out larger than requested (a free block less than 1 MiB
larger than a request is not split). This takes a snapshot at the peak itself (the output of the last
layer's MLP activation during the prefill, where every path peaks at long context) and sums the block
sizes of the blocks allocated during the recorded call by their innermost frame, then prints where the
two paths differ. Per path: one warm-up ``generate``, then the recorded one.

Run: ``python3 benchmarks/peak_blocks.py PROMPT NEW_TOKENS static,PATH``.
"""

import gc
import sys
from collections import Counter

import torch

import hshare
from hshare.bench.generate import build_model

sys.path.insert(0, "benchmarks")
from peak_memory import site  # noqa: E402

prompt, new = int(sys.argv[1]), int(sys.argv[2])
paths = sys.argv[3].split(",")
model = build_model("llama3.1-8b", None, "cuda", torch.bfloat16, prompt + new + 8)
ids = torch.randint(3, model.config.vocab_size, (1, prompt), device="cuda")
mask = torch.ones_like(ids)
SNAP = {}


def at_peak(module, args, output):
    """Snapshot once, at the prefill's call (more than one token)."""
    if "snap" not in SNAP and args and args[0].shape[1] > 1:
        SNAP["snap"] = torch.cuda.memory._snapshot()
        SNAP["alloc"] = torch.cuda.memory_allocated()


model.model.layers[-1].mlp.act_fn.register_forward_hook(at_peak)
result = {}
for path in paths:
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=new, min_new_tokens=new)
    patched = path != "static"
    if not patched:
        kwargs["cache_implementation"] = "static"
    with (hshare.patched(model, path, prefix="off") if patched else torch.no_grad()):
        def generate():
            return model.generate(ids, **kwargs, **({"past_key_values": hshare.new_cache(model)} if patched else {}))

        generate()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        SNAP.clear()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        generate()
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(enabled=None)
    live = Counter()
    for segment in SNAP["snap"]["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block.get("frames"):
                live[site(block["frames"])] += block["size"]
    result[path] = live
    print(path, "allocated at the peak: +%.3f MiB" % ((SNAP["alloc"] - base) / 2**20),
          "peak +%.3f" % ((torch.cuda.max_memory_allocated() - base) / 2**20), flush=True)
    SNAP.clear()
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
a, b = result[paths[0]], result[paths[1]]
for key in sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k])):
    if a[key] != b[key]:
        print(f"{(b[key] - a[key]) / 2**20:+12.3f} MiB  {a[key] / 2**20:10.3f} -> {b[key] / 2**20:10.3f}  {key}")
