"""Timing of one callable: median wall time (CUDA: triton's do_bench), CUDA-graph replay time (GPU
time alone, no host launch overhead), and decode SDPA with every backend that runs, the dense
reference of ``hshare bench attention`` and ``hshare bench prefix`` (and of the kernel sweep
``benchmarks/tune_kernels.py``); and the memory bandwidth a device reaches (`copy_bandwidth`), the
ceiling of ``hshare bench generate``'s roofline column."""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F


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


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy of `nbytes` (default 4 GiB on CUDA, 32 MiB elsewhere)
    reaches, counting bytes read plus bytes written (2 x `nbytes`); the best of `repeats` copies after
    two warm-up copies, of random bytes. Both buffers are freed before returning."""
    device = torch.device(device)
    nbytes = nbytes or (4 * 2**30 if device.type == "cuda" else 32 * 2**20)
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for attempt in range(repeats + 2):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            target.copy_(source)
            seconds = time.perf_counter() - began
        if attempt >= 2:
            best = min(best, seconds)
    del source, target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / best


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


def dense_graph_us(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend_name: str) -> float | None:
    """Decode SDPA with one backend (a key of `dense_sdpa_us`, the fastest) replayed as a CUDA graph."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name.upper())

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])

    return graph_time_us(run, q.device)
