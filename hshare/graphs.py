"""CUDA graphs of a step function: run it once for real, capture it, then replay it.

Nothing here knows what the step computes. The caller owns every tensor the step reads and
writes between steps (static buffers updated in place) and asks for one graph per *kind* of step
(a key: steps of one kind launch the same kernels on the same shapes). A graph replays the whole
step with one launch from the host instead of hundreds, which is what a decode step of a large
model needs: its GPU work is a few milliseconds, its eager launches tens.

The first step of a kind runs eagerly on a side stream (it is a real step, and it warms up what
capture cannot do: Triton compilation, library handles) and is then captured: capture records the
kernels without running them, so the caller must undo host-side effects of the capture pass
(`StepGraphs.capture` returns nothing and changes no device memory). All graphs share one memory
pool: only one step runs at a time and no graph's temporaries outlive its replay. Warm-up and capture
run on one side stream per device for the whole process (`side_stream`).

cuBLAS keeps a workspace per stream it has run on, held outside any pool for the rest of the process.
As torch's own CUDA graph trees do (``torch._inductor.cudagraph_trees.clear_cublas_manager``), the
workspaces are dropped before and after each warm-up and capture: the one a capture needs is then
allocated in the graphs' pool and lives as long as the graphs, and none stays behind a ``generate``
(its 32 MiB on Hopper was the last of the peak memory a patched generate held above StaticCache's).

A caller that has run a step of the same kind and shapes before in this process (its kernels compiled,
its libraries initialised) may skip the eager run: `capture_and_replay` records the step and replays it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Hashable, Iterator

import torch


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream of `device` that every warm-up step and capture runs on (made at first use)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@contextlib.contextmanager
def fresh_cublas_workspaces() -> Iterator[None]:
    """Drop cuBLAS's per-stream workspaces on entry and exit: the block runs on workspaces allocated
    where it runs (a capture: the graph's pool) and leaves none behind."""
    torch._C._cuda_clearCublasWorkspaces()
    try:
        yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


class StepGraphs:
    """One CUDA graph per step kind, captured on first use.

    Args:
        device: the CUDA device the step runs on.

    Attributes:
        capture_seconds: host seconds spent capturing each kind (the warm-up cost of graphs).
        replays: replays per kind.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Hashable, object] = {}
        self.capture_seconds: dict[Hashable, float] = {}
        self.replays: dict[Hashable, int] = {}

    def __contains__(self, kind: Hashable) -> bool:
        return kind in self.graphs

    def eager(self, step: Callable[[], object]) -> object:
        """Run `step` for real on a side stream (the first step of a kind: warm-up included)."""
        current = torch.cuda.current_stream(self.device)
        side = side_stream(self.device)
        side.wait_stream(current)
        with fresh_cublas_workspaces(), torch.cuda.stream(side):
            out = step()
        current.wait_stream(side)
        return out

    def capture(self, kind: Hashable, step: Callable[[], object]) -> None:
        """Record `step` as the graph of `kind` (its kernels do not run)."""
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with fresh_cublas_workspaces(), torch.cuda.graph(graph, pool=self.pool, stream=side_stream(self.device)):
            self.outputs[kind] = step()
        self.graphs[kind] = graph
        self.replays[kind] = 0
        self.capture_seconds[kind] = time.perf_counter() - start

    def capture_and_replay(self, kind: Hashable, step: Callable[[], object]) -> object:
        """Record `step` as the graph of `kind` without an eager run first, then replay it (the step's
        real run); for a step whose kernels and libraries a run of the same shapes has warmed up."""
        self.capture(kind, step)
        return self.replay(kind)

    def replay(self, kind: Hashable) -> object:
        """Replay the graph of `kind`; returns its static outputs (overwritten by the next replay)."""
        self.graphs[kind].replay()
        self.replays[kind] += 1
        return self.outputs[kind]
