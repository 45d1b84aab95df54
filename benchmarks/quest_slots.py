"""Times Quest's page top-k (`page_heavy_triton`) with each (row, head)'s heavy slots shared out over 1, 2
and 4 programs and the default (`slot_programs`), at the long-context shapes and B16 x 4k, against the torch
twin's columns (on the GPU).

    python3 benchmarks/quest_slots.py

Page size 16, fp32 random page scores, every row's window ``[16, n - 64)`` (sink 16, local 64); CUDA-graph
replays with L2 flushed (`hshare.bench.timing.graph_time_us`); "ok": equal to `page_heavy_torch` slot for slot.
"""

import torch

from hshare.bench.timing import graph_time_us
from hshare.kernels.page_topk import page_heavy_torch
from hshare.kernels.page_topk_triton import page_heavy_triton, slot_programs

PAGE = 16
SHAPES = ((4, 8, 32768, 944), (1, 8, 131072, 1968), (16, 32, 4096, 432))  # rows, heads, n, heavy

device = torch.device("cuda")
for rows, heads, n, heavy in SHAPES:
    scores = torch.randn(rows, heads, n // PAGE, device=device)
    selectable = torch.zeros(rows, n, dtype=torch.bool, device=device)
    selectable[:, 16:n - 64] = True
    shift = torch.zeros(rows, dtype=torch.int64, device=device)
    reference = page_heavy_torch(scores, selectable, shift, PAGE, heavy)
    line = [f"{rows}x{heads}x{n} heavy {heavy}"]
    for programs in (1, 2, 4, None):
        same = torch.equal(page_heavy_triton(scores, selectable, shift, PAGE, heavy, programs=programs), reference)
        us = graph_time_us(lambda: page_heavy_triton(scores, selectable, shift, PAGE, heavy, programs=programs), device)
        name = f"default ({slot_programs(rows * heads, heavy, device)})" if programs is None else str(programs)
        line.append(f"programs={name}: {us:.1f} us {'ok' if same else 'DIFF'}")
    print(" | ".join(line))
