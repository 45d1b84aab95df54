"""Host (CPU) cost of one call of each piece of the shared-prefix decode path, on the GPU machine.

Eager decode on the device host is launch-bound: this prints the CPU microseconds per call (no
synchronisation inside the loop) of a trivial Triton launch, the launch plans, the one-launch
shared decode kernel, its merge, the whole dispatch, and dense SDPA, at B64 P2k (GQA 32/8, d 128,
bf16, own part 256), then a cProfile of the whole dispatch. Run: ``python3 benchmarks/launch_overhead.py``.
"""

import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl

from hshare.kernels import PrefixKV, shared_decode_attention
from hshare.kernels.gather_attention_triton import gather_attention_triton, merge_parts, plan_gather
from hshare.kernels.prefix_attention_triton import new_parts, plan_prefix, shared_prefix_decode_states_triton
from hshare.kernels.shared_decode_triton import launch_shared_decode

@triton.jit
def _tiny(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

def cpu_us(fn, n=300):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    t = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return t

B, P, own, d = 64, 2048, 256, 128
q = torch.randn(B, 32, d, device="cuda", dtype=torch.bfloat16)
pk = torch.randn(1, 8, P, d, device="cuda", dtype=torch.bfloat16); pv = torch.randn_like(pk)
ok = torch.randn(B, 8, own, d, device="cuda", dtype=torch.bfloat16); ov = torch.randn_like(ok)
cols = torch.arange(own, device="cuda").expand(B, 8, own).contiguous()
x = torch.zeros(16, device="cuda")
s = d ** -0.5
rows = {}
rows["tiny triton kernel (2 args)"] = cpu_us(lambda: _tiny[(1,)](x, 16, BLOCK=16))
rows["torch.empty"] = cpu_us(lambda: torch.empty(B, 32, 3, d, device="cuda"))
rows["plan_prefix"] = cpu_us(lambda: plan_prefix(q, pk, pv, s))
rows["plan_gather"] = cpu_us(lambda: plan_gather(q, ok, ov, cols, s))
pre = plan_prefix(q, pk, pv, s); own_l = plan_gather(q, ok, ov, cols, s)
po, pl = new_parts(q, pre.num_splits + own_l.num_splits, False)
rows["fused launch only"] = cpu_us(lambda: launch_shared_decode(pre, own_l, po, pl))
rows["merge_parts"] = cpu_us(lambda: merge_parts(q, po, pl, None))
rows["shared_decode_attention (dispatch)"] = cpu_us(lambda: shared_decode_attention(q, PrefixKV(pk, pv), ok, ov, cols, s))
rows["gather_attention_triton"] = cpu_us(lambda: gather_attention_triton(q, ok, ov, cols, s))
rows["prefix states"] = cpu_us(lambda: shared_prefix_decode_states_triton(q, pk, pv, s))
fk = torch.cat((pk.expand(B, -1, -1, -1), ok), 2); fv = torch.cat((pv.expand(B, -1, -1, -1), ov), 2)
rows["sdpa dense"] = cpu_us(lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], fk, fv, enable_gqa=True))
for k, v in rows.items(): print(f"{k:40s} {v:8.1f} us CPU per call")
pr = cProfile.Profile(); pr.enable()
for _ in range(200): shared_decode_attention(q, PrefixKV(pk, pv), ok, ov, cols, s)
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
