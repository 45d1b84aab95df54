"""Quest's heavy columns from its page scores: the selectable columns of the best pages, page after page.

A row's columns are paged from its first valid column: column j lies in page ``(j + shift) // page_size``.
Pages are ranked by score (descending; ties to the earlier page); the heavy slots take the selectable
columns of the first page in rank, then of the second, and so on, each page's in column order; the last
page taken is cut after the columns the budget still holds. This is the set of the top-``heavy`` of
Quest's per-column ranking keys (`hshare.quest.QuestPageCache.token_keys`) over the selectable window,
without a key per column; it is returned in column order, as the label policy's heavy columns are.

`page_heavy` dispatches (`dispatch.use_triton`): CUDA tensors to one Triton launch (`page_topk_triton`: a
program per (row, head) counts each page's selectable columns, searches the page score where the budget
ends, and writes the pages' columns), everything else to the twin `page_heavy_torch` (the CPU path and the
test oracle, which sorts the pages).
"""

from __future__ import annotations

import torch

from .critical_indices import NO_TOKEN
from .dispatch import use_triton
from .selection_heads import columns_into


def page_heavy(scores: torch.Tensor, selectable: torch.Tensor, shift: torch.Tensor, page_size: int,
               heavy: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The heavy columns of Quest's page ranking (contract: `page_heavy_torch`); Triton for CUDA tensors. Written
    into `out` when it fits them (`selection_heads.column_buffer`: a layer's kept buffer), else a new tensor."""
    if use_triton(scores) and scores.dtype == torch.float32:
        from .page_topk_triton import page_heavy_triton

        return page_heavy_triton(scores, selectable, shift, page_size, heavy, out)
    return columns_into(page_heavy_torch(scores, selectable, shift, page_size, heavy), out)


def page_heavy_torch(scores: torch.Tensor, selectable: torch.Tensor, shift: torch.Tensor, page_size: int,
                     heavy: int) -> torch.Tensor:
    """The heavy columns of each (row, head) from its page scores.

    Args:
        scores: ``[B', H', P]`` page scores (fp32 or fp64).
        selectable: ``[B', n]`` bool, the columns a selection may take (valid, outside the sink and the
            local window); ``P * page_size >= n + shift``.
        shift: ``[B']`` int64, each row's paging offset (column j lies in page ``(j + shift) // page_size``).
        page_size: columns per page.
        heavy: slots per (row, head).

    Returns:
        ``[B', H', heavy]`` int64 columns, ascending, then ``NO_TOKEN`` past the row's selectable count.

    The window is laid out by page (``[B', P, page_size]``) and counted within each page, then across
    pages; the P scores are sorted (stable); each slot finds its page by a search over the ranked pages'
    cumulative counts, and its column by a search over the row's running count; the columns are sorted.
    """
    count, width, pages = scores.shape
    size, n, device = page_size, selectable.shape[-1], scores.device
    column_of = torch.arange(pages * size, device=device)[None, :] - shift[:, None]  # [B', P * size]
    by_page = selectable.gather(1, column_of.clamp(0, max(n - 1, 0))) & (column_of >= 0) & (column_of < n)
    in_page = by_page.view(count, pages, size).cumsum(-1, dtype=torch.int32)  # selectable up to each offset
    per_page = in_page[..., -1]  # [B', P]
    before = per_page.cumsum(-1) - per_page  # selectable columns in earlier pages
    running = (in_page + before[..., None]).view(count, pages * size)  # up to each virtual column
    order = scores.sort(dim=-1, descending=True, stable=True).indices  # ties: the earlier page first
    in_order = per_page[:, None].expand(count, width, pages).gather(-1, order)
    reach = in_order.cumsum(-1)  # [B', H', P] selectable columns up to each ranked page
    slot = torch.arange(heavy, device=device, dtype=reach.dtype).expand(count, width, heavy).contiguous()
    ranked = torch.searchsorted(reach, slot, right=True).clamp(max=pages - 1)  # the page holding each slot
    page = order.gather(-1, ranked)
    offset = slot - (reach.gather(-1, ranked) - in_order.gather(-1, ranked))  # its rank inside the page
    rank = before[:, None].expand(count, width, pages).gather(-1, page) + offset  # its rank in the row
    virtual = torch.searchsorted(running, (rank + 1).reshape(count, -1)).reshape(rank.shape)
    past = slot >= reach[..., -1:]
    columns = torch.where(past, n, virtual - shift[:, None, None]).sort(-1).values  # past the count: last
    return columns.masked_fill_(columns == n, NO_TOKEN)
