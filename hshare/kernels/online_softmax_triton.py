"""The online-softmax step shared by the Triton attention programs (FlashAttention's running max
and sum, base 2): the empty state, one key tile folded into a query tile's running state, and the
final normalisation with the natural-log LSE that the exact merges use.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def start_softmax(q, ROWS: tl.constexpr, DIM: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``(q, m, l, acc)``: the query tile ``[ROWS, d]`` (fp32 under `UPCAST_DOT`) and the empty
    running state of `online_softmax_tile`."""
    if UPCAST_DOT:  # Triton's CPU interpreter computes bf16 tl.dot wrongly (triton 3.9)
        q = q.to(tl.float32)
    m = tl.full((ROWS,), float("-inf"), tl.float32)  # running max of the logits, base-2 units
    return q, m, tl.zeros((ROWS,), tl.float32), tl.zeros((ROWS, DIM), tl.float32)


@triton.jit
def online_softmax_tile(q, k, v, key_ok, scale_log2, m, l, acc, UPCAST_DOT: tl.constexpr):
    """Fold keys ``k``/values ``v`` ``[N, d]`` (``key_ok`` ``[N]`` masks padding) into the running
    state of queries ``q`` ``[M, d]``: max ``m`` and sum ``l`` ``[M]`` of base-2 logits
    (``scale_log2`` = softmax scale x log2(e)), output accumulator ``acc`` ``[M, d]`` fp32."""
    if UPCAST_DOT:  # Triton's CPU interpreter computes bf16 tl.dot wrongly (triton 3.9)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale_log2
    scores = tl.where(key_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    l = l * alpha + tl.sum(p, 1)
    return m_new, l, acc


@triton.jit
def finish_softmax(m, l, acc):
    """``(out [M, d], lse [M])``: the normalised output and the natural-log LSE; a row that saw
    no key gets ``out = 0``, ``lse = -inf``."""
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse
