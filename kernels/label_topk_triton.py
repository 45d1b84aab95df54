"""Triton fused label scoring + heavy top-k: the twin of `label_topk.label_topk_torch`.

A selection step's top-`heavy` columns of each (row, source head) straight from the label cache: the
``[A, H, n]`` scores are never written. Columns are cut into chunks (`CHUNK`, more for rows longer
than `MAX_CHUNKS` chunks); a chunk's scores exist only in the registers of the program that computed
them. Scores are compared as order-preserving int32 *keys* of their fp32 values (-0.0 as +0.0); a
column outside the window, unselectable or scored non-finite has no key (``INT32_MIN``, never
counted).

The search (`_exact_threshold`): for a target count r, keys ``lo < hi`` with at least r keys at or
above `lo` and fewer at or above `hi`; each step probes a pivot key (first the scores' mean + std
times the normal quantile of r / count, then linear interpolation of the score in the normal
quantiles of the counts at the ends, every third step the middle of the key range) with one pass of
three block reductions (count >= pivot, the nearest key above, the nearest below) and moves an end
onto the nearest key on its side. It ends when exactly r keys lie at or above `lo`, or no key lies
between the ends (then the keys equal to `lo` are ties: the first in column order are taken). Few
steps at the scores' distributions; the key range halves at least every three steps.

* One chunk (``n <= chunk``): one launch of `_label_topk_sketch` with ``SINGLE``. Program (row, head)
  scores the row, searches its exact heavy-th key and writes the columns above it, then the first
  columns equal to it, ascending.
* Several chunks: two launches, each a program per (row-head, chunk).

  1. `_label_topk_sketch` scores its chunk and records a *sketch* of it: for ``LEVELS`` target ranks
     (``ceil(heavy / chunks)``, twice and eight times that, and `heavy`) a key t with the exact number
     c of the chunk's keys >= t, ``r <= c <= r + r / 4`` (the search for all levels at once, stopped
     at that window), plus the chunk's count of keys and its largest and smallest key.
  2. `_label_topk_select` first reads the sketches of its row-head (every program of the row-head
     computes the same from them): L, the largest sketch key with at least `heavy` keys of the row
     proven >= it (a lower bound of the heavy-th key; it is at least every chunk's heavy-rank key, so
     no chunk holds more than ``heavy + heavy / 4`` keys above it), and per chunk an upper bound of
     its keys >= L (the count of a sketch key <= L; 0 when its largest key is below L). The exclusive
     prefix sum of those bounds gives each chunk a slot range of the row-head's candidate buffer: the
     buffer is in column order. The program then scores its chunk again and writes its keys >= L (key
     and column packed in an int64; of the keys equal to L only as many as the row can still need)
     into its range and a sentinel into the rest; the last program of the row-head to finish (an
     atomic ticket, the others' writes released before it) searches the exact heavy-th key among the
     candidates (held in registers when they fit one tile, else read again from L2 at every step)
     and writes the columns above it and the first columns equal to it, ascending.

Bytes: the labels are read once per launch (twice in all; the second read comes from L2 when the
step's labels fit in it) and the mask, if any, once per head (shared in L2); nothing of width n is
written. The sketches are 64 bytes a chunk; the candidates of a row-head are its keys >= L, a small
multiple of heavy unless its top keys spread over many chunks unevenly, in a slot range at most about
twice that (the sketch's resolution below L; always at most ``chunks * (heavy + heavy / 4 + 1)``, the
buffer's allocated size). Everything is sized on the host from shapes only (no
device read), so the launches are CUDA-graph capturable; the buffers need no clearing (the first
launch resets the tickets).

Both launches score with the same jit function, elementwise in a fixed channel order (no reduction
whose order a layout could change), so a column's key has the same bits in both: the counts of the
sketch hold for the second pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .labels_triton import kernel_label_inputs
from .successors_triton import COLUMN_BITS, _walk

CHUNK = 4096  # columns per program (and the longest row done in one launch)
MAX_CHUNKS = 32  # longer rows take longer chunks (the bound L compares every pair of sketch keys)
TAIL_TILE = 4096  # candidates per tile of the last program's search and writes
MAX_CANDIDATES = 16384  # candidate columns per (row, head) that `candidate_label_topk_triton` holds in registers
MAX_WALK_CANDIDATES = 8192  # the same for `candidate_label_walk_triton` (a register sort; wider ones: the twin)
LEVELS = 4  # target ranks per chunk sketch
SKETCH = 16  # int32 fields per (row-head, chunk) sketch: LEVELS keys, LEVELS counts, count, max, min
SENTINEL = tl.constexpr(-(1 << 63))  # an empty candidate slot (its key is INT32_MIN)
NO_TOKEN = tl.constexpr(-1)


@triton.jit
def _chunk_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, mask_ptr,
                pid, i, row, head, cols, start, end,
                s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_mb,
                R: tl.constexpr, BITS: tl.constexpr, LOAD_BYTES: tl.constexpr, GROUP: tl.constexpr,
                PER_ROW_CHANNELS: tl.constexpr, FROM_QUERY: tl.constexpr, HAS_MASK: tl.constexpr):
    """Keys ``[CHUNK]`` int32 of columns `cols` of (row, head): INT32_MIN where a column is outside
    ``[start, end)``, unselectable or scored non-finite. Codes are read in LOAD_BYTES words (the
    codes pointer is a byte pointer; `s_cn` in bytes); the dot is accumulated channel by channel. The
    query labels: ``[A * H', r]`` fp32 at `ql_ptr`, or (FROM_QUERY) gathered from the decode query
    ``[B, Hq, d]`` at the heavy channels ``[P, H_sel, r]``."""
    inside = (cols >= start) & (cols < end)
    if HAS_MASK:
        inside = inside & (tl.load(mask_ptr + i * s_mb + cols, mask=inside, other=0) != 0)
    if LOAD_BYTES == 4:
        words = (codes_ptr + row * s_cb + head * s_ch).to(tl.pointer_type(tl.int32))
    elif LOAD_BYTES == 2:
        words = (codes_ptr + row * s_cb + head * s_ch).to(tl.pointer_type(tl.int16))
    else:
        words = (codes_ptr + row * s_cb + head * s_ch).to(tl.pointer_type(tl.uint8))
    channels_row = channels_ptr + head * s_chh
    if PER_ROW_CHANNELS:
        channels_row += row * s_chp
    query_row = query_ptr + row * s_qb + (head * GROUP) * s_qh
    PER_WORD: tl.constexpr = LOAD_BYTES * 8 // BITS
    acc = tl.zeros(cols.shape, tl.float32)
    q_sum = tl.zeros((), tl.float32)
    for w in tl.static_range(R // PER_WORD):
        word = tl.load(words + cols * (s_cn // LOAD_BYTES) + w, mask=inside, other=0).to(tl.int32)
        for j in tl.static_range(PER_WORD):
            # the channel's query label: read, or the sum (in order) over the GROUP query heads of the
            # decode query's heavy channel
            if FROM_QUERY:
                channel = tl.load(channels_row + w * PER_WORD + j).to(tl.int64)
                q = tl.load(query_row + channel).to(tl.float32)
                for g in tl.static_range(1, GROUP):
                    q += tl.load(query_row + g * s_qh + channel).to(tl.float32)
            else:
                q = tl.load(ql_ptr + pid * R + w * PER_WORD + j)
            q_sum += q
            field = (word >> (j * BITS)) & ((1 << BITS) - 1)
            if BITS == 16:
                if scale_ptr.dtype.element_ty == tl.bfloat16:  # 16-bit labels: scale_ptr carries their dtype
                    value = (field << 16).to(tl.float32, bitcast=True)
                else:
                    value = field.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            else:  # the code as fp32, exactly, without an int-to-float conversion
                value = (field | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            acc += value * q
    if BITS == 16:
        score = acc
    else:
        scale = tl.load(scale_ptr + row * s_sb + head * s_sh + cols, mask=inside, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + row * s_zb + head * s_zh + cols, mask=inside, other=0.0).to(tl.float32)
        score = scale * acc + zero * q_sum
    ok = inside & (tl.abs(score) < float("inf"))  # NaN fails the comparison too
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order-preserving; -0.0 as +0.0
    key = tl.where(bits == -2147483648, 0, key)
    return tl.where(ok, key, -2147483648)


@triton.jit
def _key_value(key):
    """fp32 score of an order-preserving int32 key."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _probit(fraction):
    """z with P(Z > z) = fraction for a standard normal Z (Abramowitz-Stegun 26.2.23, |error| < 5e-4)."""
    q = tl.minimum(tl.maximum(tl.minimum(fraction, 1.0 - fraction), 1e-9), 0.5)
    t = tl.sqrt(-2.0 * tl.log(q))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(fraction < 0.5, z, -z)


@triton.jit
def _pivot(lo, hi, count_lo, count_hi, aim, total, first_value, step):
    """A key strictly inside ``(lo, hi)`` (int64, ``hi - lo >= 2``) at which about `aim` of the
    `total` keys should lie at or above. Step 0 takes `first_value` (the keys' mean + std times the
    normal quantile of aim / total); later steps interpolate the value linearly in the normal
    quantiles of the counts at the ends (exact for a normal tail); every third step bisects the key
    range instead, so that the range halves at least every three steps."""
    middle = lo + (hi - lo) // 2
    low_value = _key_value(lo.to(tl.int32))
    high_value = _key_value(hi.to(tl.int32))
    z_low = _probit(count_lo.to(tl.float32) / total)
    z_high = _probit(tl.maximum(count_hi.to(tl.float32), 0.5) / total)
    value = low_value + (high_value - low_value) * (_probit(aim / total) - z_low) / (z_high - z_low)
    value = tl.where(step == 0, first_value, value)
    bits = value.to(tl.int32, bitcast=True)
    guess = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    guess = tl.where(tl.abs(value) < float("inf"), guess, middle)  # an infinite end or NaN: bisect
    guess = tl.minimum(tl.maximum(guess, lo + 1), hi - 1)
    return tl.where(step % 3 == 2, middle, guess)


@triton.jit
def _sum_min_max(count_a, low_a, high_a, count_b, low_b, high_b):
    """`tl.reduce` combine of (a sum, a minimum, a maximum) in one reduction."""
    return count_a + count_b, tl.minimum(low_a, low_b), tl.maximum(high_a, high_b)


@triton.jit
def _probe(key, buf_ptr, span, pivot, FROM_BUFFER: tl.constexpr, TILE: tl.constexpr):
    """At a pivot key: the count of keys >= it, the smallest key >= it and the largest key < it, of
    the register keys ``[N]`` or of the packed candidates ``buf[0:span)`` (INT32_MIN: no key)."""
    if FROM_BUFFER:
        count = tl.zeros((TILE,), tl.int32)
        up = tl.full((TILE,), 2147483647, tl.int32)
        down = tl.full((TILE,), -2147483648, tl.int32)
        for t in range(0, span, TILE):
            slots = t + tl.arange(0, TILE)
            tile_key = (tl.load(buf_ptr + slots, mask=slots < span, other=SENTINEL, cache_modifier=".cg")
                        >> 32).to(tl.int32)
            at_least = tile_key >= pivot
            count += at_least.to(tl.int32)
            up = tl.minimum(up, tl.where(at_least, tile_key, 2147483647))
            down = tl.maximum(down, tl.where(at_least, -2147483648, tile_key))
    else:
        at_least = key >= pivot
        count = at_least.to(tl.int32)
        up = tl.where(at_least, key, 2147483647)
        down = tl.where(at_least, -2147483648, key)
    return tl.reduce((count, up, down), 0, _sum_min_max)


@triton.jit
def _exact_threshold(key, buf_ptr, span, r, lo, count_lo, hi, first_value,
                     FROM_BUFFER: tl.constexpr, TILE: tl.constexpr):
    """The r-th largest key and how many of the keys equal to it to take.

    `lo` is the smallest key and holds ``count_lo >= r`` keys at or above; `hi` is above every key.
    Each step probes a `_pivot` and moves an end onto the nearest key on its side (the low end onto
    the smallest key >= pivot, the high end one past the largest key < pivot), so the search ends as
    soon as exactly r keys lie at or above the low end, or no key lies strictly between the ends.
    Returns ``(T, ties)``: the top r are the keys > T and the first `ties` keys equal to T (`ties` is
    INT32_MAX when the keys >= T are exactly r)."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    count_hi = tl.zeros((), tl.int32)
    total = count_lo.to(tl.float32)
    aim = r.to(tl.float32) - 0.5
    step = tl.zeros((), tl.int32)
    while (count_lo > r) & (hi - lo > 1):
        pivot = _pivot(lo, hi, count_lo, count_hi, aim, total, first_value, step)
        at_least, up, down = _probe(key, buf_ptr, span, pivot.to(tl.int32), FROM_BUFFER, TILE)
        go_up = at_least >= r
        lo = tl.where(go_up, up.to(tl.int64), lo)
        count_lo = tl.where(go_up, at_least, count_lo)
        hi = tl.where(go_up, hi, down.to(tl.int64) + 1)
        count_hi = tl.where(go_up, count_hi, at_least)
        step += 1
    ties = tl.where(count_lo == r, 2147483647, r - count_hi)
    return lo.to(tl.int32), ties


@triton.jit
def _first_value(key, ok, count, aim):
    """Mean + std * (normal quantile of aim / count) of the scores of the keys where `ok` (count > 0):
    the first pivot of a search; `aim` may be a vector of targets."""
    values = _key_value(key)
    shift = tl.sum(tl.where(ok, values, 0.0), 0) / count.to(tl.float32)
    centered = tl.where(ok, values - shift, 0.0)
    std = tl.sqrt(tl.sum(centered * centered, 0) / count.to(tl.float32))
    return shift + std * _probit(aim / count.to(tl.float32))


@triton.jit
def _write_columns(out_row, key, col, threshold, ties, slot_base, tie_base):
    """Write the columns of keys > threshold and of the keys equal to it ranked <= ties (counting from
    tie_base), at slots counted from slot_base, in the tiles' order. Returns the advanced bases."""
    tie = key == threshold
    tie_rank = tie_base + tl.cumsum(tie.to(tl.int32), 0)
    take = (key > threshold) | (tie & (tie_rank <= ties))
    slot = slot_base + tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(out_row + slot, col.to(tl.int64), mask=take)
    return slot_base + tl.sum(take.to(tl.int32), 0), tie_base + tl.sum(tie.to(tl.int32), 0)


@triton.jit
def _fill_empty(out_row, first, heavy, TILE: tl.constexpr):
    """NO_TOKEN in slots ``[first, heavy)``."""
    for t in range(first, heavy, TILE):
        slots = t + tl.arange(0, TILE)
        tl.store(out_row + slots, tl.full((TILE,), NO_TOKEN, tl.int64), mask=slots < heavy)


@triton.jit
def _top_columns(out_row, key, cols, heavy, TILE: tl.constexpr):
    """The columns `cols` of the top ``min(heavy, keys)`` of `key` (INT32_MIN: no key; ties: the first in
    order) written at ``out_row[0:heavy)`` in their order, then NO_TOKEN."""
    ok = key != -2147483648
    count, smallest, largest = tl.reduce((ok.to(tl.int32), tl.where(ok, key, 2147483647), key), 0, _sum_min_max)
    r = tl.minimum(count, heavy)
    taken = tl.zeros((), tl.int32)
    if r > 0:
        first = _first_value(key, ok, count, r.to(tl.float32) - 0.5)
        threshold, ties = _exact_threshold(key, out_row, 0, r, smallest, count, largest.to(tl.int64) + 1,
                                           first, False, TILE)
        taken, _ = _write_columns(out_row, key, cols, threshold, ties, 0, 0)
    _fill_empty(out_row, taken, heavy, TILE)


@triton.jit
def _level_targets(r0, r1, r2, r3, LEVELS_: tl.constexpr):
    """The LEVELS target ranks as a vector (ascending; the last is `heavy`)."""
    levels = tl.arange(0, LEVELS_)
    return tl.where(levels == 0, r0, tl.where(levels == 1, r1, tl.where(levels == 2, r2, r3)))


@triton.jit
def _window(window_ptr, i, n, HAS_WINDOW: tl.constexpr):
    """Row i's selectable column range ``[start, end)`` clipped to ``[0, n)`` (int32 scalars)."""
    if HAS_WINDOW:
        start = tl.minimum(tl.maximum(tl.load(window_ptr + 2 * i), 0), n).to(tl.int32)
        end = tl.minimum(tl.maximum(tl.load(window_ptr + 2 * i + 1), 0), n).to(tl.int32)
    else:
        start = tl.zeros((), tl.int32)
        end = tl.zeros((), tl.int32) + n
    return start, end


@triton.jit
def _program_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, window_ptr,
                  mask_ptr, pid, chunk, n, s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_hb, s_mb,
                  HEADS: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, LOAD_BYTES: tl.constexpr,
                  GROUP: tl.constexpr, PER_ROW_CHANNELS: tl.constexpr, FROM_QUERY: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, CHUNK_: tl.constexpr):
    """Row-head `pid`'s chunk `chunk`: its columns ``[CHUNK_]`` and their keys (`_chunk_keys`); a chunk
    outside the row's window loads nothing (every column masked) and has no key."""
    i = (pid // HEADS).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    head = tl.load(heads_ptr + i * s_hb + pid % HEADS).to(tl.int64)
    start, end = _window(window_ptr, i, n, HAS_WINDOW)
    cols = chunk * CHUNK_ + tl.arange(0, CHUNK_)
    key = _chunk_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, mask_ptr,
                      pid, i, row, head, cols, start, end,
                      s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_mb,
                      R, BITS, LOAD_BYTES, GROUP, PER_ROW_CHANNELS, FROM_QUERY, HAS_MASK)
    return cols, key


@triton.jit
def _label_topk_sketch(
    ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, window_ptr, mask_ptr,
    sketch_ptr, done_ptr, out_ptr, n, heavy, r0, r1, r2, r3,
    s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_hb, s_mb,
    HEADS: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, LOAD_BYTES: tl.constexpr, GROUP: tl.constexpr,
    PER_ROW_CHANNELS: tl.constexpr, FROM_QUERY: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
    SINGLE: tl.constexpr, CHUNK_: tl.constexpr, LEVELS_: tl.constexpr, SKETCH_: tl.constexpr, TILE: tl.constexpr,
):
    """Program (row-head pid, chunk): the chunk's sketch, or with SINGLE (one chunk) the row's columns."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    cols, key = _program_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr,
                              window_ptr, mask_ptr, pid, chunk, n, s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb,
                              s_sh, s_zb, s_zh, s_hb, s_mb, HEADS, R, BITS, LOAD_BYTES, GROUP, PER_ROW_CHANNELS,
                              FROM_QUERY, HAS_WINDOW, HAS_MASK, CHUNK_)
    if SINGLE:
        _top_columns(out_ptr + pid.to(tl.int64) * heavy, key, cols, heavy, TILE)
    else:
        if chunk == 0:
            tl.store(done_ptr + pid, 0)  # the second launch's ticket of this row-head
        levels = tl.arange(0, LEVELS_)
        lo = tl.full((LEVELS_,), -2147483648, tl.int64)
        count_lo = tl.zeros((LEVELS_,), tl.int32)
        count = tl.zeros((), tl.int32)
        largest = tl.full((), -2147483648, tl.int32)
        smallest = tl.full((), 2147483647, tl.int32)
        ok = key != -2147483648
        count = tl.sum(ok.to(tl.int32), 0)
        if count > 0:
            largest = tl.max(key, 0)
            smallest = tl.min(tl.where(ok, key, 2147483647), 0)
            # per level: a key whose count of keys at or above is within [r, r + r/4], by the
            # search of `_exact_threshold` over all levels at once, stopped at the window
            r = tl.minimum(_level_targets(r0, r1, r2, r3, LEVELS_), count)
            slack = r >> 2
            aim = (r + (slack >> 1)).to(tl.float32)
            first = _first_value(key, ok, count, aim)
            total = count.to(tl.float32)
            lo = tl.zeros((LEVELS_,), tl.int64) + smallest
            count_lo = tl.zeros((LEVELS_,), tl.int32) + count
            hi = tl.zeros((LEVELS_,), tl.int64) + largest + 1
            count_hi = tl.zeros((LEVELS_,), tl.int32)
            active = (count_lo > r + slack) & (hi - lo > 1)
            step = tl.zeros((), tl.int32)
            while tl.max(active.to(tl.int32), 0) > 0:
                pivot = _pivot(lo, tl.where(active, hi, lo + 2), count_lo, count_hi, aim, total, first, step)
                at_least = key[None, :] >= pivot.to(tl.int32)[:, None]
                count_at = tl.sum(at_least.to(tl.int32), 1)
                up = tl.min(tl.where(at_least, key[None, :], 2147483647), 1)
                down = tl.max(tl.where(at_least, -2147483648, key[None, :]), 1)
                go_up = active & (count_at >= r)
                go_down = active & (count_at < r)
                lo = tl.where(go_up, up.to(tl.int64), lo)
                count_lo = tl.where(go_up, count_at, count_lo)
                hi = tl.where(go_down, down.to(tl.int64) + 1, hi)
                count_hi = tl.where(go_down, count_at, count_hi)
                active = active & (count_lo > r + slack) & (hi - lo > 1)
                step += 1
        record = sketch_ptr + (pid.to(tl.int64) * tl.num_programs(1) + chunk) * SKETCH_
        tl.store(record + levels, lo.to(tl.int32))
        tl.store(record + LEVELS_ + levels, count_lo)
        tl.store(record + 2 * LEVELS_, count)
        tl.store(record + 2 * LEVELS_ + 1, largest)
        tl.store(record + 2 * LEVELS_ + 2, smallest)


@triton.jit
def _label_candidates(
    query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, mask_ptr, cand_ptr, out_ptr,
    best_ptr, n, heavy, candidates, top,
    s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_hb, s_mb, s_ka, s_kh,
    HEADS: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, LOAD_BYTES: tl.constexpr, GROUP: tl.constexpr,
    PER_ROW_CHANNELS: tl.constexpr, HAS_MASK: tl.constexpr, C_PAD: tl.constexpr, TILE: tl.constexpr,
    WALK: tl.constexpr, ASCENDING: tl.constexpr,
):
    """Program (row-head pid): the row-head's candidates' keys (a negative column, one outside the mask or
    scored non-finite has none), then its top `heavy` columns in candidate order, or (WALK, with the mask:
    the window) all of them walked with their successors, and their best `top` (`successors_triton._walk`;
    `heavy` = candidates; ASCENDING: the candidates are ascending, then negative, so not sorted into column
    order)."""
    pid = tl.program_id(0)
    i = (pid // HEADS).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    head = tl.load(heads_ptr + i * s_hb + pid % HEADS).to(tl.int64)
    slots = tl.arange(0, C_PAD)
    cols = tl.load(cand_ptr + i * s_ka + (pid % HEADS) * s_kh + slots, mask=slots < candidates, other=-1).to(tl.int32)
    key = _chunk_keys(query_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, mask_ptr,
                      pid, i, row, head, cols, tl.zeros((), tl.int32), tl.zeros((), tl.int32) + n,
                      s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_mb,
                      R, BITS, LOAD_BYTES, GROUP, PER_ROW_CHANNELS, True, HAS_MASK)
    if WALK:
        _walk(out_ptr + pid.to(tl.int64) * heavy, best_ptr + pid.to(tl.int64) * top, cols.to(tl.int64), key,
              key != -2147483648, mask_ptr + i * s_mb, n, heavy, top, C_PAD, ASCENDING)
    else:
        _top_columns(out_ptr + pid.to(tl.int64) * heavy, key, cols, heavy, TILE)


@triton.jit
def _label_topk_select(
    ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, window_ptr, mask_ptr,
    sketch_ptr, done_ptr, cand_ptr, out_ptr, n, heavy, chunk_cap, cand_stride,
    s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_sb, s_sh, s_zb, s_zh, s_hb, s_mb,
    HEADS: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, LOAD_BYTES: tl.constexpr, GROUP: tl.constexpr,
    PER_ROW_CHANNELS: tl.constexpr, FROM_QUERY: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
    CHUNK_: tl.constexpr, CHUNKS_PAD: tl.constexpr, LEVELS_: tl.constexpr, SKETCH_: tl.constexpr,
    TILE: tl.constexpr,
):
    """Program (row-head pid, chunk): the chunk's candidates; the row-head's last program, its columns."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)

    # the row-head's sketches -> L, each chunk's slot range (the same in every program of the row-head)
    cs = tl.arange(0, CHUNKS_PAD)
    levels = tl.arange(0, LEVELS_)
    real = cs < chunks
    records = sketch_ptr + (pid.to(tl.int64) * chunks + cs) * SKETCH_
    lo = tl.load(records[:, None] + levels[None, :], mask=real[:, None], other=-2147483648)
    count_lo = tl.load(records[:, None] + LEVELS_ + levels[None, :], mask=real[:, None], other=0)
    count = tl.load(records + 2 * LEVELS_, mask=real, other=0)
    largest = tl.load(records + 2 * LEVELS_ + 1, mask=real, other=-2147483648)
    smallest = tl.load(records + 2 * LEVELS_ + 2, mask=real, other=2147483647)
    need = tl.minimum(tl.sum(count, 0), heavy)  # the row's heavy count: fewer when its window is short
    # L: the largest recorded key with at least `need` keys proven >= it (the row's smallest key always is)
    values = tl.reshape(lo, (CHUNKS_PAD * LEVELS_,))
    proven = tl.max(tl.where(lo[None, :, :] >= values[:, None, None], count_lo[None, :, :], 0), 2)
    proven = tl.maximum(proven, tl.where(smallest[None, :] >= values[:, None], count[None, :], 0))
    bound = tl.max(tl.where(tl.sum(proven, 1) >= need, values, -2147483648), 0)
    bound = tl.maximum(bound, tl.min(tl.where(count > 0, smallest, 2147483647), 0))
    # per chunk: keys >= L are at most the count of any recorded key <= L, its count, and chunk_cap
    upper = tl.min(tl.where(lo <= bound, count_lo, 2147483647), 1)
    upper = tl.minimum(tl.minimum(upper, count), chunk_cap)
    upper = tl.where(real & (largest >= bound) & (need > 0), upper, 0)
    offsets = tl.cumsum(upper, 0) - upper
    span = tl.sum(upper, 0)
    mine = cs == chunk
    my_offset = tl.sum(tl.where(mine, offsets, 0), 0)
    my_upper = tl.sum(tl.where(mine, upper, 0), 0)
    buf = cand_ptr + pid.to(tl.int64) * cand_stride

    if my_upper > 0:  # this chunk has keys >= L: score it again, write them in column order
        cols, key = _program_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr,
                                  window_ptr, mask_ptr, pid, chunk, n, s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn,
                                  s_sb, s_sh, s_zb, s_zh, s_hb, s_mb, HEADS, R, BITS, LOAD_BYTES, GROUP,
                                  PER_ROW_CHANNELS, FROM_QUERY, HAS_WINDOW, HAS_MASK, CHUNK_)
        above = key > bound
        tie = key == bound
        # of the keys equal to L the row needs at most need - (its keys above L) <= need - (ours above L)
        tie_room = tl.maximum(need - tl.sum(above.to(tl.int32), 0), 0)
        keep = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= tie_room))
        slot = tl.cumsum(keep.to(tl.int32), 0) - 1
        keep = keep & (slot < my_upper)  # never outside the range (a bound the sketch proves)
        packed = (key.to(tl.int64) << 32) | cols.to(tl.int64)
        tl.store(buf + my_offset + slot, packed, mask=keep)
        written = tl.sum(keep.to(tl.int32), 0)
        rest = tl.arange(0, CHUNK_)
        tl.store(buf + my_offset + rest, tl.full((CHUNK_,), SENTINEL, tl.int64),
                 mask=(rest >= written) & (rest < my_upper))

    tl.debug_barrier()  # every thread's writes before the ticket (released by it)
    ticket = tl.atomic_add(done_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if ticket == chunks - 1:  # the row-head's last program: its columns from the candidates
        out_row = out_ptr + pid.to(tl.int64) * heavy
        taken = tl.zeros((), tl.int32)
        if need > 0:
            if span <= TILE:  # one tile: held in registers for the search and the writes
                slots = tl.arange(0, TILE)
                packed = tl.load(buf + slots, mask=slots < span, other=SENTINEL, cache_modifier=".cg")
                taken = _select_candidates(out_row, packed, buf, span, bound, need, False, TILE)
            else:  # several tiles: every pass reads them again (from L2)
                taken = _select_candidates(out_row, tl.zeros((TILE,), tl.int64), buf, span, bound, need, True, TILE)
        _fill_empty(out_row, taken, heavy, TILE)


@triton.jit
def _select_candidates(out_row, packed, buf_ptr, span, bound, need, FROM_BUFFER: tl.constexpr, TILE: tl.constexpr):
    """The exact top-`need` of the packed candidates (all >= `bound`; SENTINEL: an empty slot), held
    in `packed` ``[TILE]`` or (FROM_BUFFER) in ``buf[0:span)``: their columns written ascending (the
    candidates are in column order). Returns how many were written."""
    shift = _key_value(bound)  # moments of the candidates' scores, about L
    if FROM_BUFFER:
        present = tl.zeros((TILE,), tl.int32)
        high = tl.full((TILE,), -2147483648, tl.int32)
        moment1 = tl.zeros((TILE,), tl.float32)
        moment2 = tl.zeros((TILE,), tl.float32)
        for t in range(0, span, TILE):
            slots = t + tl.arange(0, TILE)
            tile = tl.load(buf_ptr + slots, mask=slots < span, other=SENTINEL, cache_modifier=".cg")
            real = tile != SENTINEL
            present += real.to(tl.int32)
            high = tl.maximum(high, (tile >> 32).to(tl.int32))
            centered = tl.where(real, _key_value((tile >> 32).to(tl.int32)) - shift, 0.0)
            moment1 += centered
            moment2 += centered * centered
        key = high  # a placeholder: the search reads the buffer
    else:
        real = packed != SENTINEL
        key = (packed >> 32).to(tl.int32)
        present = real.to(tl.int32)
        high = key
        centered = tl.where(real, _key_value(key) - shift, 0.0)
        moment1 = centered
        moment2 = centered * centered
    count = tl.sum(present, 0)
    r = tl.minimum(need, count)  # == need: the sketch proves need keys >= L
    taken = tl.zeros((), tl.int32)
    if r > 0:
        mean = tl.sum(moment1, 0) / count.to(tl.float32)
        std = tl.sqrt(tl.maximum(tl.sum(moment2, 0) / count.to(tl.float32) - mean * mean, 0.0))
        first = shift + mean + std * _probit((r.to(tl.float32) - 0.5) / count.to(tl.float32))
        threshold, ties = _exact_threshold(key, buf_ptr, span, r, bound, count, tl.max(high, 0).to(tl.int64) + 1,
                                           first, FROM_BUFFER, TILE)
        if FROM_BUFFER:
            tie_base = tl.zeros((), tl.int32)
            for t in range(0, span, TILE):
                slots = t + tl.arange(0, TILE)
                tile = tl.load(buf_ptr + slots, mask=slots < span, other=SENTINEL, cache_modifier=".cg")
                taken, tie_base = _write_columns(out_row, (tile >> 32).to(tl.int32), (tile & 0xFFFFFFFF).to(tl.int32),
                                                 threshold, ties, taken, tie_base)
        else:
            taken, _ = _write_columns(out_row, key, (packed & 0xFFFFFFFF).to(tl.int32), threshold, ties, 0, 0)
    return taken


def _load_bytes(codes: torch.Tensor, bits: int, channels: int) -> int:
    """Widest word (4, 2 or 1 bytes) that every label row's codes start on and divide into."""
    row_bytes = channels * bits // 8
    for width in (4, 2, 1):
        if width * 8 < bits:
            continue
        if (row_bytes % width == 0 and codes.data_ptr() % width == 0
                and all(s * codes.element_size() % width == 0 for s in codes.stride()[:-1])):
            return width
    raise ValueError("16-bit label codes are not 2-byte aligned")


def sketch_levels(heavy: int, chunks: int) -> list[int]:
    """The LEVELS target ranks of a chunk's sketch: its share of the row's heavy tokens
    ``ceil(heavy / chunks)``, twice and eight times that, and `heavy` (ascending, capped at heavy)."""
    share = max(1, -(-heavy // chunks))
    return [min(share, heavy), min(2 * share, heavy), min(8 * share, heavy), heavy]


def _operands(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
              zero: torch.Tensor | None, bits: int, r: int, rows: torch.Tensor, heads: torch.Tensor,
              selectable: torch.Tensor | None) -> tuple:
    """What the kernels read, laid out for them: ``(code bytes, scale, zero, rows, heads [A, H'], mask,
    load bytes, strides)``; the placeholders of absent operands are tensors the kernels never read."""
    if codes.stride(-1) != 1:
        raise ValueError("label codes must be contiguous in the channel dimension")
    if bits == 4 and r % 2:
        raise ValueError(f"label_channels {r} is odd; 4-bit labels hold two channels a byte")
    code_bytes = codes.view(torch.uint8)  # byte view: strides in bytes
    heads = heads.expand(rows.shape[0], heads.shape[-1])  # any integer dtype; a shared row keeps stride 0 (no copy)
    heads = heads if heads.stride(-1) == 1 else heads.contiguous()
    rows = rows if rows.is_contiguous() else rows.contiguous()
    if selectable is not None:
        mask = selectable.view(torch.uint8) if selectable.dtype == torch.bool else selectable.to(torch.uint8)
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    else:
        mask = rows
    scale = scale if scale is not None else codes  # 16-bit labels: the codes' dtype tells bf16 from fp16
    zero = zero if zero is not None else codes
    strides = (query.stride(0), query.stride(1), channels.stride(0), channels.stride(1),
               code_bytes.stride(0), code_bytes.stride(1), code_bytes.stride(2),
               scale.stride(0), scale.stride(1), zero.stride(0), zero.stride(1), heads.stride(0),
               mask.stride(0) if selectable is not None else 0)
    return code_bytes, scale, zero, rows, heads, mask, _load_bytes(codes, bits, r), strides


def candidate_label_topk_triton(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                                scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int, heavy: int,
                                candidates: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor,
                                selectable: torch.Tensor | None = None, *, tile: int | None = None,
                                num_warps: int | None = None) -> torch.Tensor:
    """Same contract as `label_topk.candidate_label_topk` (``[A, H', heavy]`` int64, the chosen candidates'
    columns in candidate order, then NO_TOKEN), for rows ``[A]`` and heads ``[A or 1, H']`` index tensors:
    one launch, a program per (row, head) scoring its ``C <= MAX_CANDIDATES`` candidates in registers."""
    return _candidates(query, channels, codes, scale, zero, bits, heavy, candidates, rows, heads, selectable,
                       False, tile, num_warps)[0]


def candidate_label_walk_triton(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                                scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int,
                                candidates: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor,
                                selectable: torch.Tensor, top: int = 0, *, ascending: bool = False,
                                num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `label_topk.candidate_label_walk` (``[A, H', C]`` int64: the walk's columns ascending, then
    NO_TOKEN; ``[A, H', top]``: the best `top` allowed candidates ascending, then NO_TOKEN), for rows ``[A]`` and heads
    ``[A or 1, H']`` index tensors: one launch, a program per (row, head) scoring its ``C <= MAX_WALK_CANDIDATES``
    candidates and walking them in registers."""
    if codes.shape[2] >= (1 << COLUMN_BITS) - 1:
        raise ValueError(f"{codes.shape[2]} columns; accepted: fewer than {(1 << COLUMN_BITS) - 1} (the torch twin "
                         "takes more)")
    return _candidates(query, channels, codes, scale, zero, bits, candidates.shape[-1], candidates, rows, heads,
                       selectable, True, None, num_warps, ascending, top)


def _candidates(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                zero: torch.Tensor | None, bits: int, heavy: int, candidates: torch.Tensor, rows: torch.Tensor,
                heads: torch.Tensor, selectable: torch.Tensor | None, walk: bool, tile: int | None,
                num_warps: int | None, ascending: bool = False, top: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of `_label_candidates`: ``[A, H', heavy]`` int64, and (`walk`) the best `top` candidates."""
    count, n_heads, width = candidates.shape
    out = torch.empty(count, n_heads, heavy, dtype=torch.int64, device=codes.device)
    best = torch.full((count, n_heads, top), -1, dtype=torch.int64, device=codes.device)
    if heavy == 0 or count * n_heads == 0:
        return out, best
    limit = MAX_WALK_CANDIDATES if walk else MAX_CANDIDATES
    if width > limit:
        raise ValueError(f"{width} candidates per head; accepted: at most {limit} (the torch twin takes more)")
    _, query, channels, r, group, _ = kernel_label_inputs(None, query, channels)
    code_bytes, scale_t, zero_t, rows, heads, mask_t, load_bytes, strides = _operands(
        query, channels, codes, scale, zero, bits, r, rows, heads, selectable)
    candidates = candidates if candidates.stride(-1) == 1 else candidates.contiguous()
    pad = max(16, triton.next_power_of_2(width))
    warps = max(4, min(16, pad // 512))
    if walk and pad >= 2048:  # the walk's searches run faster on 8 warps there (candidate_timing.py --warps)
        warps = max(warps, 8)
    _label_candidates[(count * n_heads,)](
        query, channels, code_bytes, scale_t, zero_t, rows, heads, mask_t, candidates, out, best,
        codes.shape[2], heavy, width, top, *strides, candidates.stride(0), candidates.stride(1),
        HEADS=n_heads, R=r, BITS=bits, LOAD_BYTES=load_bytes, GROUP=group,
        PER_ROW_CHANNELS=channels.shape[0] > 1, HAS_MASK=selectable is not None, C_PAD=pad,
        TILE=tile or TAIL_TILE, WALK=walk, ASCENDING=ascending, num_warps=num_warps or warps,
    )
    return out, best


def label_topk_triton(query_labels: torch.Tensor | None, codes: torch.Tensor, scale: torch.Tensor | None,
                      zero: torch.Tensor | None, bits: int, heavy: int, rows: torch.Tensor, heads: torch.Tensor,
                      window: torch.Tensor | None = None, selectable: torch.Tensor | None = None, *,
                      query: torch.Tensor | None = None, channels: torch.Tensor | None = None,
                      chunk: int | None = None, tile: int | None = None, num_warps: int | None = None,
                      tail_warps: int | None = None) -> torch.Tensor:
    """Same contract as `label_topk.label_topk` (``[A, H', heavy]`` int64, ascending columns, then
    NO_TOKEN), for rows ``[A]`` and heads ``[A or 1, H']`` index tensors. Without `query_labels`, the
    labels are gathered in the kernel from the decode `query` ``[B, Hq, d]`` and the heavy `channels`
    ``[P, H_sel, r]``. `chunk` (a power of two), `tile`, `num_warps` and `tail_warps` override the
    launch (tests, benchmark sweeps)."""
    n = codes.shape[2]
    count, n_heads = rows.shape[0], heads.shape[-1]
    device = codes.device
    out = torch.empty(count, n_heads, heavy, dtype=torch.int64, device=device)
    if heavy == 0 or count * n_heads == 0:
        return out
    labels, query, channels, r, group, from_query = kernel_label_inputs(query_labels, query, channels)
    if not from_query:  # one row of labels per program
        labels = query = channels = labels.reshape(count * n_heads, r)
    code_bytes, scale_t, zero_t, rows, heads, mask_t, load_bytes, strides = _operands(
        query, channels, codes, scale, zero, bits, r, rows, heads, selectable)
    has_window, has_mask = window is not None, selectable is not None
    window_t = window if not has_window or window.is_contiguous() else window.contiguous()
    window_t = window_t if has_window else rows
    size = chunk or max(min(CHUNK, max(16, triton.next_power_of_2(n))),
                        triton.next_power_of_2(triton.cdiv(n, MAX_CHUNKS)))
    chunks = triton.cdiv(n, size)
    tile = tile or TAIL_TILE
    row_heads = count * n_heads
    levels = sketch_levels(heavy, chunks)
    common = dict(
        HEADS=n_heads, R=r, BITS=bits, LOAD_BYTES=load_bytes, GROUP=group,
        PER_ROW_CHANNELS=from_query and channels.shape[0] > 1, FROM_QUERY=from_query,
        HAS_WINDOW=has_window, HAS_MASK=has_mask, CHUNK_=size, LEVELS_=LEVELS, SKETCH_=SKETCH, TILE=tile,
    )
    warps = num_warps or max(4, min(16, size // 512))
    if chunks == 1:
        _label_topk_sketch[(row_heads, 1)](
            labels, query, channels, code_bytes, scale_t, zero_t, rows, heads, window_t, mask_t,
            out, out, out, n, heavy, *levels, *strides, SINGLE=True, num_warps=warps, **common,
        )
        return out
    sketch = torch.empty(row_heads, chunks, SKETCH, dtype=torch.int32, device=device)
    done = torch.empty(row_heads, dtype=torch.int32, device=device)
    chunk_cap = min(size, heavy + heavy // 4 + 1)
    cand_stride = -(-chunks * chunk_cap // 16) * 16  # whole 128-byte lines per row-head (no shared line)
    cand = torch.empty(row_heads, cand_stride, dtype=torch.int64, device=device)
    _label_topk_sketch[(row_heads, chunks)](
        labels, query, channels, code_bytes, scale_t, zero_t, rows, heads, window_t, mask_t,
        sketch, done, out, n, heavy, *levels, *strides, SINGLE=False, num_warps=warps, **common,
    )
    _label_topk_select[(row_heads, chunks)](
        labels, query, channels, code_bytes, scale_t, zero_t, rows, heads, window_t, mask_t,
        sketch, done, cand, out, n, heavy, chunk_cap, cand_stride, *strides,
        CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)), num_warps=tail_warps or warps, **common,
    )
    return out
