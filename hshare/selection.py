"""Critical-token selection (HShare section 4.2): sink + heavy (top-k of the middle window) + local.

Columns of the KV cache are not positions: left padding, a shared-prefix gap or a sliding window
make some columns invalid for a row. Everything here works on a row's *valid* columns, taken from
the attention mask: the sink is the first ``sink`` valid columns, the local window the last
``local`` valid columns (the current token included), the middle window everything between. A row
with no more valid columns than the budget N_c attends to all of them (exact). Index ``-1`` marks
"no token" and is never read.

With `SharingConfig.successors` a selecting head walks its top columns in rank order and keeps each with
the column after it until its budget is full (`with_successors`; without adjacent columns, its top half
and their successors): a head that copies (an induction head: it attends the token after an earlier
match) moves one column on as the query moves one token on, and a later layer's copying head attends
one column after the head that found the match, so the successor is where a reusing query looks while
its source's query rarely ranks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hshare.kernels import NO_TOKEN, CriticalWindows, critical_indices, select_heavy, with_successors  # noqa: F401 (re-exported)
from hshare.kernels.selection_heads import per_head  # noqa: F401 (re-exported)


def valid_columns_from_mask(attention_mask: torch.Tensor | None, batch: int, kv_len: int, query_rows: int,
                            device: torch.device) -> torch.Tensor:
    """Key validity of the last `query_rows` query rows: ``[B, query_rows, kv_len]`` bool.

    `attention_mask` is what transformers hands the attention function: ``None`` (causal at
    prefill, all keys at decode), a bool ``[B, 1, q, kv]`` (True = attend) or an additive float
    mask (0 = attend).
    """
    if attention_mask is None:
        q_pos = torch.arange(kv_len - query_rows, kv_len, device=device)[:, None]
        causal = torch.arange(kv_len, device=device)[None, :] <= q_pos
        return causal[None].expand(batch, query_rows, kv_len)
    mask = attention_mask[:, 0, -query_rows:, -kv_len:]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask.expand(batch, query_rows, kv_len)


def own_key_validity(attention_mask: torch.Tensor | None, batch: int, columns: int, window: int | None,
                     device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Key validity of a decode query over the rows' own columns: ``[B, columns]`` bool.

    Args:
        attention_mask: the forward's mask: ``generate``'s 2-D ``[B, >= columns]`` (0 = padding; its last
            `columns` columns are the own ones, after a shared prefix's), a 4-D ``[B, 1, q, >= columns]``
            (its last query row; bool, or additive float with 0 = attend), or None (all valid).
        window: the sliding window every layer applies (keys older than it are invalid), or None.
        out: where to write (static shapes: ``valid[:, :columns]`` of the cache's device validity).
    """
    if out is None:
        out = torch.empty(batch, columns, dtype=torch.bool, device=device)
    if attention_mask is None:
        out.fill_(True)
    elif attention_mask.dim() == 2:
        torch.ne(attention_mask[:, -columns:], 0, out=out)
    else:
        mask = attention_mask[:, 0, -1, -columns:]
        if mask.dtype != torch.bool:
            mask = mask > torch.finfo(mask.dtype).min / 2
        out.copy_(mask.expand(batch, columns))
    if window is not None and columns > window:
        out[:, : columns - window] = False
    return out


def valid_counts(valid: torch.Tensor) -> torch.Tensor:
    """``valid.long().cumsum(-1)``: the valid columns up to and including each column, per row.

    One prefix sum over the flattened rows, less each row's start: on CUDA that is one device-wide
    scan, where torch's per-row scan of a few long rows (B4 x 32k) runs a handful of blocks for tens of
    microseconds. Exact (integers).

    Args:
        valid: ``[..., n]`` bool.

    Returns:
        ``[..., n]`` int64.
    """
    ones = valid.long()
    flat = ones.reshape(-1).cumsum(0).view(ones.shape)
    return flat.sub_(flat[..., :1] - ones[..., :1])  # in place: the temporaries of `cumsum(-1)`, no more


def nth_valid_columns(valid: torch.Tensor, ranks: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Column of the r-th valid token of each row (``NO_TOKEN`` where the row has fewer).

    Args:
        valid: ``[..., n]`` bool.
        ranks: ``[..., k]`` integer ranks (0 = first valid column); may be negative.
        counts: `valid_counts` of `valid` when the caller has it.

    Returns:
        ``[..., k]`` int64 columns.
    """
    if counts is None:
        counts = valid_counts(valid)
    n_valid = counts[..., -1:]
    columns = torch.searchsorted(counts, (ranks + 1).clamp(min=1).contiguous())
    ok = (ranks >= 0) & (ranks < n_valid)
    return torch.where(ok, columns, torch.full_like(columns, NO_TOKEN))


@dataclass
class RowWindows:
    """Sink / middle / local geometry of every row at one step (shared by all layers and heads).

    Attributes:
        valid: ``[B, n]`` key validity.
        n_valid: ``[B]`` valid keys per row.
        short: ``[B]`` rows with ``n_valid <= budget``: attended densely.
        sink: ``[B, sink]`` columns of the first valid tokens (``NO_TOKEN`` if missing).
        local: ``[B, local]`` columns of the last valid tokens.
        dense: ``[B, budget]`` the first `budget` valid columns (all of a short row's tokens).
        middle_bounds: ``[B, 2]`` int64, the middle window ``[sink, n_valid - local)`` in valid-token ranks as
            column bounds ``[start, end)`` (its first column, the column after its last; an empty window:
            end <= start): the window of a heavy column or candidate, valid columns, which lie in the window
            where they lie in its bounds (`kernels.in_window`). `middle` is its ``[B, n]`` mask.
        selectable: ``[B, n]`` bool, where a selection step picks heavy tokens: the middle window
            extended by ``lookahead`` ranks into the local window (the tokens that leave the local
            window before the next selection), so a query group's reuse steps still attend them.
        selectable_bounds: ``[B, 2]`` int64, its column bounds (a selection step's refinements take them).
        all_short: every row is short (host bool: the step's one device sync, not one per layer;
            always False for a static-shape step, which never reads the device).
    """

    valid: torch.Tensor
    n_valid: torch.Tensor
    short: torch.Tensor
    sink: torch.Tensor
    local: torch.Tensor
    dense: torch.Tensor
    middle_bounds: torch.Tensor
    selectable: torch.Tensor
    selectable_bounds: torch.Tensor
    all_short: bool

    @classmethod
    def build(cls, valid: torch.Tensor, sink: int, local: int, budget: int, lookahead: int = 0,
              sync: bool = True) -> "RowWindows":
        """Windows of every row; `lookahead` (a - 1 at a selection step of a query group of a steps,
        with `SharingConfig.lookahead`) widens `selectable` into the local window. `sync` =
        False never reads the device (`all_short` False)."""
        device = valid.device
        counts = valid_counts(valid)  # one prefix sum serves the ranks and every window's columns
        n_valid = counts[:, -1]
        ahead = min(lookahead, local - 1) if lookahead > 0 else 0
        sink_ranks = torch.arange(sink, device=device).expand(valid.shape[0], sink)
        local_ranks = n_valid[:, None] - local + torch.arange(local, device=device)[None, :]
        # a row shorter than sink + local: its local window must not repeat sink columns
        local_ranks = torch.where(local_ranks >= sink, local_ranks, torch.full_like(local_ranks, -1))
        dense_ranks = torch.arange(budget, device=device).expand(valid.shape[0], budget)
        # the windows' bounds: the ranks of their first column and of the column after their last
        bound_ranks = torch.stack((torch.full_like(n_valid, sink), n_valid - local, n_valid - local + ahead), -1)
        columns = nth_valid_columns(valid, torch.cat((sink_ranks, local_ranks, dense_ranks, bound_ranks), -1),
                                    counts)
        bounds = _window_bounds(columns[:, -3:], bound_ranks, n_valid, valid.shape[1])
        middle_bounds = bounds[:, :2].contiguous()  # a row's two bounds adjacent, rows adjacent (the kernels' layout)
        selectable_bounds = middle_bounds if ahead == 0 else bounds[:, ::2].contiguous()
        selectable = _bounds_mask(valid, selectable_bounds)
        short = n_valid <= budget
        return cls(
            valid=valid,
            n_valid=n_valid,
            short=short,
            sink=columns[:, :sink],
            local=columns[:, sink:sink + local],
            dense=columns[:, sink + local:sink + local + budget],
            middle_bounds=middle_bounds,
            selectable=selectable,
            selectable_bounds=selectable_bounds,
            all_short=bool(short.all()) if sync else False,
        )

    @property
    def middle(self) -> torch.Tensor:
        """``[B, n]`` bool, the middle window's mask (its valid columns within `middle_bounds`)."""
        return _bounds_mask(self.valid, self.middle_bounds)

    def critical_indices(self, heavy: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        """Union of sink, heavy and local columns per selection head (`kernels.critical_indices`).

        Args:
            heavy: ``[B, H, heavy]`` heavy columns (``NO_TOKEN`` allowed), chosen at the last
                selection step (query groups reuse them; sink and local follow the current step).

            count: optional ``[1]`` int64 device tensor the valid indices are added to.

        Returns:
            ``[B, H, N_c]`` integer columns; short rows get all their valid columns.
        """
        return self.critical_windows(count).indices(heavy)

    def critical_windows(self, count: torch.Tensor | None = None) -> CriticalWindows:
        """The windows `critical_indices` takes (with the work counter `count`), for a refinement that writes the
        critical indices of its heavy columns itself (`SelectionPolicy.candidate_heavy`'s `critical`)."""
        return CriticalWindows(self.sink, self.local, self.dense, self.middle_bounds, self.short, count)


def _window_bounds(columns: torch.Tensor, ranks: torch.Tensor, n_valid: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, k]`` column bounds of windows given in valid-token ranks: the column of each rank in `ranks` ``[B, k]``
    (`columns`, ``NO_TOKEN`` where the row has no such token), `n` past the last valid token, 0 before the first.
    A valid column c then has rank >= r where c >= the bound of r: a rank window ``[r0, r1)`` is the valid columns of
    ``[bound(r0), bound(r1))``."""
    past = torch.full_like(columns, n)
    return torch.where(ranks >= n_valid[:, None], past, torch.where(ranks < 0, torch.zeros_like(columns), columns))


def _bounds_mask(valid: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` bool: the valid columns of each row within its bounds ``[B, 2]``."""
    column = torch.arange(valid.shape[1], device=valid.device)
    return valid & (column >= bounds[:, :1]) & (column < bounds[:, 1:])


def prefill_middle_windows(valid_rows: torch.Tensor, sink: int, local: int) -> torch.Tensor:
    """Middle windows of the last prefill query rows (the planner's evidence).

    Args:
        valid_rows: ``[B, W, n]`` key validity of W query rows.

    Returns:
        ``[B, W, n]`` bool.
    """
    n_valid = valid_rows.sum(-1, keepdim=True)
    rank = valid_counts(valid_rows) - 1
    return valid_rows & (rank >= sink) & (rank < n_valid - local)
