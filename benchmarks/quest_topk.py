"""Times Quest's decode selection at the long-context shapes and B16 x 4k: the page scores
(`page_scores_triton`) and the heavy columns from them (`page_heavy_triton`), each checked against its torch
twin on the GPU.

    python3 benchmarks/quest_topk.py

Page size 16, bf16 page bounds, one decode query per row, every row's window ``[16, n - 64)`` (sink 16, local
64), n = the prompt + 32 decoded columns (what a 32-token generate's pages span); CUDA-graph replays with L2
flushed (`hshare.bench.timing.graph_time_us`). "ok": the heavy columns equal `page_heavy_torch`'s slot for
slot, the page scores `page_scores_torch`'s to 1e-4.
"""

import torch

from hshare.bench.timing import graph_time_us
from hshare.kernels import page_scores_torch
from hshare.kernels.page_scores_triton import page_scores_triton
from hshare.kernels.page_topk import page_heavy_torch
from hshare.kernels.page_topk_triton import page_heavy_triton
from hshare.quest import pages_for

PAGE, DIM, Q_HEADS = 16, 128, 32
SHAPES = ((1, 8, 4096, 944), (4, 8, 32768, 944), (1, 8, 32768, 944), (1, 8, 131072, 944), (1, 8, 131072, 1968),
          (16, 8, 4096, 432), (16, 32, 4096, 432))  # rows, KV heads (= selection heads), prompt, heavy

device = torch.device("cuda")
print("| rows x heads x prompt | heavy | pages | page scores us | heavy columns us | ok |")
print("|---|---|---|---|---|---|")
for rows, heads, prompt, heavy in SHAPES:
    n = prompt + 32
    pages = pages_for(n, PAGE)
    low = torch.randn(rows, heads, pages, DIM, device=device, dtype=torch.bfloat16)
    high = low + torch.rand_like(low)
    query = torch.randn(rows, Q_HEADS, DIM, device=device, dtype=torch.bfloat16)
    index_rows = torch.arange(rows, device=device)
    index_heads = torch.arange(heads, device=device)[None]
    selectable = torch.zeros(rows, n, dtype=torch.bool, device=device)
    selectable[:, 16:n - 64] = True
    shift = torch.zeros(rows, dtype=torch.int64, device=device)
    scores = page_scores_triton(query, low, high, heads, index_rows, index_heads)
    twin = page_scores_torch(query[:, :, None], low, high, heads)[:, :, 0]
    same = torch.allclose(scores, twin, rtol=1e-4, atol=1e-4)
    same &= torch.equal(page_heavy_triton(scores, selectable, shift, PAGE, heavy),
                        page_heavy_torch(scores, selectable, shift, PAGE, heavy))
    scores_us = graph_time_us(lambda: page_scores_triton(query, low, high, heads, index_rows, index_heads), device)
    heavy_us = graph_time_us(lambda: page_heavy_triton(scores, selectable, shift, PAGE, heavy), device)
    print(f"| {rows}x{heads}x{prompt} | {heavy} | {pages} | {scores_us:.1f} | {heavy_us:.1f} | {'ok' if same else 'DIFF'} |")
