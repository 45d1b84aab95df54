"""GPU time of each kind of replayed decode step, and what the host adds to a step, per path (on the GPU).

For each path: a warm ``generate`` of N new tokens, then one with every graph replay bracketed by CUDA events
(`StepGraphs.replay`, per step kind: ``select``, ``reuse``, ...) and no synchronisation inside it, then one that
waits for the GPU after every token (the bench's ``--timing steps``, by its own function). Printed per path: each kind's replays and
GPU milliseconds a replay (mean, min), the steps' mean GPU time (kinds weighted by their replays), the host's
milliseconds between the starts of two replays without waiting (the host's own pace), and the step of the
synchronised generate (GPU time plus what the host does between a token's end and the next replay's launch).
The ratios to the first path (or `--base`) say whether a gap between paths is the GPU's work or the host's. With
`--kernels`, one more ``generate`` profiles one replay of each kind (the eighth) and prints, per kind, the kernels
whose GPU time differs most from the base path's (with programmatic dependent launches on, a kernel's time holds
its wait for the one before it).

    python3 benchmarks/step_kinds.py --shape llama3-8b --batch 4 --prompt 32768 --padded \
        --paths hshare-1_2-1_2-1_2@1024,hshare-refine-successors-c4@1024    (JSON: $OUT/step_kinds_SHAPE_bB_pP.json)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import StoppingCriteriaList

import hshare
from hshare import compat
from hshare.bench.generate import StepClock, build_model, make_prompts, release_memory
from hshare.bench.generate import _time_steps as time_steps
from hshare.config import split_overrides
from hshare.graphs import StepGraphs


@contextlib.contextmanager
def around_replays(hook) -> Iterator[None]:
    """While active, `StepGraphs.replay(graphs, kind)` runs as ``hook(replay, graphs, kind)`` (`replay`: the
    original)."""
    original = StepGraphs.replay
    StepGraphs.replay = lambda graphs, kind: hook(original, graphs, kind)
    try:
        yield
    finally:
        StepGraphs.replay = original


class ReplayKernels:
    """A replay hook: the `at`-th replay of each kind runs under the profiler; `kernels[kind]`, its kernels' GPU
    microseconds and launches by name."""

    def __init__(self, at: int = 8) -> None:
        self.at = at
        self.seen: dict[str, int] = defaultdict(int)
        self.kernels: dict[str, dict[str, list]] = {}

    def __call__(self, replay, graphs: StepGraphs, kind):
        self.seen[str(kind)] += 1
        if self.seen[str(kind)] != self.at:
            return replay(graphs, kind)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = replay(graphs, kind)
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        self.kernels[str(kind)] = {event.key: [event.device_time_total, event.count] for event in prof.key_averages()
                                   if event.device_type == cuda and event.device_time_total > 0}
        return out


class ReplayEvents:
    """A replay hook: a CUDA event before and after each replay (per kind), and the host clock at its launch."""

    def __init__(self) -> None:
        self.events: dict[str, list] = defaultdict(list)
        self.host: list[float] = []

    def __call__(self, replay, graphs: StepGraphs, kind):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.host.append(time.perf_counter())
        start.record()
        out = replay(graphs, kind)
        end.record()
        self.events[str(kind)].append((start, end))
        return out

    def summary(self) -> dict:
        torch.cuda.synchronize()
        kinds = {kind: [s.elapsed_time(e) for s, e in pairs] for kind, pairs in self.events.items()}
        replays = sum(len(times) for times in kinds.values())
        gaps = [b - a for a, b in zip(self.host, self.host[1:])]
        return {
            "kinds": {kind: {"replays": len(t), "mean_ms": sum(t) / len(t), "min_ms": min(t)}
                      for kind, t in kinds.items()},
            "gpu_step_ms": sum(sum(t) for t in kinds.values()) / max(replays, 1),
            "host_launch_period_ms": 1e3 * sorted(gaps)[len(gaps) // 2] if gaps else 0.0,
        }


def measure(model, path: str, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, kernels: bool) -> dict:
    name, overrides = split_overrides(path)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with hshare.patched(model, name, **overrides):
        def generate(tokens: int = new_tokens, clock: StepClock | None = None):
            extra = {compat.CACHE_KWARG: hshare.new_cache(model)}
            if clock is not None:  # as the bench's per-step timing (`hshare.bench.generate`) calls it
                extra["stopping_criteria"] = StoppingCriteriaList([clock])
                clock.start = time.perf_counter()
            return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs, **extra)

        generate()  # capture, compile
        torch.cuda.synchronize()
        events = ReplayEvents()
        with around_replays(events):
            generate()
        row = events.summary()
        batch = ids.shape[0]
        valid = float(mask.sum()) / batch
        runs, _ = time_steps(generate, [ids.device], batch, valid, new_tokens, 1)
        row["synced_step_ms"] = 1e3 * batch / runs[0].rate
        if kernels:
            profiled = ReplayKernels()
            with around_replays(profiled):
                generate()
            row["kernels_us"] = profiled.kernels
    return row


def print_kernels(results: dict, base_path: str, top: int = 14) -> None:
    """Per kind, the kernels whose time differs most from `base_path`'s (first round), us and launches."""
    base = results[base_path][0]["kernels_us"]
    for path in (p for p in results if p != base_path):
        for kind, totals in sorted(results[path][0]["kernels_us"].items()):
            reference = base.get(kind, {})
            names = set(totals) | set(reference)
            delta = sorted(names, key=lambda n: -abs(totals.get(n, [0, 0])[0] - reference.get(n, [0, 0])[0]))
            print(f"\n{path}, {kind} step: {sum(v[0] for v in totals.values()):.0f} us of kernels against "
                  f"{sum(v[0] for v in reference.values()):.0f}")
            for name in delta[:top]:
                ours, theirs = totals.get(name, [0, 0]), reference.get(name, [0, 0])
                print(f"  {ours[0] - theirs[0]:+8.1f}  {ours[0]:8.1f} ({ours[1]:3d})  {theirs[0]:8.1f} ({theirs[1]:3d})"
                      f"  {name[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--padded", action="store_true")
    parser.add_argument("--paths", default="hshare-1_2-1_2-1_2@1024,hshare-refine-successors-c4@1024")
    parser.add_argument("--base", default=None, help="the path the ratios are to (default: the first)")
    parser.add_argument("--kernels", action="store_true",
                        help="also profile one replay of each kind: kernels against the base path's")
    parser.add_argument("--rounds", type=int, default=1, help="the paths in turn, this many times")
    args = parser.parse_args()
    model = build_model(args.shape, args.layers, "cuda", torch.bfloat16, args.prompt + args.new_tokens + 8)
    ids, mask = make_prompts(model.config.vocab_size, args.batch, args.prompt, False, args.padded)
    ids, mask = ids.cuda(), mask.cuda()
    paths = args.paths.split(",")
    results: dict[str, list] = {path: [] for path in paths}
    for _ in range(args.rounds):
        for path in paths:
            results[path].append(measure(model, path, ids, mask, args.new_tokens, args.kernels))
            release_memory("cuda")
    base_path = args.base or paths[0]
    base = results[base_path]
    print(f"{args.shape} B{args.batch} x {args.prompt}{' padded' if args.padded else ''}, {args.new_tokens} new tokens")
    print(f"| path | round | kinds: replays, GPU ms a replay (min) | GPU step ms | of {base_path} | host period ms "
          f"| synced step ms | of {base_path} |")
    print("|---|---|---|---|---|---|---|---|")
    for path, rows in results.items():
        for k, row in enumerate(rows):
            kinds = "; ".join(f"{kind} {v['replays']}, {v['mean_ms']:.3f} ({v['min_ms']:.3f})"
                              for kind, v in sorted(row["kinds"].items()))
            print(f"| {path} | {k + 1} | {kinds} | {row['gpu_step_ms']:.3f} | "
                  f"{base[k]['gpu_step_ms'] / row['gpu_step_ms']:.3f} | {row['host_launch_period_ms']:.3f} | "
                  f"{row['synced_step_ms']:.3f} | {base[k]['synced_step_ms'] / row['synced_step_ms']:.3f} |")
    if args.kernels:
        print_kernels(results, base_path)
    if os.environ.get("OUT"):
        name = f"step_kinds_{args.shape}_b{args.batch}_p{args.prompt}.json"
        Path(os.environ["OUT"], name).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
