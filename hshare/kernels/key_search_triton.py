"""Triton order-preserving score keys and the exact top-r search over them, shared by the fused label top-k
(`label_topk_triton`), the successors walk (`successors_triton`) and Quest's page top-k (`page_topk_triton`,
pages weighed by their selectable columns).

Scores are compared as order-preserving int32 *keys* of their fp32 values (-0.0 as +0.0); an entry with no
score has the key ``INT32_MIN`` (never counted).

The search (`_exact_threshold`): for a target count r, keys ``lo < hi`` with at least r keys (or key weight)
at or above `lo` and less at or above `hi`; each step probes a pivot key (first the scores' mean + std
times the normal quantile of r / count, then linear interpolation of the score in the normal quantiles of
the counts at the ends; the middle of the key range where the count between the ends did not halve over the three
steps before) with one pass of three block reductions in one `tl.reduce` (count >= pivot, the nearest key above, the
nearest below) and moves an end onto the nearest key on its side. It ends when exactly r keys lie at or above `lo`,
or no key lies between the ends (then the keys equal to `lo` are ties: the first in column order are taken). Few
steps at the scores' distributions; every four steps halve the count between the ends or the key range.
`_exact_threshold_pair` runs two such searches over the same register keys in one loop, both pivots probed in one
reduction a step (the successors walk's stop key and its best columns).

Keys that are the *upper tail* of a larger set (TAIL: a selection's top columns walked with their successors, the
keys at or above a label top-k's bound) are not normal: their counts fall about exponentially with the score from
their smallest key on. Their search interpolates the score in the logarithm of the counts instead, which takes fewer
probes at such keys.
"""

from __future__ import annotations

import triton
import triton.language as tl

SENTINEL = tl.constexpr(-(1 << 63))  # an empty packed (key << 32 | column) slot (its key is INT32_MIN)
NO_TOKEN = tl.constexpr(-1)
# what the writes put in their second row (`KEYS`): nothing (0 or False), the keys (1 or True), or the columns as
# int32 (COLUMNS32: the heavy part of a critical-indices row, NO_TOKEN after them)
COLUMNS32 = tl.constexpr(2)


@triton.jit
def _score_key(score):
    """Order-preserving int32 key of an fp32 score (-0.0 as +0.0; negative floats flip their magnitude bits)."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


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
def _pivot(lo, hi, count_lo, count_hi, aim, total, first_value, step, bisect, TAIL: tl.constexpr = False):
    """A key strictly inside ``(lo, hi)`` (int64, ``hi - lo >= 2``) at which about `aim` of the
    `total` keys should lie at or above: the middle of the key range where `bisect`; else at step 0
    `first_value` (the keys' mean + std times the normal quantile of aim / total), and later the value
    interpolated linearly in the normal quantiles of the counts at the ends (exact for a normal tail), or
    (TAIL) in their logarithms (exact where the counts fall exponentially with the score)."""
    middle = lo + (hi - lo) // 2
    low_value = _key_value(lo.to(tl.int32))
    high_value = _key_value(hi.to(tl.int32))
    if TAIL:
        log_low = tl.log(count_lo.to(tl.float32))
        fraction = (log_low - tl.log(aim)) / (log_low - tl.log(tl.maximum(count_hi.to(tl.float32), 0.5)))
    else:
        z_low = _probit(count_lo.to(tl.float32) / total)
        z_high = _probit(tl.maximum(count_hi.to(tl.float32), 0.5) / total)
        fraction = (_probit(aim / total) - z_low) / (z_high - z_low)
    value = tl.where(step == 0, first_value, low_value + (high_value - low_value) * fraction)
    bits = value.to(tl.int32, bitcast=True)
    guess = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    guess = tl.where(tl.abs(value) < float("inf"), guess, middle)  # an infinite end or NaN: bisect
    guess = tl.minimum(tl.maximum(guess, lo + 1), hi - 1)
    return tl.where(bisect, middle, guess)


@triton.jit
def _sum_min_max(count_a, low_a, high_a, count_b, low_b, high_b):
    """`tl.reduce` combine of (a sum, a minimum, a maximum) in one reduction."""
    return count_a + count_b, tl.minimum(low_a, low_b), tl.maximum(high_a, high_b)


@triton.jit
def _probe_terms(key, weight, pivot):
    """Per register key ``[N]``, the terms of a probe's three reductions at a pivot: its weight where it is >= the
    pivot (else 0), itself where >= (else INT32_MAX), itself where below (else INT32_MIN)."""
    at_least = key >= pivot
    return (tl.where(at_least, weight, 0), tl.where(at_least, key, 2147483647),
            tl.where(at_least, -2147483648, key))


@triton.jit
def _probe(key, weight, buf_ptr, span, pivot, FROM_BUFFER: tl.constexpr, TILE: tl.constexpr):
    """At a pivot key: the count of keys >= it (of register keys, their summed `weight`: an int32 ``[N]`` or 1),
    the smallest key >= it and the largest key < it, of the register keys ``[N]`` or of the packed candidates
    ``buf[0:span)`` (INT32_MIN: no key)."""
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
        count, up, down = _probe_terms(key, weight, pivot)
    return tl.reduce((count, up, down), 0, _sum_min_max)


@triton.jit
def _sum_min_max_pair(count_a, low_a, high_a, count_b, low_b, high_b, count_c, low_c, high_c, count_d, low_d, high_d):
    """`tl.reduce` combine of two probes' (sum, minimum, maximum) in one reduction."""
    return (count_a + count_c, tl.minimum(low_a, low_c), tl.maximum(high_a, high_c), count_b + count_d,
            tl.minimum(low_b, low_d), tl.maximum(high_b, high_d))


@triton.jit
def _search_pivot(lo, hi, count_lo, count_hi, between_3, aim, total, first_value, step, TAIL: tl.constexpr):
    """A search's next pivot (`_pivot`): the middle of the key range where the count between the ends is above half
    of what it was three steps before."""
    return _pivot(lo, hi, count_lo, count_hi, aim, total, first_value, step, count_lo - count_hi > between_3 // 2, TAIL)


@triton.jit
def _search_move(lo, hi, count_lo, count_hi, between_1, between_2, between_3, step, r, at_least, up, down, active):
    """A search's state after a probe (the keys' count or weight at or above the pivot, the smallest key >= it, the
    largest below): the low end onto the smallest key >= pivot where that count is at least r, else the high end
    one past the largest key < pivot; the counts between the ends shifted. Unchanged where not `active`."""
    go_up = (at_least >= r) & active
    go_down = (at_least < r) & active
    return (tl.where(go_up, up.to(tl.int64), lo), tl.where(go_down, down.to(tl.int64) + 1, hi),
            tl.where(go_up, at_least, count_lo), tl.where(go_down, at_least, count_hi),
            tl.where(active, count_lo - count_hi, between_1), tl.where(active, between_1, between_2),
            tl.where(active, between_2, between_3), step + tl.where(active, 1, 0))


@triton.jit
def _search_ties(count_lo, count_hi, r):
    """A finished search's ties: INT32_MAX where the keys at or above its low end are exactly r, else what of r the
    keys above it leave to the keys equal to it."""
    return tl.where(count_lo == r, 2147483647, r - count_hi)


@triton.jit
def _exact_threshold(key, weight, buf_ptr, span, r, lo, count_lo, hi, first_value,
                     FROM_BUFFER: tl.constexpr, TILE: tl.constexpr, TAIL: tl.constexpr = False):
    """The r-th largest key and how many of the keys equal to it to take; with a `weight` per key (register keys
    only; 1 = count them), the largest key T whose keys at or above weigh at least r (the keys above T weigh
    less than r; what the ties take is then the caller's).

    `lo` is the smallest key and holds ``count_lo`` keys (their weight) at or above (< r: the search ends
    at once); `hi` is above every key.
    Each step probes a `_pivot` and moves an end onto the nearest key on its side (the low end onto
    the smallest key >= pivot, the high end one past the largest key < pivot), so the search ends as
    soon as exactly r keys lie at or above the low end, or no key lies strictly between the ends. A step whose
    count between the ends is above half of what it was three steps before bisects the key range. TAIL: the keys
    are an upper tail (`_pivot`'s interpolation).
    Returns ``(T, ties, probes)``: the top r are the keys > T and the first `ties` keys equal to T (`ties` is
    INT32_MAX when the keys >= T are exactly r); `probes`, the steps taken (what a search costs)."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    count_hi = tl.zeros((), tl.int32)
    total = count_lo.to(tl.float32)
    aim = r.to(tl.float32) - 0.5
    step = tl.zeros((), tl.int32)
    # the count between the ends one, two and three steps before
    between_1 = tl.zeros((), tl.int32) + 2147483647
    between_2 = tl.zeros((), tl.int32) + 2147483647
    between_3 = tl.zeros((), tl.int32) + 2147483647
    while (count_lo > r) & (hi - lo > 1):
        pivot = _search_pivot(lo, hi, count_lo, count_hi, between_3, aim, total, first_value, step, TAIL)
        at_least, up, down = _probe(key, weight, buf_ptr, span, pivot.to(tl.int32), FROM_BUFFER, TILE)
        lo, hi, count_lo, count_hi, between_1, between_2, between_3, step = _search_move(
            lo, hi, count_lo, count_hi, between_1, between_2, between_3, step, r, at_least, up, down, True)
    return lo.to(tl.int32), _search_ties(count_lo, count_hi, r), step


@triton.jit
def _exact_threshold_pair(key, weight, r, count_lo, first_value, r_b, count_lo_b, first_value_b, lo, hi):
    """Two searches of `_exact_threshold` over the same register keys ``[N]`` (their smallest key `lo`, `hi` above
    them all; tail pivots), in one loop: each step probes both pivots in one reduction, so the pair takes the
    longer search's steps, not their sum. The first for weight r of `weight` (``count_lo``, the keys' total weight),
    the second for the r_b-th largest key (counted; ``count_lo_b`` keys). Returns ``(T, ties, T_b, ties_b, probes)``,
    each as `_exact_threshold`'s."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    lo_b = lo
    hi_b = hi
    count_hi = tl.zeros((), tl.int32)
    count_hi_b = tl.zeros((), tl.int32)
    total = count_lo.to(tl.float32)
    total_b = count_lo_b.to(tl.float32)
    aim = r.to(tl.float32) - 0.5
    aim_b = r_b.to(tl.float32) - 0.5
    step = tl.zeros((), tl.int32)
    step_b = tl.zeros((), tl.int32)
    between_1 = tl.zeros((), tl.int32) + 2147483647
    between_2 = tl.zeros((), tl.int32) + 2147483647
    between_3 = tl.zeros((), tl.int32) + 2147483647
    between_1b = tl.zeros((), tl.int32) + 2147483647
    between_2b = tl.zeros((), tl.int32) + 2147483647
    between_3b = tl.zeros((), tl.int32) + 2147483647
    active = (count_lo > r) & (hi - lo > 1)
    active_b = (count_lo_b > r_b) & (hi_b - lo_b > 1)
    probes = tl.zeros((), tl.int32)
    while active | active_b:
        pivot = _search_pivot(lo, hi, count_lo, count_hi, between_3, aim, total, first_value, step, True)
        pivot_b = _search_pivot(lo_b, hi_b, count_lo_b, count_hi_b, between_3b, aim_b, total_b, first_value_b, step_b,
                                True)
        at_least, up, down, at_least_b, up_b, down_b = tl.reduce(
            _probe_terms(key, weight, pivot.to(tl.int32)) + _probe_terms(key, 1, pivot_b.to(tl.int32)), 0,
            _sum_min_max_pair)
        lo, hi, count_lo, count_hi, between_1, between_2, between_3, step = _search_move(
            lo, hi, count_lo, count_hi, between_1, between_2, between_3, step, r, at_least, up, down, active)
        lo_b, hi_b, count_lo_b, count_hi_b, between_1b, between_2b, between_3b, step_b = _search_move(
            lo_b, hi_b, count_lo_b, count_hi_b, between_1b, between_2b, between_3b, step_b, r_b, at_least_b, up_b,
            down_b, active_b)
        active = (count_lo > r) & (hi - lo > 1)
        active_b = (count_lo_b > r_b) & (hi_b - lo_b > 1)
        probes += 1
    return (lo.to(tl.int32), _search_ties(count_lo, count_hi, r), lo_b.to(tl.int32),
            _search_ties(count_lo_b, count_hi_b, r_b), probes)


@triton.jit
def _stats_combine(count_a, low_a, high_a, sum_a, square_a, count_b, low_b, high_b, sum_b, square_b):
    """`tl.reduce` combine of `_key_stats`: a count, a minimum, a maximum and two sums."""
    return (count_a + count_b, tl.minimum(low_a, low_b), tl.maximum(high_a, high_b), sum_a + sum_b,
            square_a + square_b)


@triton.jit
def _key_stats(key, ok):
    """Of the keys ``[N]`` where `ok`, in one reduction: their count, smallest and largest key (INT32_MAX and
    INT32_MIN where none), and their scores' mean and standard deviation (by the mean square: a first pivot's
    guess, not a statistic reported; 0 where none)."""
    values = tl.where(ok, _key_value(key), 0.0)
    count, smallest, largest, total, square = tl.reduce(
        (ok.to(tl.int32), tl.where(ok, key, 2147483647), tl.where(ok, key, -2147483648), values, values * values), 0,
        _stats_combine)
    present = tl.maximum(count, 1).to(tl.float32)
    mean = total / present
    return count, smallest, largest, mean, tl.sqrt(tl.maximum(square / present - mean * mean, 0.0))


@triton.jit
def _first_value(mean, std, count, aim):
    """The first pivot's score of a search for the top `aim` of `count` keys (> 0) whose scores have this mean and
    standard deviation (`_key_stats`): mean + std * (normal quantile of aim / count); `aim` may be a vector of
    targets."""
    return mean + std * _probit(aim / count.to(tl.float32))


@triton.jit
def _write_columns(out_row, key, col, threshold, ties, slot_base, tie_base, key_row, KEYS: tl.constexpr):
    """Write the columns of keys > threshold and of the keys equal to it ranked <= ties (counting from
    tie_base), at slots counted from slot_base, in the tiles' order; with KEYS their keys too (or, COLUMNS32, the
    columns as int32), at the same slots of `key_row` (int32). Returns the advanced bases.

    One scan counts both: the keys above in the high half of an int32, the ties in the low 16 bits (a tile holds
    fewer than 65,536 keys); a key's slot is the keys above before it plus the ties taken before it."""
    above = key > threshold
    tie = key == threshold
    flags = above.to(tl.int32) * 65536 + tie.to(tl.int32)
    before = tl.cumsum(flags, 0) - flags  # exclusive
    ties_before = before & 0xFFFF
    room = tl.maximum(ties - tie_base, 0)  # ties the tile may still take (ties: INT32_MAX = all of them)
    take = above | (tie & (ties_before < room))
    slot = slot_base + (before >> 16) + tl.minimum(ties_before, room)
    tl.store(out_row + slot, col.to(tl.int64), mask=take)
    if KEYS == COLUMNS32:
        tl.store(key_row + slot, col.to(tl.int32), mask=take)
    elif KEYS:
        tl.store(key_row + slot, key, mask=take)
    total = tl.sum(flags, 0)
    tile_ties = total & 0xFFFF
    return slot_base + (total >> 16) + tl.minimum(tile_ties, room), tie_base + tile_ties


@triton.jit
def _fill_empty(out_row, first, heavy, TILE: tl.constexpr, key_row, KEYS: tl.constexpr):
    """NO_TOKEN in slots ``[first, heavy)``; with KEYS, INT32_MIN (no key) there in `key_row` too (COLUMNS32:
    NO_TOKEN)."""
    for t in range(first, heavy, TILE):
        slots = t + tl.arange(0, TILE)
        tl.store(out_row + slots, tl.full((TILE,), NO_TOKEN, tl.int64), mask=slots < heavy)
        if KEYS == COLUMNS32:
            tl.store(key_row + slots, tl.full((TILE,), NO_TOKEN, tl.int32), mask=slots < heavy)
        elif KEYS:
            tl.store(key_row + slots, tl.full((TILE,), -2147483648, tl.int32), mask=slots < heavy)


@triton.jit
def _top_columns(out_row, key, cols, heavy, TILE: tl.constexpr, key_row, KEYS: tl.constexpr):
    """The columns `cols` of the top ``min(heavy, keys)`` of `key` (INT32_MIN: no key; ties: the first in
    order) written at ``out_row[0:heavy)`` in their order, then NO_TOKEN; with KEYS their keys at ``key_row[0:heavy)``,
    then INT32_MIN (COLUMNS32: the columns as int32, then NO_TOKEN). Returns how many were written."""
    count, smallest, largest, mean, std = _key_stats(key, key != -2147483648)
    r = tl.minimum(count, heavy)
    taken = tl.zeros((), tl.int32)
    if r > 0:
        first = _first_value(mean, std, count, r.to(tl.float32) - 0.5)
        threshold, ties, _ = _exact_threshold(key, 1, out_row, 0, r, smallest, count, largest.to(tl.int64) + 1,
                                              first, False, TILE)
        taken, _ = _write_columns(out_row, key, cols, threshold, ties, 0, 0, key_row, KEYS)
    _fill_empty(out_row, taken, heavy, TILE, key_row, KEYS)
    return taken
