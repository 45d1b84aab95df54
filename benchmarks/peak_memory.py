"""What is allocated at the peak of one ``generate``, by allocation site, for unpatched StaticCache and
patched paths (on the GPU): where a patched generate's peak differs from StaticCache's.

Per path: one warm-up generate, then one recorded under ``torch.cuda.memory._record_memory_history``;
the allocation trace is replayed to find the moment of the peak, and the blocks live then (allocated
during the recorded call) are summed by their innermost Python frame in hshare, transformers or torch.
Blocks allocated before the call (weights, anything kept from earlier calls) are the baseline.

The trace records each allocation's requested size; ``torch.cuda.max_memory_allocated`` counts the blocks the
caching allocator handed out: requests rounded up to 512 bytes, and a large block not split where less than
1 MiB of its segment would be left over (a segment is a multiple of 2 MiB). `allocator_slack` puts a figure on
that difference at the trace's peak, from the block sizes of the snapshot taken after the call, and the
reserved peak (what the allocator took from the device) is printed beside both.

Run: ``python3 benchmarks/peak_memory.py --shape llama2-7b --batch 8 --prompt 1024 --paths static,dense``.
"""

from __future__ import annotations

import argparse
import gc
from collections import Counter

import torch

import hshare
from hshare.bench.generate import build_model

OWN_FRAMES = ("hshare/", "transformers/")


def site(frames: list[dict]) -> str:
    """The innermost frame of ours or transformers' (else the innermost Python frame) as file:line name."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    for frame in python:
        if any(part in frame["filename"] for part in OWN_FRAMES):
            return f"{frame['filename'].split('site-packages/')[-1]}:{frame['line']} {frame['name']}"
    return f"{python[0]['filename'].split('/')[-1]}:{python[0]['line']} {python[0]['name']}" if python else "?"


def peak_sites(trace: list[dict], free_action: str = "free_requested") -> tuple[int, Counter, dict[int, int]]:
    """Replay alloc / free events: ``(largest net bytes allocated during the trace, bytes by site live then,
    {address: requested bytes} of the blocks live then)``. A block is freed at its `free_action` event:
    ``free_requested`` (the tensor released) or ``free_completed`` (the allocator took it back: later for a
    block used on another stream, and what its statistics count)."""
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
    return best, by_site, {addr: size for addr, (size, _) in best_live.items()}


def block_bytes(requested: int) -> int:
    """The caching allocator's block for a request (its ``round_size``): a multiple of 512 bytes, at least 512."""
    return max(512, -(-requested // 512) * 512)


def allocator_slack(live: dict[int, int], segments: list[dict]) -> tuple[int, int, int]:
    """What the allocator's statistics count beyond the requested bytes of the blocks `live` at the trace's
    peak (``{address: requested bytes}``), from the snapshot's `segments` taken after the call:
    ``(slack of the peak's blocks still allocated then, at their recorded block sizes; their number; slack of
    the rest, at least the 512-byte rounding of each: freed before the snapshot, their block sizes unknown)``.
    A block still allocated at the same address with the same requested size is taken to be the same block."""
    blocks = {b["address"]: b for seg in segments for b in seg["blocks"] if b["state"] == "active_allocated"}
    known = count = rest = 0
    for addr, requested in live.items():
        block = blocks.get(addr)
        if block is not None and block["requested_size"] == requested:
            known += block["size"] - requested
            count += 1
        else:
            rest += block_bytes(requested) - requested
    return known, count, rest


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
        peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        best, sites, live = peak_sites(trace)
        completed, completed_sites, _ = peak_sites(trace, "free_completed")
        known, count, rest = allocator_slack(live, snapshot["segments"])
        mib = 2**20
        print(f"\n{path}: peak {peak / mib:.1f} MiB = baseline {baseline / mib:.1f} (before the call) "
              f"+ {(peak - baseline) / mib:.1f}; trace replay: +{best / mib:.1f} MiB at its peak "
              f"(+{completed / mib:.1f} with frees as completed); reserved peak {reserved / mib:.1f} MiB")
        print(f"  allocator slack of the trace peak's blocks: {known / mib:.2f} MiB over {count} still allocated "
              f"after the call (block sizes), >= {rest / mib:.2f} MiB over {len(live) - count} freed before it")
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
