"""What is allocated at the peak of one ``generate``, by allocation site, for unpatched StaticCache and
patched paths (on the GPU): where a patched generate's peak differs from StaticCache's.

Per path: one warm-up generate, then one recorded under ``torch.cuda.memory._record_memory_history``;
the allocation trace is replayed to find the moment of the peak, and the blocks live then (allocated
during the recorded call) are summed by their innermost Python frame in hshare, transformers or torch.
Blocks allocated before the call (weights, anything kept from earlier calls) are the baseline.

Run: ``python3 benchmarks/peak_memory.py --shape llama2-7b --batch 8 --prompt 1024 --paths static,dense``.
"""

from __future__ import annotations

import argparse
import gc
from collections import Counter

import torch

import hshare
from hshare.bench.generate import build_model

OWN_FRAMES = ("hshare/", "transformers/", "kernels/")


def site(frames: list[dict]) -> str:
    """The innermost frame of ours or transformers' (else the innermost Python frame) as file:line name."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    for frame in python:
        if any(part in frame["filename"] for part in OWN_FRAMES):
            return f"{frame['filename'].split('site-packages/')[-1]}:{frame['line']} {frame['name']}"
    return f"{python[0]['filename'].split('/')[-1]}:{python[0]['line']} {python[0]['name']}" if python else "?"


def peak_sites(trace: list[dict], free_action: str = "free_requested") -> tuple[int, Counter]:
    """Replay alloc / free events: ``(largest net bytes allocated during the trace, bytes by site live then)``.
    A block is freed at its `free_action` event: ``free_requested`` (the tensor released) or ``free_completed``
    (the allocator took it back: later for a block used on another stream, and what its statistics count)."""
    live: dict[int, tuple[int, str]] = {}
    net = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, site(event.get("frames", [])))
            net += size
            if net > best:
                best, best_live = net, dict(live)
        elif action == free_action and addr in live:
            net -= live.pop(addr)[0]
    by_site = Counter()
    for size, where in best_live.values():
        by_site[where] += size
    return best, by_site


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama2-7b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--paths", default="static,dense")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--prefix", default="off", choices=("off", "auto", "on"),
                        help="the patched paths' shared-prefix mode (`hshare.patch`'s prefix; default off)")
    args = parser.parse_args()
    model = build_model(args.shape, None, "cuda", torch.bfloat16, args.prompt + args.new_tokens + 8)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    for path in args.paths.split(","):
        kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=args.new_tokens,
                      min_new_tokens=args.new_tokens)
        patched = path != "static"
        if not patched:
            kwargs["cache_implementation"] = "static"
        context = hshare.patched(model, path, prefix=args.prefix) if patched else torch.no_grad()
        with context:
            def generate():
                extra = {"past_key_values": hshare.new_cache(model)} if patched else {}
                return model.generate(ids, **kwargs, **extra)

            generate()
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            generate()
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        peak = torch.cuda.max_memory_allocated()
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        best, sites = peak_sites(trace)
        completed, completed_sites = peak_sites(trace, "free_completed")
        mib = 2**20
        print(f"\n{path}: peak {peak / mib:.1f} MiB = baseline {baseline / mib:.1f} (before the call) "
              f"+ {(peak - baseline) / mib:.1f}; trace replay: +{best / mib:.1f} MiB at its peak "
              f"(+{completed / mib:.1f} with frees as completed)")
        for where, size in sites.most_common(args.top):
            print(f"  {size / mib:10.2f} MiB  {where}")
        if completed != best:  # what the allocator still held at its own peak (frees not yet completed)
            for where, size in (completed_sites - sites).most_common(args.top):
                print(f"  + {size / mib:8.2f} MiB  {where} (live at the peak with frees as completed)")
        del snapshot, trace
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
