"""What a programmatic dependent launch saves between two dependent kernels of a replayed CUDA graph.

Chains of K dependent kernels captured in one graph and replayed (200 replays after 20 warm ones); GPU
time per kernel of the chain, and whether the chain computed what it should (each kernel adds 1):

  triton        K small Triton kernels (y = x + 1 over 16k floats), ordinary launches
  triton_pdl    the same launched with ``launch_pdl=True``, each waiting first (``gdc_wait``)
  triton_early  the same, each also letting the next be scheduled at once (``gdc_launch_dependents``), as
                `kernels.dependent_launch.wait_for_previous_kernel` does
  mixed*        a cuBLAS product (4 x 4096 by 4096 x 4096, bf16) before each Triton kernel: the pair's time

    python3 benchmarks/pdl_gaps.py        (results: $OUT/pdl_gaps.json when OUT is set)
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(x_ptr, y_ptr, n, WAIT: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x + 1, mask=offs < n)


def chain(kind, k, bufs, w, a):
    n = bufs[0].numel()
    grid = (triton.cdiv(n, 1024),)
    pdl = kind.endswith("pdl") or kind.endswith("early")
    early = kind.endswith("early")
    x = bufs[0]
    for i in range(k):
        y = bufs[(i + 1) % 2]
        if kind.startswith("mixed"):
            a = torch.mm(a, w)  # [4, 4096]
            _add_one[grid](x, y, n, WAIT=pdl, EARLY=early, BLOCK=1024, launch_pdl=pdl)
        else:
            _add_one[grid](x, y, n, WAIT=pdl, EARLY=early, BLOCK=1024, launch_pdl=pdl)
        x = y
    return x


def timed(kind, k, reps=200):
    torch.manual_seed(0)
    bufs = [torch.zeros(16384, device="cuda"), torch.zeros(16384, device="cuda")]
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.01
    a = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(kind, k, bufs, w, a)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    bufs[0].zero_()
    with torch.cuda.graph(g):
        out = chain(kind, k, bufs, w, a)
    bufs[0].zero_()
    g.replay()
    torch.cuda.synchronize()
    ok = float(out[0].item()) == float(k)  # a correct chain adds 1 per kernel
    for _ in range(20):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps / k, ok


def main():
    rows = []
    for kind in ["triton", "triton_pdl", "triton_early", "mixed", "mixed_pdl", "mixed_early"]:
        for k in [16, 64]:
            try:
                us, ok = timed(kind, k)
                rows.append({"kind": kind, "k": k, "us_per_kernel": round(us, 3), "correct": ok})
            except Exception as e:  # noqa: BLE001
                rows.append({"kind": kind, "k": k, "error": repr(e)[:300]})
            print(rows[-1], flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "pdl_gaps.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
