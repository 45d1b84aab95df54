"""Where a decode step's GPU time goes, per kernel, for unpatched and patched presets (on the GPU).

For each path: profile a ``generate`` of N + 3 new tokens and one of 3 (`BASE_TOKENS`: the prefill and
each kind of decode step's first, captured or eager, lie in both), subtract their per-kernel CUDA totals
and divide by N: the kernels of one replayed decode step. Patched presets run
eagerly (``cuda_graphs=False``) unless ``--graphs`` (the profiler sees the kernels inside graph replays too). Prints the step's GPU milliseconds, its heaviest kernels with their launches a step,
and with ``--sequence`` the last step's kernels in the order they ran; writes JSON.

``--prefill``: the prefill instead (a ``generate`` of 1 new token), with the GPU time inside each of
hshare's prefill functions (`PREFILL_RANGES`: labels, dynamic channels, the planner's evidence),
which is what a sparse preset adds to prefill (its target: `benchmarks/RESULTS.md`).

Run: ``python3 benchmarks/profile_decode.py --shape llama2-7b --layers 8 --batch 16 --prompt 4096 [--prefill]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import hshare
from hshare.bench.generate import build_model


# hshare's prefill work, as (module, attribute) pairs: each call is profiled as a range of that name
PREFILL_RANGES = (("hshare.prefill_metadata", "defer"), ("hshare.prefill_metadata", "complete"),
                  ("hshare.prefill_metadata", "record_evidence"), ("hshare.policy", "dynamic_channels"),
                  ("hshare.labels", "LabelCache.append"), ("hshare.prefill_metadata", "layer_overlaps"),
                  ("hshare.prefill_metadata", "head_similarity"), ("hshare.prefill_metadata", "select_heavy"),
                  ("hshare.cache", "HShareCache.set_reserve"))


@contextlib.contextmanager
def prefill_ranges():
    """Wrap each of `PREFILL_RANGES` in a profiler range ``hshare:<name>`` while the block runs."""
    saved = []
    for module_name, attribute in PREFILL_RANGES:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)

        def ranged(*args, __original=original, __name=attribute, **kwargs):
            with torch.profiler.record_function(f"hshare:{__name}"):
                return __original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, functools.wraps(original)(ranged))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def kernel_totals(model, ids, mask, tokens: int, **kwargs) -> tuple[Counter, Counter, list]:
    """CUDA microseconds per kernel name (and per ``hshare:`` range), launches per kernel name, and the
    kernels in the order they ran as ``(name, us)``, over one ``generate`` of `tokens` new tokens."""
    cuda = ids.is_cuda
    activity, kind = (ProfilerActivity.CUDA, torch.autograd.DeviceType.CUDA) if cuda else \
        (ProfilerActivity.CPU, torch.autograd.DeviceType.CPU)  # CPU: a smoke run of the script itself
    with profile(activities=[activity]) as prof:
        model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       pad_token_id=0, **kwargs)
        if cuda:
            torch.cuda.synchronize()
    totals, launches = Counter(), Counter()
    for event in prof.key_averages():
        if event.key.startswith("hshare:"):  # a range: the device time of the kernels inside it
            totals[event.key] += event.device_time_total if cuda else event.cpu_time_total
        elif event.device_type == kind:
            totals[event.key] += event.device_time_total if cuda else event.self_cpu_time_total
            launches[event.key] += event.count
    ordered = sorted((e for e in prof.events() if e.device_type == kind), key=lambda e: e.time_range.start)
    return totals, launches, [(e.name, e.device_time if cuda else e.self_cpu_time_total) for e in ordered]


def prefill_kernels(model, path: str, ids, mask) -> Counter:
    """Kernels and ``hshare:`` ranges of a 1-token ``generate`` (the prefill) of one path."""
    cache = (lambda: {}) if path == "unpatched" else (lambda: {"past_key_values": hshare.new_cache(model)})
    with hshare.patched(model, path, prefix="off") if path != "unpatched" else contextlib.nullcontext():
        kernel_totals(model, ids, mask, 1, **cache())  # warm-up
        with prefill_ranges():
            return kernel_totals(model, ids, mask, 1, **cache())[0]


# new tokens of the generate subtracted: the prefill (a sparse preset's planner evidence is made only when
# decode steps follow) and the first decode step of each kind (selection, reuse: each captured or run
# eagerly once per generate) lie in both generates, so the difference is replayed steps alone
BASE_TOKENS = 3


def step_kernels(model, path: str, ids, mask, steps: int, graphs: bool) -> tuple[Counter, Counter, list]:
    """Per replayed decode step: GPU us per kernel name, launches per kernel name, and the last step's
    kernels in order (the last ``launches`` kernels of the longer generate, with its bookkeeping after
    the step)."""
    def run(tokens):
        if path == "unpatched":
            return kernel_totals(model, ids, mask, tokens)
        return kernel_totals(model, ids, mask, tokens, past_key_values=hshare.new_cache(model))

    context = hshare.patched(model, path, prefix="off", cuda_graphs=graphs) if path != "unpatched" else None
    if context:
        context.__enter__()
    try:
        run(4)  # warm-up: Triton compilation, autotuning
        (long, long_launches, ordered), (short, short_launches, _) = run(steps + BASE_TOKENS), run(BASE_TOKENS)
    finally:
        if context:
            context.__exit__(None, None, None)
    per_step = Counter({k: (long[k] - short.get(k, 0.0)) / steps for k in long if long[k] - short.get(k, 0.0) > 0})
    launches = Counter({k: (long_launches[k] - short_launches.get(k, 0)) / steps for k in long_launches
                        if long_launches[k] > short_launches.get(k, 0)})
    return per_step, launches, ordered[len(ordered) - round(sum(launches.values())):]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama2-7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--paths", default="unpatched,dense,ds@512,hshare-1_2-1_2-1_2@512")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--graphs", action="store_true", help="patched paths replay CUDA graphs (default: eager)")
    parser.add_argument("--prefill", action="store_true", help="profile the prefill (1 new token) instead")
    parser.add_argument("--sequence", action="store_true",
                        help="also print the last decode step's kernels in the order they ran")
    args = parser.parse_args()
    model = build_model(args.shape, args.layers, args.device, torch.bfloat16, args.prompt + args.steps + 16)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=generator).to(args.device)
    mask = torch.ones_like(ids)
    results = {}
    what = "prefill" if args.prefill else "decode step"
    for path in args.paths.split(","):
        launches, sequence = Counter(), []
        if args.prefill:
            kernels = prefill_kernels(model, path, ids, mask)
        else:
            kernels, launches, sequence = step_kernels(model, path, ids, mask, args.steps, args.graphs)
        ranges = {name: us for name, us in kernels.items() if name.startswith("hshare:")}
        kernels = Counter({name: us for name, us in kernels.items() if name not in ranges})
        total = sum(kernels.values())
        results[path] = {"ms": total / 1e3, "kernels_us": dict(kernels.most_common()), "ranges_us": ranges,
                         "launches": dict(launches.most_common()), "sequence": sequence}
        print(f"\n{path}: {total / 1e3:.2f} ms of GPU work per {what} ({args.layers} layers), "
              f"{sum(launches.values()):.1f} launches")
        for name, us in sorted(ranges.items(), key=lambda item: -item[1]):
            print(f"  {us:9.1f} us  {us / total:6.1%}  inside {name}")
        for name, us in kernels.most_common(args.top):
            print(f"  {us:9.1f} us  {us / total:6.1%}  x{launches.get(name, 0):5.1f}  {name[:100]}")
        if args.sequence:
            print("  the last step's kernels in order:")
            for name, us in sequence:
                print(f"    {us:8.1f} us  {name[:100]}")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_prefill" if args.prefill else "_graphs" if args.graphs else ""
    (out / f"profile_decode_{args.shape}_l{args.layers}_b{args.batch}_p{args.prompt}{suffix}.json").write_text(
        json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
