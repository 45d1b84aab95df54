"""Triton fused label scoring + heavy top-k: the twin of `label_topk.label_topk_torch`.

A selection step's top-`heavy` columns of each (row, source head) straight from the label cache: the
``[A, H, n]`` scores are never written. A row of at most `CHUNK` columns (of 4- and 8-bit labels, `SINGLE_CHUNK`) is
one chunk; a longer one is cut into chunks (`CHUNK`, more for rows longer than `MAX_CHUNKS` chunks; `chunk_size`); a
chunk's scores exist only in the registers of the program that computed them. Scores are compared as
order-preserving int32 *keys* (`key_search_triton`); a column outside the window, unselectable or scored non-finite
has no key (``INT32_MIN``, never counted).

The search for an exact r-th key is `key_search_triton._exact_threshold`.

* One chunk (``n <= chunk``): one launch of `_label_topk_sketch` with ``SINGLE``. Program (row, head)
  scores the row, searches its exact heavy-th key and writes the columns above it, then the first
  columns equal to it, ascending.
* Several chunks: two launches, each a program per (row-head, chunk).

  1. `_label_topk_sketch` scores its chunk and records a *sketch* of it: for ``LEVELS`` target ranks
     (`sketch_levels`: the chunk's share of `heavy` by columns, two multiples of it, and `heavy`) a key t with the
     exact number c of the chunk's keys >= t, ``r <= c <= r + r / 4`` (the search for all levels at once, stopped
     at that window), plus the chunk's count of keys and its largest and smallest key. It also writes
     the chunk's *list*: its keys >= the heavy level's key t (key and column packed in an int64, in
     column order; of the keys equal to t only the first ``heavy - (keys above t)``), at most
     ``heavy + heavy / 4`` entries. Every key of the chunk that can be among its row's top heavy is
     listed: t is at most the row's heavy-th key, since the chunk alone holds `heavy` keys >= t (a chunk
     of fewer keys lists them all).
  2. `_label_topk_select` first reads the sketches of its row-head (every program of the row-head
     computes the same from them): L, the largest sketch key with at least `heavy` keys of the row
     proven >= it (a lower bound of the heavy-th key; it is at least every chunk's heavy-level key, so
     every key >= L is listed), and per chunk an upper bound of its keys >= L (the count of a sketch
     key <= L; 0 when its largest key is below L). The exclusive prefix sum of those bounds gives each
     chunk a slot range of the row-head's candidate buffer: the buffer is in column order. The program
     copies its chunk's listed keys >= L (of the keys equal to L only as many as the row can still
     need) into its range and a sentinel into the rest; the last program of the row-head to finish (an
     atomic ticket, the others' writes released before it) searches the exact heavy-th key among the
     candidates (held in registers when they fit one tile, else read again from L2 at every step; the
     search's tail pivots, `key_search_triton`: the candidates are the row's upper tail) and writes the
     columns above it and the first columns equal to it, ascending.

Bytes: the labels are read once, the mask, if any, once per head (shared in L2); nothing of width n is
written. A chunk's code loads do not wait for its mask (the mask applies to the keys). The sketches are 64
bytes a chunk, the lists at most ``8 * (heavy + heavy / 4 + 1)`` bytes a chunk; the candidates of a
row-head are its keys >= L, a small multiple of heavy unless its top keys spread over many chunks
unevenly, in a slot range at most about twice that (the sketch's resolution below L; always at most
``chunks * (heavy + heavy / 4 + 1)``, the buffer's allocated size). Everything is sized on the host from
shapes only (no device read), so the launches are CUDA-graph capturable; the buffers need no clearing
(the first launch resets the tickets and writes each list's length).

The candidate kernels (refinement, `SharingConfig.candidates`) take a list of C columns per row-head instead:
`_label_candidates`, a program per row-head, holds its C keys in registers and writes its top `heavy` or walks
them (`_candidate_tail`). It scores them itself, or, where a program a row-head would leave half the SMs idle
(`split_scoring`: the top-k at B4 x 8 KV heads), reads them from a scratch row that `_label_candidate_scores`
wrote in a launch before it, `SCORE_TILE` candidates a program (the gathers of the label rows spread over the
SMs; the scratch is 4 bytes a slot, written and read once). A top-k's candidates lie in their row's window where
they lie in its column bounds (`critical_indices.in_window`): two scalars a program, no mask byte a candidate; a
walk's successors are tested on the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .key_search_triton import (COLUMNS32, SENTINEL, _exact_threshold, _fill_empty, _first_value, _key_stats,
                                _key_value, _pivot, _score_key, _top_columns, _write_columns)
from .gather_attention_triton import num_sms
from .labels_triton import _label_scores, kernel_label_inputs
from .successors_triton import COLUMN_BITS, _walk
from .critical_indices import NO_TOKEN, CriticalWindows, check_window
from .critical_indices_triton import _write_critical_row, critical_arguments, no_critical
from .dependent_launch import pdl_options, wait_for_previous_kernel
from .selection_heads import column_buffer

SINGLE_CHUNK = 8192  # the longest row of 4- or 8-bit labels one program scores and selects (one launch)
CHUNK = 4096  # columns per program of a longer row
MAX_CHUNKS = 64  # longer rows take longer chunks (the bound L compares every sketch key with every chunk's)
TAIL_TILE = 4096  # candidates per tile of the last program's search and writes, at least (`tail_tile`)
MAX_TAIL_TILE = 8192  # at most, but for the wide tile below
WIDE_TAIL_TILE = 16384  # the last program's tile for heavy above 2,048 over more than WIDE_TAIL_CHUNKS chunks
WIDE_TAIL_CHUNKS = 16
MAX_CANDIDATES = 16384  # candidate columns per (row, head) that `candidate_label_topk_triton` holds in registers
MAX_WALK_CANDIDATES = 8192  # the same for `candidate_label_walk_triton` (a register sort; wider ones: the twin)
SCORE_TILE = 256  # candidates a program of a split scoring launch scores (`split_scoring`)
# Registers: a launch whose grid has more programs than its SMs hold at once is capped at 128 registers a
# thread (a few spills), so that one more program shares an SM: a wave fewer, or latency hidden. Programs an SM
# holds uncapped, over 4-bit labels:
# - the candidate top-k at 2,048 candidate slots (4 warps): 3 (more registers a thread than the 128 of 4);
# - the candidate top-k and walk at 4,096 slots (8 warps): 1; capped, 2;
# - the label top-k (8 warps from chunks of 4,096, about 160-180 registers a thread): 1.
# The walk at 2,048 gained nothing capped; wider tiles are not measured. Over 16-bit labels the cap spills: none.
CANDIDATE_PROGRAMS_PER_SM = {(False, 2048): 3, (False, 4096): 1, (True, 4096): 1}  # (walk, slots): uncapped
LABEL_TOPK_PROGRAMS_PER_SM = 1
TOPK_REGISTER_CAP = 128
LEVELS = 4  # target ranks per chunk sketch
SKETCH = 16  # int32 fields per (row-head, chunk) sketch: LEVELS keys, LEVELS counts, count, max, min, list length


@triton.jit
def _chunk_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, mask_ptr,
                pid, i, row, head, cols, start, end,
                s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb, s_sh, s_zb, s_zh, s_mb,
                R: tl.constexpr, R_PAD: tl.constexpr, BITS: tl.constexpr, LOAD_BYTES: tl.constexpr,
                GROUP: tl.constexpr, PER_ROW_CHANNELS: tl.constexpr, FROM_QUERY: tl.constexpr, HAS_MASK: tl.constexpr):
    """Keys ``[CHUNK]`` int32 of columns `cols` of (row, head): INT32_MIN where a column is outside
    ``[start, end)``, unselectable or scored non-finite. Codes are read in LOAD_BYTES words (the
    codes pointer is a byte pointer; `s_cb`, `s_ch` in bytes, the column stride `s_cn` and the word stride
    `s_cw` in words: a column's words are contiguous, or, channel-major, each word's columns are); the dot
    is accumulated channel by channel. The query labels: ``[A * H', r]`` fp32 at `ql_ptr`, a load per
    channel, or (FROM_QUERY) gathered from the decode query ``[B, Hq, d]`` at the heavy channels
    ``[P, H_sel, r]`` (summed, in order, over the GROUP query heads). Gathered for 4-bit labels, they are
    loaded all ``[R_PAD]`` at once first (R_PAD: R's next power of two), so that the gathers, which wait for
    the channels, overlap the codes' loads instead of waiting channel by channel, and each channel's label is
    then taken from them by a reduction over R_PAD lanes; 8- and 16-bit labels (fewer channels a word: the
    reductions a larger share of the scoring) gather each channel's where it is used."""
    inside = (cols >= start) & (cols < end)
    # the codes' loads do not wait for the mask's: a column is read if it is inside [start, end), and the
    # mask applies to its key
    selectable = inside
    if HAS_MASK:
        selectable = inside & (tl.load(mask_ptr + i * s_mb + cols, mask=inside, other=0) != 0)
    LABELS_FIRST: tl.constexpr = FROM_QUERY and BITS == 4
    lanes = tl.arange(0, R_PAD)
    channels_row = channels_ptr + head * s_chh
    if PER_ROW_CHANNELS:
        channels_row += row * s_chp
    query_row = query_ptr + row * s_qb + (head * GROUP) * s_qh
    if LABELS_FIRST:
        channel = tl.load(channels_row + lanes, mask=lanes < R, other=0).to(tl.int64)
        labels = tl.load(query_row + channel, mask=lanes < R, other=0.0).to(tl.float32)
        for g in tl.static_range(1, GROUP):
            labels += tl.load(query_row + g * s_qh + channel, mask=lanes < R, other=0.0).to(tl.float32)
    if LOAD_BYTES == 4:
        words = (codes_ptr + row * s_cb + head * s_ch).to(tl.pointer_type(tl.int32))
    elif LOAD_BYTES == 2:
        words = (codes_ptr + row * s_cb + head * s_ch).to(tl.pointer_type(tl.int16))
    else:
        words = (codes_ptr + row * s_cb + head * s_ch).to(tl.pointer_type(tl.uint8))
    PER_WORD: tl.constexpr = LOAD_BYTES * 8 // BITS
    acc = tl.zeros(cols.shape, tl.float32)
    q_sum = tl.zeros((), tl.float32)
    for w in tl.static_range(R // PER_WORD):
        word = tl.load(words + cols * s_cn + w * s_cw, mask=inside, other=0).to(tl.int32)
        for j in tl.static_range(PER_WORD):
            # the channel's query label
            if LABELS_FIRST:
                q = tl.sum(tl.where(lanes == w * PER_WORD + j, labels, 0.0), 0)
            elif FROM_QUERY:  # the sum (in order) over the GROUP query heads of the decode query's heavy channel
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
    score = _label_scores(acc, q_sum, scale_ptr, zero_ptr, row, head, cols, inside, s_sb, s_sh, s_zb, s_zh, BITS)
    ok = selectable & (tl.abs(score) < float("inf"))  # NaN fails the comparison too
    return tl.where(ok, _score_key(score), -2147483648)


@triton.jit
def _keys_from(key, threshold, need, room):
    """The keys ``[N]`` above `threshold` and the first (in order) of those equal to it, `need` in all at most,
    packed in order into `room` slots: (taken ``[N]`` bool, slot ``[N]`` int32). INT32_MIN is no key."""
    above = key > threshold
    tie = (key == threshold) & (key != -2147483648)
    taken = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need - tl.sum(above.to(tl.int32), 0)))
    slot = tl.cumsum(taken.to(tl.int32), 0) - 1
    return taken & (slot < room), slot


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
def _row_head(rows_ptr, heads_ptr, pid, s_hb, HEADS: tl.constexpr, ROWS_INDEXED: tl.constexpr,
              HEADS_INDEXED: tl.constexpr):
    """Row-head `pid`'s entry i of the rows, its batch row and its head (int64): read from the rows ``[A]`` and
    heads ``[A or 1, H']`` index tensors, or (not indexed) every row and every head in order."""
    i = (pid // HEADS).to(tl.int64)
    row = i
    head = (pid % HEADS).to(tl.int64)
    if ROWS_INDEXED:
        row = tl.load(rows_ptr + i).to(tl.int64)
    if HEADS_INDEXED:
        head = tl.load(heads_ptr + i * s_hb + pid % HEADS).to(tl.int64)
    return i, row, head


@triton.jit
def _program_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, window_ptr,
                  mask_ptr, pid, chunk, n, s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb, s_sh, s_zb, s_zh, s_hb,
                  s_mb, HEADS: tl.constexpr, ROWS_INDEXED: tl.constexpr, HEADS_INDEXED: tl.constexpr, R: tl.constexpr,
                  R_PAD: tl.constexpr, BITS: tl.constexpr, LOAD_BYTES: tl.constexpr, GROUP: tl.constexpr,
                  PER_ROW_CHANNELS: tl.constexpr, FROM_QUERY: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_MASK: tl.constexpr, CHUNK_: tl.constexpr):
    """Row-head `pid`'s chunk `chunk`: its columns ``[CHUNK_]`` and their keys (`_chunk_keys`); a chunk
    outside the row's window loads nothing (every column masked) and has no key."""
    i, row, head = _row_head(rows_ptr, heads_ptr, pid, s_hb, HEADS, ROWS_INDEXED, HEADS_INDEXED)
    start, end = _window(window_ptr, i, n, HAS_WINDOW)
    cols = chunk * CHUNK_ + tl.arange(0, CHUNK_)
    key = _chunk_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, mask_ptr,
                      pid, i, row, head, cols, start, end,
                      s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb, s_sh, s_zb, s_zh, s_mb,
                      R, R_PAD, BITS, LOAD_BYTES, GROUP, PER_ROW_CHANNELS, FROM_QUERY, HAS_MASK)
    return cols, key


@triton.jit
def _label_topk_sketch(
    ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, window_ptr, mask_ptr,
    sketch_ptr, done_ptr, list_ptr, out_ptr, keys_ptr, n, heavy, list_cap, key_stride, r0, r1, r2, r3,
    s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb, s_sh, s_zb, s_zh, s_hb, s_mb,
    HEADS: tl.constexpr, ROWS_INDEXED: tl.constexpr, HEADS_INDEXED: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
    BITS: tl.constexpr, LOAD_BYTES: tl.constexpr, GROUP: tl.constexpr, PER_ROW_CHANNELS: tl.constexpr,
    FROM_QUERY: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
    SINGLE: tl.constexpr, CHUNK_: tl.constexpr, LEVELS_: tl.constexpr, SKETCH_: tl.constexpr, TILE: tl.constexpr,
    KEYS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Program (row-head pid, chunk): the chunk's sketch, or with SINGLE (one chunk) the row's columns (KEYS: and
    their keys, at the same slots of the row-head's row of `keys_ptr`, `key_stride` apart)."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    cols, key = _program_keys(ql_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr,
                              window_ptr, mask_ptr, pid, chunk, n, s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb,
                              s_sh, s_zb, s_zh, s_hb, s_mb, HEADS, ROWS_INDEXED, HEADS_INDEXED, R, R_PAD, BITS,
                              LOAD_BYTES, GROUP, PER_ROW_CHANNELS, FROM_QUERY, HAS_WINDOW, HAS_MASK, CHUNK_)
    if SINGLE:
        _top_columns(out_ptr + pid.to(tl.int64) * heavy, key, cols, heavy, TILE, keys_ptr + pid.to(tl.int64) * key_stride,
                     KEYS)
    else:
        if chunk == 0:
            tl.store(done_ptr + pid, 0)  # the second launch's ticket of this row-head
        levels = tl.arange(0, LEVELS_)
        lo = tl.full((LEVELS_,), -2147483648, tl.int64)
        count_lo = tl.zeros((LEVELS_,), tl.int32)
        count, smallest, largest, mean, std = _key_stats(key, key != -2147483648)
        if count > 0:
            # per level: a key whose count of keys at or above is within [r, r + r/4], by the
            # search of `_exact_threshold` over all levels at once, stopped at the window
            r = tl.minimum(_level_targets(r0, r1, r2, r3, LEVELS_), count)
            slack = r >> 2
            aim = (r + (slack >> 1)).to(tl.float32)
            first = _first_value(mean, std, count, aim)
            total = count.to(tl.float32)
            lo = tl.zeros((LEVELS_,), tl.int64) + smallest
            count_lo = tl.zeros((LEVELS_,), tl.int32) + count
            hi = tl.zeros((LEVELS_,), tl.int64) + largest + 1
            count_hi = tl.zeros((LEVELS_,), tl.int32)
            active = (count_lo > r + slack) & (hi - lo > 1)
            step = tl.zeros((), tl.int32)
            while tl.max(active.to(tl.int32), 0) > 0:
                pivot = _pivot(lo, tl.where(active, hi, lo + 2), count_lo, count_hi, aim, total, first, step,
                               step % 3 == 2)
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
        # the chunk's list: its keys >= the heavy level's key t (the last level), packed with their columns in
        # column order, of the keys equal to t only the first heavy - (keys above t): every key of the chunk
        # that can be among the row's top heavy, at most heavy + heavy / 4 of them (the level's window)
        chunk_key = tl.sum(tl.where(levels == LEVELS_ - 1, lo, 0), 0)
        keep, slot = _keys_from(key, chunk_key, heavy, list_cap)  # never beyond the list (the window bounds it)
        listed = pid.to(tl.int64) * tl.num_programs(1) + chunk
        tl.store(list_ptr + listed * list_cap + slot, (key.to(tl.int64) << 32) | cols.to(tl.int64), mask=keep)
        record = sketch_ptr + listed * SKETCH_
        tl.store(record + levels, lo.to(tl.int32))
        tl.store(record + LEVELS_ + levels, count_lo)
        tl.store(record + 2 * LEVELS_, count)
        tl.store(record + 2 * LEVELS_ + 1, largest)
        tl.store(record + 2 * LEVELS_ + 2, smallest)
        tl.store(record + 2 * LEVELS_ + 3, tl.sum(keep.to(tl.int32), 0))


@triton.jit
def _candidate_columns(rows_ptr, heads_ptr, cand_ptr, pid, slots, candidates, s_hb, s_ka, s_kh, HEADS: tl.constexpr,
                       ROWS_INDEXED: tl.constexpr, HEADS_INDEXED: tl.constexpr, BY_HEAD: tl.constexpr):
    """Row-head `pid` of a candidate launch: its entry i of the rows, batch row and head (`_row_head`), its entry of
    the candidates and output (BY_HEAD: its head's, else its position among the row's heads), and its candidates'
    columns at `slots` (int32; -1 from `candidates` on)."""
    i, row, head = _row_head(rows_ptr, heads_ptr, pid, s_hb, HEADS, ROWS_INDEXED, HEADS_INDEXED)
    entry = head if BY_HEAD else (pid % HEADS).to(tl.int64)
    cols = tl.load(cand_ptr + i * s_ka + entry * s_kh + slots, mask=slots < candidates, other=-1).to(tl.int32)
    return i, row, head, entry, cols


@triton.jit
def _candidate_tail(out_row, best_row, window_row, cols, key, n, heavy, top, C_PAD: tl.constexpr, TILE: tl.constexpr,
                    WALK: tl.constexpr, ASCENDING: tl.constexpr, index_row, INDEX_ROW: tl.constexpr):
    """One row-head's candidates ``[C_PAD]`` (columns, int32 keys; INT32_MIN: none) into its output: the columns of
    its top `heavy` in candidate order at `out_row` (INDEX_ROW: also as int32 at `index_row`, then NO_TOKEN), or
    (WALK) all of them walked with their successors there and their best `top` at `best_row`
    (`successors_triton._walk`; `window_row`: the row's selectable columns). Returns the top-k's columns written
    (0 for a walk)."""
    taken = tl.zeros((), tl.int32)
    if WALK:
        _walk(out_row, best_row, cols.to(tl.int64), key, key != -2147483648, window_row, n, heavy, top, C_PAD,
              ASCENDING)
    else:
        taken = _top_columns(out_row, key, cols, heavy, TILE, index_row, COLUMNS32 if INDEX_ROW else False)
    return taken


@triton.jit
def _spread_row(entries, head, slot_row, slot, width, s_oh, H_SEL: tl.constexpr, C_PAD: tl.constexpr):
    """Selection head `head`'s row ``entries + head * s_oh`` ``[width]``, written before a barrier, copied to the
    entries of every other selection head h whose source slot (`slot_row` ``[H_SEL]``) is `slot`: the heads that
    copy the row-head's selection (`selection_heads.per_head`, written by the selection's own program)."""
    c = tl.arange(0, C_PAD)
    row = tl.load(entries + head * s_oh + c, mask=c < width)
    for h in range(H_SEL):
        if (tl.load(slot_row + h) == slot) & (h != head):
            tl.store(entries + h * s_oh + c, row, mask=c < width)


@triton.jit
def _label_candidates(
    query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, window_ptr, mask_ptr, cand_ptr,
    out_ptr, best_ptr, scratch_ptr, slot_ptr, s_slot, n, heavy, candidates, top,
    s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb, s_sh, s_zb, s_zh, s_hb, s_mb, s_ka, s_kh, s_oa, s_oh,
    c_sink_ptr, c_local_ptr, c_dense_ptr, c_middle_ptr, c_short_ptr, c_out_ptr, c_count_ptr,
    c_sb, c_lb, c_db, c_mb, c_ob, c_oh,
    HEADS: tl.constexpr, ROWS_INDEXED: tl.constexpr, HEADS_INDEXED: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
    BITS: tl.constexpr, LOAD_BYTES: tl.constexpr, GROUP: tl.constexpr, PER_ROW_CHANNELS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
    C_PAD: tl.constexpr, TILE: tl.constexpr, WALK: tl.constexpr, ASCENDING: tl.constexpr, BY_HEAD: tl.constexpr,
    C_SINK: tl.constexpr, C_HEAVY: tl.constexpr, C_LOCAL: tl.constexpr, C_SINK_P: tl.constexpr,
    C_HEAVY_P: tl.constexpr, C_LOCAL_P: tl.constexpr, C_COUNT: tl.constexpr, CRITICAL: tl.constexpr,
    SCORED: tl.constexpr = False, SPREAD: tl.constexpr = False, H_SEL: tl.constexpr = 1,
    CRITICAL_DIRECT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Program (row-head pid): the row-head's candidates' keys (a negative column, one outside the row's window
    ``[start, end)`` at `window_ptr` or the mask, or scored non-finite has none), then its top `heavy` columns in
    candidate order, or (WALK, with the mask: the window) all of them walked with their successors, and their best
    `top` (`successors_triton._walk`;
    `heavy` = candidates; ASCENDING: the candidates are ascending, then negative, so not sorted into column
    order). BY_HEAD: the candidates and the output are every selection head's, and the program reads and writes
    its own head's entry (else its position among the row's heads). SCORED: the keys are the row-head's row of
    the scratch ``[A * H', C_PAD]`` int32 (`_label_candidate_scores`, or `candidate_keys_triton`'s), not scored
    here. CRITICAL (the top-k of every row, not ROWS_INDEXED): then also the row-head's critical indices from the
    columns it wrote (`critical_indices_triton._write_critical_row`, the ``c_`` operands); CRITICAL_DIRECT (the window
    is the critical indices' middle window, so every chosen column is in it): their heavy part written with the
    columns, from registers, not read back. SPREAD (a walk of candidates read by position, HEADS_INDEXED): the output
    ``[A, H_SEL, C]`` and the best ``[A, H_SEL, top]`` (contiguous) are every selection head's; the program writes
    its head's entries, and copies both to the entries of every head whose slot among the row's source heads
    (``slot_ptr`` ``[P, H_SEL]``, row stride `s_slot`, 0 for one plan of every row) is its position: the source head
    ``heads[j]`` is its own slot j."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    slots = tl.arange(0, C_PAD)
    i, row, head, entry, cols = _candidate_columns(rows_ptr, heads_ptr, cand_ptr, pid, slots, candidates, s_hb, s_ka,
                                                   s_kh, HEADS, ROWS_INDEXED, HEADS_INDEXED, BY_HEAD)
    if SCORED:
        key = tl.load(scratch_ptr + pid.to(tl.int64) * C_PAD + slots, mask=slots < candidates, other=-2147483648)
    else:
        start, end = _window(window_ptr, i, n, HAS_WINDOW)
        key = _chunk_keys(query_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, mask_ptr,
                          pid, i, row, head, cols, start, end,
                          s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb, s_sh, s_zb, s_zh, s_mb,
                          R, R_PAD, BITS, LOAD_BYTES, GROUP, PER_ROW_CHANNELS, True, HAS_MASK)
    if SPREAD:
        out_row = out_ptr + i * s_oa + head * s_oh
        best_row = best_ptr + (i * H_SEL + head) * top
    else:
        out_row = out_ptr + i * s_oa + entry * s_oh
        best_row = best_ptr + pid.to(tl.int64) * top
    critical_row = c_out_ptr + row * c_ob + entry * c_oh
    taken = _candidate_tail(out_row, best_row, mask_ptr + i * s_mb, cols, key, n, heavy, top, C_PAD, TILE, WALK,
                            ASCENDING, critical_row + C_SINK, CRITICAL_DIRECT)
    if SPREAD:
        tl.debug_barrier()  # the rows, written by any of the program's threads, read back by all
        _spread_row(out_ptr + i * s_oa, head, slot_ptr + i * s_slot, pid % HEADS, heavy, s_oh, H_SEL, C_PAD)
        _spread_row(best_ptr + i * H_SEL * top, head, slot_ptr + i * s_slot, pid % HEADS, top, top, H_SEL, C_PAD)
    if CRITICAL:
        tl.debug_barrier()  # the row's columns, written by any of the program's threads, read back by all
        _write_critical_row(out_row, row, entry, c_sink_ptr, c_local_ptr, c_dense_ptr, c_middle_ptr, c_short_ptr,
                            c_out_ptr, c_count_ptr, c_sb, c_lb, c_db, c_mb, c_ob, c_oh, C_SINK, C_HEAVY, C_LOCAL,
                            C_SINK_P, C_HEAVY_P, C_LOCAL_P, C_COUNT, taken, CRITICAL_DIRECT)


@triton.jit
def _label_candidate_scores(
    query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, rows_ptr, heads_ptr, window_ptr, mask_ptr, cand_ptr,
    scratch_ptr, n, candidates,
    s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb, s_sh, s_zb, s_zh, s_hb, s_mb, s_ka, s_kh,
    HEADS: tl.constexpr, ROWS_INDEXED: tl.constexpr, HEADS_INDEXED: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
    BITS: tl.constexpr, LOAD_BYTES: tl.constexpr, GROUP: tl.constexpr, PER_ROW_CHANNELS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, C_PAD: tl.constexpr, SCORE_TILE_: tl.constexpr,
    BY_HEAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (row-head pid, tile): the keys of its tile of `SCORE_TILE_` candidates into the row-head's row of the
    scratch ``[A * H', C_PAD]`` int32 (INT32_MIN: a negative column, one outside the window or the mask or scored
    non-finite);
    `_label_candidates` with SCORED then takes each row-head's top `heavy` or walk from them."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    slots = tl.program_id(1) * SCORE_TILE_ + tl.arange(0, SCORE_TILE_)
    i, row, head, _, cols = _candidate_columns(rows_ptr, heads_ptr, cand_ptr, pid, slots, candidates, s_hb, s_ka, s_kh,
                                               HEADS, ROWS_INDEXED, HEADS_INDEXED, BY_HEAD)
    start, end = _window(window_ptr, i, n, HAS_WINDOW)
    key = _chunk_keys(query_ptr, query_ptr, channels_ptr, codes_ptr, scale_ptr, zero_ptr, mask_ptr,
                      pid, i, row, head, cols, start, end,
                      s_qb, s_qh, s_chp, s_chh, s_cb, s_ch, s_cn, s_cw, s_sb, s_sh, s_zb, s_zh, s_mb,
                      R, R_PAD, BITS, LOAD_BYTES, GROUP, PER_ROW_CHANNELS, True, HAS_MASK)
    tl.store(scratch_ptr + pid.to(tl.int64) * C_PAD + slots, key, mask=slots < candidates)


@triton.jit
def _label_topk_select(
    sketch_ptr, done_ptr, list_ptr, cand_ptr, out_ptr, keys_ptr, heavy, chunk_cap, cand_stride, key_stride,
    CHUNKS_PAD: tl.constexpr, LEVELS_: tl.constexpr, SKETCH_: tl.constexpr, TILE: tl.constexpr,
    LIST_PAD: tl.constexpr, KEYS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Program (row-head pid, chunk): the chunk's candidates (from its list); the row-head's last program, its
    columns (KEYS: and their keys, as `_label_topk_sketch`)."""
    wait_for_previous_kernel(PDL)
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
    # (per candidate value v and chunk: the count of its smallest recorded key >= v; a level at a time, so that
    # the largest tensor is [CHUNKS_PAD * LEVELS, CHUNKS_PAD])
    values = tl.reshape(lo, (CHUNKS_PAD * LEVELS_,))
    proven = tl.where(smallest[None, :] >= values[:, None], count[None, :], 0)
    for level in tl.static_range(LEVELS_):
        level_key = tl.load(records + level, mask=real, other=-2147483648)
        level_count = tl.load(records + LEVELS_ + level, mask=real, other=0)
        proven = tl.maximum(proven, tl.where(level_key[None, :] >= values[:, None], level_count[None, :], 0))
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

    if my_upper > 0:  # this chunk has keys >= L: its listed ones, written in column order
        listed = pid.to(tl.int64) * chunks + chunk
        entries = tl.arange(0, LIST_PAD)
        length = tl.load(sketch_ptr + listed * SKETCH_ + 2 * LEVELS_ + 3)
        packed = tl.load(list_ptr + listed * chunk_cap + entries, mask=entries < length, other=SENTINEL)
        key = (packed >> 32).to(tl.int32)  # SENTINEL: INT32_MIN, below every L
        # of the keys equal to L the row needs at most need - (its keys above L) <= need - (ours above L); never
        # outside the range (a bound the sketch proves)
        keep, slot = _keys_from(key, bound, need, my_upper)
        tl.store(buf + my_offset + slot, packed, mask=keep)
        written = tl.sum(keep.to(tl.int32), 0)
        tl.store(buf + my_offset + entries, tl.full((LIST_PAD,), SENTINEL, tl.int64),
                 mask=(entries >= written) & (entries < my_upper))

    tl.debug_barrier()  # every thread's writes before the ticket (released by it)
    ticket = tl.atomic_add(done_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if ticket == chunks - 1:  # the row-head's last program: its columns from the candidates
        out_row = out_ptr + pid.to(tl.int64) * heavy
        key_row = keys_ptr + pid.to(tl.int64) * key_stride
        taken = tl.zeros((), tl.int32)
        if need > 0:
            if span <= TILE:  # one tile: held in registers for the search and the writes
                slots = tl.arange(0, TILE)
                packed = tl.load(buf + slots, mask=slots < span, other=SENTINEL, cache_modifier=".cg")
                taken = _select_candidates(out_row, packed, buf, span, bound, need, False, TILE, key_row, KEYS)
            else:  # several tiles: every pass reads them again (from L2)
                taken = _select_candidates(out_row, tl.zeros((TILE,), tl.int64), buf, span, bound, need, True, TILE,
                                           key_row, KEYS)
        _fill_empty(out_row, taken, heavy, TILE, key_row, KEYS)


@triton.jit
def _select_candidates(out_row, packed, buf_ptr, span, bound, need, FROM_BUFFER: tl.constexpr, TILE: tl.constexpr,
                       key_row, KEYS: tl.constexpr):
    """The exact top-`need` of the packed candidates (all >= `bound`; SENTINEL: an empty slot), held
    in `packed` ``[TILE]`` or (FROM_BUFFER) in ``buf[0:span)``: their columns written ascending (the
    candidates are in column order; KEYS: their keys at the same slots of `key_row`). Returns how many were
    written."""
    if FROM_BUFFER:  # the candidates' count, largest key and score moments about L, a tile at a time
        shift = _key_value(bound)
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
        count = tl.sum(present, 0)
        largest = tl.max(high, 0)
        centered_mean = tl.sum(moment1, 0) / tl.maximum(count, 1).to(tl.float32)
        std = tl.sqrt(tl.maximum(tl.sum(moment2, 0) / tl.maximum(count, 1).to(tl.float32)
                                 - centered_mean * centered_mean, 0.0))
        mean = shift + centered_mean
        key = high  # a placeholder: the search reads the buffer
    else:  # held in registers: one reduction (`_key_stats`)
        key = (packed >> 32).to(tl.int32)
        count, _, largest, mean, std = _key_stats(key, packed != SENTINEL)
    r = tl.minimum(need, count)  # == need: the sketch proves need keys >= L
    taken = tl.zeros((), tl.int32)
    if r > 0:
        # the candidates are the keys at or above L, an upper tail: the tail pivots
        threshold, ties, _ = _exact_threshold(key, 1, buf_ptr, span, r, bound, count, largest.to(tl.int64) + 1,
                                              _first_value(mean, std, count, r - 0.5), FROM_BUFFER, TILE, True)
        if FROM_BUFFER:
            tie_base = tl.zeros((), tl.int32)
            for t in range(0, span, TILE):
                slots = t + tl.arange(0, TILE)
                tile = tl.load(buf_ptr + slots, mask=slots < span, other=SENTINEL, cache_modifier=".cg")
                taken, tie_base = _write_columns(out_row, (tile >> 32).to(tl.int32), (tile & 0xFFFFFFFF).to(tl.int32),
                                                 threshold, ties, taken, tie_base, key_row, KEYS)
        else:
            taken, _ = _write_columns(out_row, key, (packed & 0xFFFFFFFF).to(tl.int32), threshold, ties, 0, 0, key_row,
                                      KEYS)
    return taken


def _code_words(codes: torch.Tensor, bits: int, channels: int) -> tuple[int, int, int]:
    """How the kernels read the codes ``[B, H, n, .]``: the word width in bytes (4, 2 or 1) and the column and
    word strides in words. Codes contiguous in the channel dimension: the widest word that every column's codes
    start on and divide into, its words adjacent. 16-bit labels channel-major (columns contiguous per channel,
    ``stride(-2) == 1``): one channel a 2-byte word, each word's columns adjacent (coalesced reads)."""
    itemsize = codes.element_size()
    if bits == 16 and codes.stride(-1) != 1 and codes.stride(-2) == 1:
        if codes.data_ptr() % 2 or any(s * itemsize % 2 for s in codes.stride()):
            raise ValueError("16-bit label codes are not 2-byte aligned")
        return 2, 1, codes.stride(-1)
    if codes.stride(-1) != 1:
        raise ValueError("label codes must be contiguous in the channel dimension (or, 16-bit, in the column "
                         "dimension)")
    row_bytes = channels * bits // 8
    for width in (4, 2, 1):
        if width * 8 < bits:
            continue
        if (row_bytes % width == 0 and codes.data_ptr() % width == 0
                and all(s * itemsize % width == 0 for s in codes.stride()[:-1])):
            return width, codes.stride(-2) * itemsize // width, 1
    raise ValueError("16-bit label codes are not 2-byte aligned")


def sketch_levels(heavy: int, n: int, size: int) -> list[int]:
    """The LEVELS target ranks of a chunk's sketch (ascending, capped at heavy), for a row of `n` columns in chunks of
    `size`: its share of the row's heavy tokens by columns ``s = ceil(heavy * size / n)``, 2 s, 8 s and `heavy`; where
    8 s would be `heavy` again (8 chunks' worth of columns or fewer) s, 1.25 s, 2 s and `heavy`, so that the bound L
    lies closer to the heavy-th key where the top keys spread over the chunks. By columns, not chunks: a last chunk of
    a few columns (a 32k prompt's cache and its new tokens: 8 chunks and a few columns) holds no share of the top keys,
    and counting it as a chunk would lower every other chunk's levels and double the candidates the bound admits."""
    share = max(1, -(-heavy * size // n))
    if 8 * share >= heavy:
        return [min(share, heavy), min(share + share // 4, heavy), min(2 * share, heavy), heavy]
    return [min(share, heavy), min(2 * share, heavy), min(8 * share, heavy), heavy]


def index_operands(rows: torch.Tensor | None, heads: torch.Tensor | None, selectable: torch.Tensor | None,
                   count: int, placeholder: torch.Tensor) -> tuple:
    """The row, head and mask operands of a launch over `count` rows, laid out for the kernels: ``(rows, heads
    [A, H'], mask uint8, heads' row stride, mask's row stride, index flags)``; an absent one (rows or heads None:
    every row or head in order; no mask) is `placeholder`, a tensor the kernels never read, with stride 0."""
    flags = dict(ROWS_INDEXED=rows is not None, HEADS_INDEXED=heads is not None)
    if heads is not None:
        heads = heads.expand(count, heads.shape[-1])
        heads = heads if heads.stride(-1) == 1 else heads.contiguous()  # any integer dtype; a shared row: stride 0
    if rows is not None and not rows.is_contiguous():
        rows = rows.contiguous()
    mask = None
    if selectable is not None:
        mask = selectable.view(torch.uint8) if selectable.dtype == torch.bool else selectable.to(torch.uint8)
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    return (placeholder if rows is None else rows, placeholder if heads is None else heads,
            placeholder if mask is None else mask, 0 if heads is None else heads.stride(0),
            0 if mask is None else mask.stride(0), flags)


def window_operand(window: torch.Tensor | None, count: int, placeholder: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A launch's row windows ``[A, 2]`` (column bounds ``[start, end)``, checked), laid out for `_window`: ``(window
    or `placeholder`, whether given)``."""
    check_window(window, count)
    if window is None:
        return placeholder, False
    return (window if window.is_contiguous() else window.contiguous()), True


def _operands(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
              zero: torch.Tensor | None, bits: int, r: int, rows: torch.Tensor | None, heads: torch.Tensor | None,
              selectable: torch.Tensor | None, count: int) -> tuple:
    """What the kernels read for `count` rows, laid out for them: ``(code bytes, scale, zero, rows, heads [A, H'], mask,
    load bytes, strides, index flags)``; the placeholders of absent operands (rows or heads None: every row or
    head in order) are tensors the kernels never read."""
    if bits == 4 and r % 2:
        raise ValueError(f"label_channels {r} is odd; 4-bit labels hold two channels a byte")
    load_bytes, column_words, word_words = _code_words(codes, bits, r)
    # a byte view (the kernels' pointer; their strides are computed from `codes`)
    code_bytes = (codes if codes.stride(-1) == 1 else codes.transpose(-1, -2)).view(torch.uint8)
    rows, heads, mask, s_hb, s_mb, flags = index_operands(rows, heads, selectable, count, codes)
    scale = scale if scale is not None else codes  # 16-bit labels: the codes' dtype tells bf16 from fp16
    zero = zero if zero is not None else codes
    strides = (query.stride(0), query.stride(1), channels.stride(0), channels.stride(1),
               codes.stride(0) * codes.element_size(), codes.stride(1) * codes.element_size(), column_words, word_words,
               scale.stride(0), scale.stride(1), zero.stride(0), zero.stride(1), s_hb, s_mb)
    return code_bytes, scale, zero, rows, heads, mask, load_bytes, strides, flags


def candidate_label_topk_triton(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                                scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int, heavy: int,
                                candidates: torch.Tensor, rows: torch.Tensor | None, heads: torch.Tensor | None,
                                window: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                                tile: int | None = None, num_warps: int | None = None,
                                max_registers: int | None = None, score_tile: int | None = None,
                                critical: CriticalWindows | None = None
                                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `label_topk.candidate_label_topk` (``[A, H', heavy]`` int64, the chosen candidates'
    columns in candidate order, then NO_TOKEN; with `out`, each head's entries of every selection head's
    candidates read and of `out` written; with `critical`, also their int32 critical indices, written by the same
    programs), for rows ``[A]`` and heads ``[A or 1, H']`` index tensors (None: all, in order): a program per
    (row, head) holding its ``C <= MAX_CANDIDATES`` candidates' keys in registers, scored there or, at few
    row-heads (`split_scoring`), in a launch before it of `score_tile` candidates a program.
    `tile`, `num_warps`, `max_registers` (a thread's register cap; 0: none) and `score_tile` (0: no scoring launch)
    override the launches (tests, benchmark sweeps)."""
    columns, _, indices = _candidates(query, channels, codes, scale, zero, bits, heavy, candidates, rows, heads,
                                      None, False, tile, num_warps, out=out, max_registers=max_registers,
                                      score_tile=score_tile, critical=critical, window=window)
    return columns if critical is None else (columns, indices)


def candidate_label_walk_triton(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor,
                                scale: torch.Tensor | None, zero: torch.Tensor | None, bits: int,
                                candidates: torch.Tensor, rows: torch.Tensor | None, heads: torch.Tensor | None,
                                selectable: torch.Tensor, top: int = 0, *, ascending: bool = False,
                                num_warps: int | None = None, max_registers: int | None = None,
                                score_tile: int | None = None, keys: torch.Tensor | None = None,
                                head_slot: torch.Tensor | None = None,
                                out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `label_topk.candidate_label_walk` (``[A, H', C]`` int64: the walk's columns ascending, then
    NO_TOKEN; ``[A, H', top]``: the best `top` allowed candidates ascending, then NO_TOKEN), for rows ``[A]`` and heads
    ``[A or 1, H']`` index tensors: a program per (row, head) walking its ``C <= MAX_WALK_CANDIDATES`` candidates in
    registers, scored there or in a launch before it (as `candidate_label_topk_triton`), or, given their `keys`
    (int32 ``[A * H', candidate_slots(C)]``: the candidates' order-preserving score keys by slot, INT32_MIN for none,
    as `label_topk_triton` writes them), not scored at all. With `head_slot` ``[P, H_sel]`` (source heads `heads`):
    every selection head's ``[A, H_sel, ...]``, each its source's (`selection_heads.per_head`), written by the walk's
    programs. The results are written into `out` where its tensors have their shapes and are contiguous int64.
    `num_warps`, `max_registers` and `score_tile` override the launches."""
    if codes.shape[2] >= (1 << COLUMN_BITS) - 1:
        raise ValueError(f"{codes.shape[2]} columns; accepted: fewer than {(1 << COLUMN_BITS) - 1} (the torch twin "
                         "takes more)")
    return _candidates(query, channels, codes, scale, zero, bits, candidates.shape[-1], candidates, rows, heads,
                       selectable, True, None, num_warps, ascending, top, max_registers=max_registers,
                       score_tile=score_tile, keys=keys, head_slot=head_slot, walk_out=out)[:2]


def selection_walk_triton(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                          zero: torch.Tensor | None, bits: int, count: int, rows: torch.Tensor | None,
                          heads: torch.Tensor | None, selectable: torch.Tensor, top: int = 0,
                          head_slot: torch.Tensor | None = None,
                          out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `label_topk.decode_label_topk_walk` (``count <= MAX_WALK_CANDIDATES``): `label_topk_triton`
    of `count` columns writing their keys, then `candidate_label_walk_triton` reading them (no label row scored
    twice; with `head_slot`, the walk's programs write every selection head's entries)."""
    rows_count, n_heads = _selection_shape(None, query, channels, rows, heads)
    keys = torch.empty(rows_count * n_heads, candidate_slots(count), dtype=torch.int32, device=codes.device)
    columns = label_topk_triton(None, codes, scale, zero, bits, count, rows, heads, None, selectable, query=query,
                                channels=channels, keys=keys)
    return candidate_label_walk_triton(query, channels, codes, scale, zero, bits, columns, rows, heads, selectable,
                                       top, ascending=True, keys=keys, head_slot=head_slot, out=out)


def _same_view(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether `a` reads the very elements of `b` (one storage, offset, shape and strides): the same values."""
    return (a is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _launch_options(max_registers: int | None, codes: torch.Tensor) -> dict:
    """A launch's options: a thread's register cap (``maxnreg``) where one is set (0 or None: none), on CUDA only
    (the interpreter takes no launch options)."""
    return {"maxnreg": max_registers} if max_registers and codes.is_cuda else {}


def register_cap(per_sm: int | None, bits: int, programs: int, sms: int) -> int | None:
    """`TOPK_REGISTER_CAP` for a launch of `programs` programs over `bits`-bit labels where they exceed what
    `sms` SMs hold uncapped (`per_sm` programs an SM; None: the cap was not measured to pay), else None."""
    return TOPK_REGISTER_CAP if bits == 4 and per_sm is not None and programs > per_sm * sms else None


def candidate_register_cap(walk: bool, slots: int, bits: int, programs: int, sms: int) -> int | None:
    """The register cap of a candidate launch of `programs` programs of `slots` candidate slots on `sms` SMs
    at its default warps (`register_cap` with `CANDIDATE_PROGRAMS_PER_SM`)."""
    return register_cap(CANDIDATE_PROGRAMS_PER_SM.get((walk, slots)), bits, programs, sms)


def candidate_slots(width: int) -> int:
    """Slots of a row-head's candidate row in the candidate kernels' registers and scratch: `width`'s next power of
    two, at least 16."""
    return max(16, triton.next_power_of_2(width))


def chunk_size(n: int, bits: int) -> int:
    """Columns a program of the label top-k scores, for rows of `n` columns of `bits`-bit labels: the whole row (a
    power of two, at least 16), one launch, up to `CHUNK` columns, over 4- and 8-bit labels up to `SINGLE_CHUNK`;
    beyond, `CHUNK` (more where the row would take over `MAX_CHUNKS`). So a 4k prompt's cache (a little past 4,096
    columns) is one program of 16 warps instead of two chunks and the select's launch; an 8k prompt's stays in
    chunks (these limits' evidence: `benchmarks/RESULTS.md`, "Defaults chosen from these measurements")."""
    if n <= (CHUNK if bits == 16 else SINGLE_CHUNK):
        return max(16, triton.next_power_of_2(n))
    return max(CHUNK, triton.next_power_of_2(triton.cdiv(n, MAX_CHUNKS)))


def tail_tile(heavy: int, chunks: int) -> int:
    """Candidates a tile of a label top-k's last program holds, for `heavy` over `chunks` chunks: twice `heavy` (its
    candidates, the keys >= the bound L, number from heavy to about twice as many), at least `TAIL_TILE` and at most
    `MAX_TAIL_TILE`; `WIDE_TAIL_TILE` for heavy above 2,048 over more than `WIDE_TAIL_CHUNKS` chunks (a 128k row:
    the coarse sketch levels leave more than `MAX_TAIL_TILE` candidates). Where they fit one tile its search and
    writes run in registers, else every pass reads the tiles again (from L2)."""
    if heavy > 2048 and chunks > WIDE_TAIL_CHUNKS:
        return WIDE_TAIL_TILE
    return min(MAX_TAIL_TILE, max(TAIL_TILE, triton.next_power_of_2(2 * heavy)))


def select_warps(tile: int) -> int | None:
    """Warps of a label top-k's select launch whose last program holds `tile` candidates: 16 for a tile of
    `WIDE_TAIL_TILE` (8 warps spill it), else None (the sketch's warps)."""
    return 16 if tile >= WIDE_TAIL_TILE else None


def split_scoring(programs: int, sms: int, walk: bool = False) -> bool:
    """Whether a candidate launch of `programs` row-heads scores its candidates in a launch of its own
    (`_label_candidate_scores`, `SCORE_TILE` candidates a program) before its top-k or walk, so that the scoring's
    gathers spread over the `sms` SMs: the top-k where a program a row-head would leave at least half of them idle,
    the walk (a longer tail after the scoring, which the second launch adds to) where it would use an eighth or
    fewer."""
    return (8 if walk else 2) * programs <= sms


def _candidates(query: torch.Tensor, channels: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                zero: torch.Tensor | None, bits: int, heavy: int, candidates: torch.Tensor, rows: torch.Tensor | None,
                heads: torch.Tensor | None, selectable: torch.Tensor | None, walk: bool, tile: int | None,
                num_warps: int | None, ascending: bool = False, top: int = 0, out: torch.Tensor | None = None,
                max_registers: int | None = None, score_tile: int | None = None, keys: torch.Tensor | None = None,
                critical: CriticalWindows | None = None, head_slot: torch.Tensor | None = None,
                walk_out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                window: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A launch of `_label_candidates` (after one of `_label_candidate_scores` where the scoring is split:
    `score_tile` candidates a scoring program; None: `SCORE_TILE` where `split_scoring` says so, else 0, scored
    in the top-k's program; given the candidates' `keys` ``[A * H', C_PAD]``, none): ``[A, H', heavy]`` int64 (or,
    in place, the heads' entries of `out` ``[A, H_sel, heavy]`` from every selection head's candidates
    ``[A, H_sel, C]``), (`walk`) the best `top` candidates, and (`critical`) the critical indices
    ``[A, H, N_c]`` int32 of the columns (every row and head: `label_topk.candidate_label_topk` checks it). A walk
    of source heads `heads` with their `head_slot` ``[P, H_sel]`` (`selection_heads.per_head`) returns every
    selection head's walk and best ``[A, H_sel, ...]``, written by the walk's programs (SPREAD). A walk writes its
    two results into `walk_out` where given contiguous int64 tensors of their shapes. The candidates' window: the
    top-k's, column bounds `window` ``[A, 2]``; the walk's, the mask `selectable` ``[A, n]`` (its successors')."""
    count, width = candidates.shape[0], candidates.shape[-1]
    by_head = out is not None
    if head_slot is not None and (not walk or heads is None or by_head):
        raise ValueError("head_slot is accepted for a walk of some source heads (`heads` given), without `out`")
    n_heads = heads.shape[-1] if by_head or head_slot is not None else candidates.shape[1]
    if by_head and (out.shape != (count, candidates.shape[1], heavy) or out.dtype != torch.int64 or walk):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}; accepted: int64 {(count, candidates.shape[1], heavy)} "
                         "(every selection head's entries), for the candidate top-k")
    if not by_head:  # with head slots, every selection head's entries, each its source's
        entries = n_heads if head_slot is None else head_slot.shape[-1]
        shapes = ((count, entries, heavy), (count, entries, top))
        out, best = (column_buffer(given if walk else None, shape, codes.device)
                     for given, shape in zip(walk_out, shapes))
    else:
        best = torch.empty(count, n_heads, top, dtype=torch.int64, device=codes.device)
    if heavy == 0 or count * n_heads == 0:
        return (out if by_head else out.fill_(NO_TOKEN)), best.fill_(NO_TOKEN), (
            None if critical is None else critical.indices(out))
    limit = MAX_WALK_CANDIDATES if walk else MAX_CANDIDATES
    if width > limit:
        raise ValueError(f"{width} candidates per head; accepted: at most {limit} (the torch twin takes more)")
    if score_tile and score_tile & (score_tile - 1):
        raise ValueError(f"score_tile {score_tile}; accepted: 0 (no scoring launch) or a power of two")
    _, query, channels, r, group, _ = kernel_label_inputs(None, query, channels)
    code_bytes, scale_t, zero_t, rows, heads, mask_t, load_bytes, strides, flags = _operands(
        query, channels, codes, scale, zero, bits, r, rows, heads, selectable, count)
    window_t, has_window = window_operand(window, count, codes)
    candidates = candidates if candidates.stride(-1) == 1 else candidates.contiguous()
    programs = count * n_heads
    pad = candidate_slots(width)
    if score_tile is None:
        score_tile = SCORE_TILE if codes.is_cuda and split_scoring(programs, num_sms(codes.device), walk) else 0
    score_tile = min(score_tile, pad)
    labels = dict(HEADS=n_heads, R=r, R_PAD=triton.next_power_of_2(r), BITS=bits, LOAD_BYTES=load_bytes,
                  GROUP=group, **flags, PER_ROW_CHANNELS=channels.shape[0] > 1, HAS_WINDOW=has_window,
                  HAS_MASK=selectable is not None,
                  C_PAD=pad, BY_HEAD=by_head)
    scratch = out  # a placeholder the top-k never reads, unless scored apart
    if keys is not None:  # scored already
        if keys.dtype != torch.int32 or keys.shape != (programs, pad) or not keys.is_contiguous():
            raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype}; accepted: contiguous int32 {(programs, pad)}")
        scratch, score_tile = keys, 0
    elif score_tile:
        scratch = torch.empty(programs, pad, dtype=torch.int32, device=codes.device)
        _label_candidate_scores[(programs, triton.cdiv(width, score_tile))](
            query, channels, code_bytes, scale_t, zero_t, rows, heads, window_t, mask_t, candidates, scratch,
            codes.shape[2],
            width, *strides, candidates.stride(0), candidates.stride(1), SCORE_TILE_=score_tile,
            **labels, num_warps=4, **pdl_options(codes.device),
        )
    warps = max(4, min(16, pad // 512))
    if walk and pad >= 2048:  # the walk's searches run faster on 8 warps there (candidate_timing.py --warps)
        warps = max(warps, 8)
    if max_registers is None and num_warps is None and codes.is_cuda:
        max_registers = candidate_register_cap(walk, pad, bits, programs, num_sms(codes.device))
    options = _launch_options(max_registers, codes)
    indices, writes = (None, no_critical(out)) if critical is None else critical_arguments(critical, out.shape[1],
                                                                                           heavy)
    slots = out if head_slot is None else head_slot.expand(count, -1)
    slots = slots if slots.stride(-1) == 1 else slots.contiguous()
    _label_candidates[(programs,)](
        query, channels, code_bytes, scale_t, zero_t, rows, heads, window_t, mask_t, candidates, out, best, scratch,
        slots,
        0 if head_slot is None else slots.stride(0), codes.shape[2], heavy, width, top, *strides,
        candidates.stride(0), candidates.stride(1), out.stride(0), out.stride(1), **writes, **labels,
        TILE=tile or TAIL_TILE, WALK=walk, ASCENDING=ascending, CRITICAL=critical is not None,
        SCORED=bool(score_tile) or keys is not None, SPREAD=head_slot is not None,
        H_SEL=1 if head_slot is None else head_slot.shape[-1], CRITICAL_DIRECT=critical is not None and not walk
        and _same_view(window, critical.middle), num_warps=num_warps or warps, **options,
        **pdl_options(codes.device),
    )
    return out, best, indices


def top_scored(scratch: torch.Tensor, candidates: torch.Tensor, out: torch.Tensor, heavy: int, heads: torch.Tensor,
               s_hb: int, n_heads: int, heads_indexed: bool, by_head: bool, critical: CriticalWindows | None = None
               ) -> torch.Tensor | None:
    """Each row-head's top `heavy` of the keys its scoring launch wrote (scratch ``[A * H', C_PAD]`` int32, INT32_MIN:
    none): the columns of its candidates ``[A, H or H_sel, C]`` in candidate order, then NO_TOKEN, into `out`
    (`_label_candidates` with SCORED; heads ``[A or 1, H']`` with row stride `s_hb` where `heads_indexed`, else a
    placeholder; BY_HEAD as there), and (`critical`, every row and head) their critical indices ``[A, H, N_c]``
    int32, returned. For a scoring launch other than the labels' (`candidate_keys_triton`)."""
    pad = scratch.shape[1]
    indices, writes = (None, no_critical(out)) if critical is None else critical_arguments(critical, out.shape[1],
                                                                                           heavy)
    strides = [0] * 14
    strides[12] = s_hb  # the heads' row stride (the label operands' strides: never read)
    _label_candidates[(scratch.shape[0],)](
        scratch, scratch, scratch, scratch, scratch, scratch, heads, scratch, scratch, candidates, out, out, scratch,
        scratch,
        0, 0, heavy, candidates.shape[-1], 0, *strides, candidates.stride(0), candidates.stride(1), out.stride(0),
        out.stride(1), **writes, HEADS=n_heads, ROWS_INDEXED=False, HEADS_INDEXED=heads_indexed, R=2, R_PAD=2,
        BITS=4, LOAD_BYTES=1, GROUP=1, PER_ROW_CHANNELS=False, HAS_WINDOW=False, HAS_MASK=False, C_PAD=pad, TILE=min(TAIL_TILE, pad),
        WALK=False, ASCENDING=False, BY_HEAD=by_head, CRITICAL=critical is not None, SCORED=True,
        num_warps=max(4, min(16, pad // 512)), **pdl_options(scratch.device),
    )
    return indices


def _selection_shape(query_labels: torch.Tensor | None, query: torch.Tensor | None, channels: torch.Tensor | None,
                     rows: torch.Tensor | None, heads: torch.Tensor | None) -> tuple[int, int]:
    """``(A, H')``: the rows and heads a label selection serves, from its index tensors, else from the query labels
    ``[A, H', r]`` or the decode query ``[B, Hq, d]`` and heavy channels ``[P, H_sel, r]`` (all rows and heads)."""
    count, n_heads = query_labels.shape[:2] if query_labels is not None else (query.shape[0], channels.shape[1])
    return (rows.shape[0] if rows is not None else count), (heads.shape[-1] if heads is not None else n_heads)


def label_topk_triton(query_labels: torch.Tensor | None, codes: torch.Tensor, scale: torch.Tensor | None,
                      zero: torch.Tensor | None, bits: int, heavy: int, rows: torch.Tensor | None,
                      heads: torch.Tensor | None,
                      window: torch.Tensor | None = None, selectable: torch.Tensor | None = None, *,
                      query: torch.Tensor | None = None, channels: torch.Tensor | None = None,
                      chunk: int | None = None, tile: int | None = None, num_warps: int | None = None,
                      tail_warps: int | None = None, max_registers: int | None = None,
                      keys: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `label_topk.label_topk` (``[A, H', heavy]`` int64, ascending columns, then
    NO_TOKEN), for rows ``[A]`` and heads ``[A or 1, H']`` index tensors (None: all, in order). Without
    `query_labels`, the labels are gathered in the kernel from the decode `query` ``[B, Hq, d]`` and the
    heavy `channels` ``[P, H_sel, r]``. With `keys` (int32 ``[A * H', >= heavy]``, unit column stride) each
    row-head's row gets its columns' order-preserving score keys at their slots, INT32_MIN after them (what
    `candidate_label_walk_triton` reads instead of scoring the columns again). The columns are written into `out`
    where it fits them (`selection_heads.column_buffer`). `chunk` (a power of two), `tile`,
    `num_warps`, `tail_warps` and `max_registers` (a thread's register cap, every launch; 0: none) override the
    launch (tests, benchmark sweeps)."""
    n = codes.shape[2]
    count, n_heads = _selection_shape(query_labels, query, channels, rows, heads)
    device = codes.device
    out = column_buffer(out, (count, n_heads, heavy), device)
    if heavy == 0 or count * n_heads == 0:
        return out
    if keys is not None and (keys.dtype != torch.int32 or keys.shape[0] != count * n_heads or keys.shape[1] < heavy
                             or keys.stride(1) != 1):
        raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype} with strides {keys.stride()}; accepted: int32 "
                         f"[{count * n_heads}, >= {heavy}] with a unit column stride")
    labels, query, channels, r, group, from_query = kernel_label_inputs(query_labels, query, channels)
    if not from_query:  # one row of labels per program
        labels = query = channels = labels.reshape(count * n_heads, r)
    code_bytes, scale_t, zero_t, rows, heads, mask_t, load_bytes, strides, flags = _operands(
        query, channels, codes, scale, zero, bits, r, rows, heads, selectable, count)
    window_t, has_window = window_operand(window, count, rows)
    has_mask = selectable is not None
    size = chunk or chunk_size(n, bits)
    chunks = triton.cdiv(n, size)
    tile = tile or tail_tile(heavy, chunks)
    row_heads = count * n_heads
    levels = sketch_levels(heavy, n, size)
    common = dict(
        HEADS=n_heads, R=r, R_PAD=triton.next_power_of_2(r), BITS=bits, LOAD_BYTES=load_bytes, GROUP=group, **flags,
        PER_ROW_CHANNELS=from_query and channels.shape[0] > 1, FROM_QUERY=from_query,
        HAS_WINDOW=has_window, HAS_MASK=has_mask, CHUNK_=size, LEVELS_=LEVELS, SKETCH_=SKETCH, TILE=tile,
    )
    key_out, key_stride = (keys, keys.stride(0)) if keys is not None else (out, 0)
    warps = num_warps or max(4, min(16, size // 512))
    if max_registers is None and codes.is_cuda:
        max_registers = register_cap(LABEL_TOPK_PROGRAMS_PER_SM, bits, row_heads * chunks, num_sms(device))
    options = _launch_options(max_registers, codes)
    if chunks == 1:
        _label_topk_sketch[(row_heads, 1)](
            labels, query, channels, code_bytes, scale_t, zero_t, rows, heads, window_t, mask_t,
            out, out, out, out, key_out, n, heavy, 0, key_stride, *levels, *strides, SINGLE=True, num_warps=warps,
            KEYS=keys is not None, **common, **options, **pdl_options(out.device),
        )
        return out
    sketch = torch.empty(row_heads, chunks, SKETCH, dtype=torch.int32, device=device)
    done = torch.empty(row_heads, dtype=torch.int32, device=device)
    chunk_cap = min(size, heavy + heavy // 4 + 1)  # a chunk's list, and its most candidates
    lists = torch.empty(row_heads, chunks, chunk_cap, dtype=torch.int64, device=device)
    cand_stride = -(-chunks * chunk_cap // 16) * 16  # whole 128-byte lines per row-head (no shared line)
    cand = torch.empty(row_heads, cand_stride, dtype=torch.int64, device=device)
    _label_topk_sketch[(row_heads, chunks)](
        labels, query, channels, code_bytes, scale_t, zero_t, rows, heads, window_t, mask_t,
        sketch, done, lists, out, out, n, heavy, chunk_cap, 0, *levels, *strides, SINGLE=False, num_warps=warps,
        **common, **options, **pdl_options(out.device),
    )
    _label_topk_select[(row_heads, chunks)](
        sketch, done, lists, cand, out, key_out, heavy, chunk_cap, cand_stride, key_stride,
        CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)), LEVELS_=LEVELS, SKETCH_=SKETCH, TILE=tile,
        LIST_PAD=max(16, triton.next_power_of_2(chunk_cap)), KEYS=keys is not None,
        num_warps=tail_warps or select_warps(tile) or warps,
        **options,
        **pdl_options(out.device),
    )
    return out
