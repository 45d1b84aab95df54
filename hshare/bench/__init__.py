"""The benchmarks of ``hshare bench``, one module each, measured on the GPU (``--smoke``: tiny
shapes on the CPU, to check they run):

* `attention`: the library's real decode step per (layer, step) of the presets, eager and as CUDA
  graphs, against the `dense` preset through the same harness and against SDPA;
* `prefix`: shared-prefix decode attention against per-row dense SDPA, the KV a patched ``generate``
  holds for many samples of one prompt, and that ``generate`` end to end;
* `generate`: end-to-end ``generate`` of random-weight models of real shapes, unpatched, transformers'
  compiled StaticCache and hshare's presets, each row with its roofline (`roofline`: the bytes a decode
  step must read, the floor rate at the measured bandwidth);
* `grid`: `generate` over a grid of rows x prompt lengths per shape in one run, with the dense-fallback
  crossover table (``python -m hshare.bench.grid``).

`timing` holds the timers they share (median, CUDA-graph replay, dense SDPA, copy bandwidth); `results`
writes the JSON and draws the plot of any of them (``hshare bench plot results.json``).
"""

from hshare.bench import attention, generate, prefix, roofline
from hshare.bench.attention import main_attention
from hshare.bench.generate import main_generate
from hshare.bench.prefix import main_prefix
from hshare.bench.results import plot
from hshare.bench.timing import copy_bandwidth, dense_graph_us, dense_sdpa_us, graph_time_us, time_us

__all__ = ["attention", "copy_bandwidth", "dense_graph_us", "dense_sdpa_us", "generate", "graph_time_us",
           "main_attention", "main_generate", "main_prefix", "plot", "prefix", "roofline", "time_us"]
