"""The Quest page cache of one layer (Tang et al., ICML 2024): the ``"quest"`` selection policy.

Quest splits a row's cached tokens into *pages* of ``page_size`` consecutive columns and keeps, per
page and KV head, the channel-wise minimum and maximum of the page's keys. For a query q the page's
score ``sum_c max(q_c * min_c, q_c * max_c)`` bounds ``q . k`` from above for every key k of the
page; with per-KV-head selection the bounds of the g query heads of the group are summed (as the
label policy sums their approximate logits). Computed as ``q+ . max + q- . min`` with
``q+ = max(q, 0)``, ``q- = min(q, 0)``: two small products per page, the g heads' ``q+`` and ``q-``
summed first.

Paging. Pages are counted from each row's first valid column (the first one at prefill): a
left-padded row is paged exactly as the row alone, pads never share a page with tokens, and a row's
selection does not depend on how much its batch mates pad it. Column j of row b lies in page
``(j + shift_b) // page_size`` with ``shift_b = -first_valid_b mod page_size``. Invalid columns
(padding, the gap before a shared prefix's own part) are excluded from min and max: a page holding
no valid key keeps the sentinels ``min = +big, max = -big`` (its score is ``<= 0`` or ``-inf``, never
NaN), and no selectable token lies in it. The last, partial page is updated as tokens are appended
(min / max are associative, so an append only touches the pages its tokens fall in).

Whole pages. A token's score is its page's score, so the heavy budget should take whole pages. The
scores this policy returns are therefore *ranking keys* (`token_keys`): tokens ordered by page score
(descending), ties between pages broken by the earlier page, then by column inside the page. The
top-``heavy`` middle-window tokens by this key are the middle-window tokens of the best pages, taken
page after page; only the last page taken is cut when the budget ends inside it. Pages that straddle
the sink or local window contribute their middle tokens only (the windows are always kept anyway).

Static shapes (`hshare.static_decode`, CUDA graphs): with a reserve, every page slot the
generation can reach is allocated once (sentinels), `freeze` makes the scores cover all of them and
all reserved columns at every step, and `write` folds the step's key into its page at a column
held in a device tensor.

A selection step (`QuestPageCache.decode_heavy`) never builds those keys: it finds the page score where
the budget ends (pages weighed by their selectable columns) and takes the columns of the pages above it,
and of the tied pages in page order, a few passes over the P pages per (row, head) instead of a key and a
top-k over every column (`kernels.page_heavy`).

On CUDA a decode selection is two Triton launches per layer: the page scores (`kernels.page_scores`)
and the heavy columns from them (`kernels.page_heavy`); their twins run on CPU. Nothing here goes
through the label kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hshare.config import HShareConfig, PolicyConfig, check_int
from hshare.policy import SelectionPolicy, register_policy
from hshare.kernels import page_heavy, page_scores

if TYPE_CHECKING:
    from hshare.buffer import GrowingBuffer

_APPEND_CHUNK_ELEMENTS = 1 << 24  # key elements gathered at once by `append` (bounds prefill memory)


def pages_for(length: int, page_size: int) -> int:
    """Page slots needed for `length` columns: a row's pages may start up to page_size - 1 columns
    before column 0 (``shift`` < page_size), so the last column's page index is at most
    ``(length - 1 + page_size - 1) // page_size``."""
    return 0 if length <= 0 else (length + page_size - 2) // page_size + 1


def page_bounds_reference(keys: torch.Tensor, valid: torch.Tensor, page_size: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Brute-force page bounds (a loop over rows and pages; the test oracle of `QuestPageCache`).

    Args:
        keys: ``[B, Hkv, n, d]``; valid: ``[B, n]`` bool.

    Returns:
        ``(low [B, Hkv, P, d], high [B, Hkv, P, d], has_keys [B, P])`` with P = `pages_for(n)`;
        pages without a valid key have ``has_keys`` False (their low / high are undefined: zeros).
    """
    batch, kv_heads, n, dim = keys.shape
    pages = pages_for(n, page_size)
    low = keys.new_zeros(batch, kv_heads, pages, dim)
    high = keys.new_zeros(batch, kv_heads, pages, dim)
    has = torch.zeros(batch, pages, dtype=torch.bool)
    for b in range(batch):
        columns = valid[b].nonzero().flatten().tolist()
        shift = (-columns[0]) % page_size if columns else 0
        for p in range(pages):
            mine = [j for j in columns if (j + shift) // page_size == p]
            if mine:
                has[b, p] = True
                low[b, :, p] = keys[b, :, mine].amin(1)
                high[b, :, p] = keys[b, :, mine].amax(1)
    return low, high, has


@dataclass(frozen=True)
class QuestConfig(PolicyConfig):
    """The ``"quest"`` policy's section of the config.

    Attributes:
        page_size: columns per page (16 in the Quest paper).
    """

    page_size: int = 16
    flat_names = {"page_size": "page_size"}
    # a selection scores and ranks every page at every layer, head and selection step, so a sparse step must save
    # this much more K/V reading a layer than the label policy's to pay for it
    selection_min_saved_mib = 96.0
    refuses_successors = ("quest keeps whole pages, whose columns are each other's successors, so successors would "
                          "halve its pages")

    def __post_init__(self) -> None:
        check_int("policy.page_size", self.page_size, 1, 65536)

    def describe(self) -> str:
        return f"quest pages of {self.page_size}"


@register_policy("quest")
class QuestPageCache(SelectionPolicy):
    """Per-page channel-wise min and max of one layer's keys: a `SelectionPolicy` scoring pages.

    Args:
        sel_heads: selection heads H_sel (Hkv or Hq); selection head s reads KV head
            ``s * Hkv // H_sel``.
        kv_heads: KV heads of the layer (the bounds are kept per KV head, never per query head).
        page_size: columns per page.

    Attributes:
        low, high: slot buffers of ``[B, Hkv, P, d]`` page bounds, in the keys' dtype; P =
            `pages_for` the columns (`slots`). Static shapes (`freeze`): every page slot the reserved
            columns can fall in is scored at every step (slots not reached yet hold the empty-page
            sentinels). `crop` drops the pages past the kept columns; the bounds of a page cut in the
            middle still include the removed keys (a looser, still valid, upper bound: the keys are
            not kept here to recompute it).
        shift: ``[B]`` int64, each row's page offset (set by the first append).
    """

    unit = "pages"  # one scoring scores every page slot (DecodeStats.scored_pages)
    config_class = QuestConfig
    slot_buffers = ("low", "high")
    row_tensors = ("shift",)
    low: GrowingBuffer
    high: GrowingBuffer

    def __init__(self, sel_heads: int, kv_heads: int, page_size: int, reserve: int = 0) -> None:
        self.page_size = page_size  # before the base class sizes the page buffers (`slots`)
        super().__init__(sel_heads, kv_heads, reserve)
        self.shift: torch.Tensor | None = None

    @classmethod
    def from_prefill(cls, config: HShareConfig, model_state: Any, layer: int,
                     query: torch.Tensor, new_keys: torch.Tensor, new_valid: torch.Tensor, kv_heads: int,
                     reserve: int) -> QuestPageCache:
        """Empty pages of ``config.policy.page_size`` columns (the first append pages each row)."""
        return cls(cls.selection_heads(config, query, kv_heads), kv_heads, config.policy.page_size, reserve)

    def slots(self, columns: int) -> int:
        """Page slots of `columns` columns (`pages_for`)."""
        return pages_for(columns, self.page_size)

    @property
    def pages(self) -> int:
        """Page slots scored (static shapes: every reserved slot)."""
        return self.scored_units()

    def write(self, column: torch.Tensor, keys: torch.Tensor) -> None:
        """Static shapes: fold the key at the column held in `column` (``[1]`` int64 device tensor)
        of the layer's whole key buffer `keys` ``[B, Hkv, n, d]`` into its page's bounds, each row's
        page from its shift; no host value involved (a captured step writes where the replayed step is)."""
        new_key = keys.index_select(2, column)
        batch, kv_heads, _, dim = new_key.shape
        page = ((column + self.shift) // self.page_size)[:, None, None, None].expand(batch, kv_heads, 1, dim)
        for bounds, fold in ((self.low.storage, torch.minimum), (self.high.storage, torch.maximum)):
            bounds.scatter_(2, page, fold(bounds.gather(2, page), new_key.to(bounds.dtype)))

    # ---- metadata ---------------------------------------------------------------------------
    def add_keys(self, new_keys: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Fold new keys ``[B, Hkv, t, d]`` (columns ``[length, length + t)``) into the page bounds.

        Args:
            valid: ``[B, t]`` bool validity of the new columns (None = all valid); invalid columns
                are left out of min and max. The first append fixes each row's page offset from its
                first valid column.
        """
        batch, kv_heads, tokens, dim = new_keys.shape
        size, device = self.page_size, new_keys.device
        if self.shift is None:
            first = valid.int().argmax(-1) if valid is not None else torch.zeros(batch, dtype=torch.long,
                                                                                           device=device)
            self.shift = (-(self.length + first.long())) % size
        start, end = self.length, self.length + tokens
        first_page, last_page = start // size, (end - 1 + size - 1) // size
        big = torch.finfo(new_keys.dtype).max
        held = self.low.length
        if pages_for(end, size) > held:  # new page slots start empty: sentinel bounds, reserved slots too
            grow = pages_for(end, size) - held
            self.low.claim((batch, kv_heads), grow, (dim,), new_keys.dtype, device)
            self.high.claim((batch, kv_heads), grow, (dim,), new_keys.dtype, device)
            self.low.storage[:, :, held:].fill_(big)
            self.high.storage[:, :, held:].fill_(-big)
        low_all, high_all = self.low.view(), self.high.view()
        chunk = max(1, _APPEND_CHUNK_ELEMENTS // max(1, batch * kv_heads * size * dim))
        for lo_page in range(first_page, last_page + 1, chunk):
            hi_page = min(last_page, lo_page + chunk - 1)
            width = (hi_page - lo_page + 1) * size
            virtual = lo_page * size + torch.arange(width, device=device)  # page-aligned virtual columns
            index = virtual[None, :] - self.shift[:, None] - start  # [B, W] position in new_keys
            inside = (index >= 0) & (index < tokens)
            index = index.clamp(0, tokens - 1)
            if valid is not None:
                inside &= valid.gather(1, index)
            keys = new_keys.gather(2, index[:, None, :, None].expand(batch, kv_heads, width, dim))
            inside = inside[:, None, :, None]
            pages = (batch, kv_heads, hi_page - lo_page + 1, size, dim)
            low = torch.where(inside, keys, big).reshape(pages).amin(3)
            high = torch.where(inside, keys, -big).reshape(pages).amax(3)
            low_slot, high_slot = low_all[:, :, lo_page:hi_page + 1], high_all[:, :, lo_page:hi_page + 1]
            torch.minimum(low_slot, low, out=low_slot)
            torch.maximum(high_slot, high, out=high_slot)

    # ---- scores -----------------------------------------------------------------------------
    def page_scores(self, query: torch.Tensor, rows: torch.Tensor | None = None,
                    heads: torch.Tensor | None = None) -> torch.Tensor:
        """Quest's upper bound of q . k per page, per selection head.

        Args:
            query: ``[B, Hq, Q, d]``.
            rows: ``[B']`` rows to score (None = all).
            heads: ``[B' or 1, H']`` selection heads to score per row (None = all H_sel).

        Returns:
            ``[B', H', Q, P]`` fp32 (fp64 for fp64 queries): ``sum_c max(q_c min_c, q_c max_c)``,
            summed over the query heads of a selection head.
        """
        return page_scores(query, self.low.view(), self.high.view(), self.sel_heads, rows, heads)

    def token_keys(self, page_scores: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Ranking keys of every cached column from its page's score (whole pages, see the module).

        Args:
            page_scores: ``[B', H', ..., P]``.
            rows: ``[B']`` the rows they belong to (None = all).

        Returns:
            ``[B', H', ..., n]`` float keys, larger = selected first: ``(P - rank(page)) *
            page_size - offset in page``, rank by score (descending, ties to the earlier page).
        """
        size, pages, n = self.page_size, page_scores.shape[-1], self.length
        device = page_scores.device
        order = page_scores.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(pages, device=device).expand_as(order))
        shift = self.shift if rows is None else self.shift.index_select(0, rows)
        virtual = torch.arange(n, device=device)[None, :] + shift[:, None]  # [B', n]
        lead = page_scores.shape[:-1]
        view = (lead[0],) + (1,) * (len(lead) - 1) + (n,)
        page_of = (virtual // size).reshape(view).expand(*lead, n)
        keys = (pages - rank.gather(-1, page_of)) * size - (virtual % size).reshape(view)
        dtype = torch.float32 if pages * size < 2**24 else torch.float64  # exact integers
        return keys.to(dtype)

    def score_query(self, query: torch.Tensor) -> torch.Tensor:
        """What `prefill_scores` reads of queries ``[B, Hq, Q, d]``: the queries themselves."""
        return query

    def prefill_scores(self, query: torch.Tensor) -> torch.Tensor:
        """Ranking keys ``[B, H_sel, Q, n]`` of every cached column for Q query rows ``[B, Hq, Q, d]``."""
        return self.token_keys(self.page_scores(query))

    def decode_scores(self, query: torch.Tensor, rows: torch.Tensor | None = None,
                      heads: torch.Tensor | None = None) -> torch.Tensor:
        """Ranking keys ``[B', H', n]`` for the decode query ``[B, Hq, d]`` of some rows and heads."""
        return self.token_keys(self.page_scores(query[:, :, None], rows, heads)[:, :, 0], rows)

    def decode_heavy(self, query: torch.Tensor, selectable: torch.Tensor, heavy: int, rows: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The heavy columns ``[B', H', heavy]`` of a selection step from the page scores alone: the set the
        top-`heavy` of `decode_scores` over the selectable window ``[B', n]`` takes (the selectable columns of
        the best pages, page after page, the last page cut after its first columns), in column order, then
        ``NO_TOKEN`` past the window's size; without a key per column (`kernels.page_heavy`)."""
        scores = self.page_scores(query[:, :, None], rows, heads)[:, :, 0]  # [B', H', P]
        shift = self.shift if rows is None else self.shift.index_select(0, rows)
        return page_heavy(scores, selectable, shift, self.page_size, heavy, out)
