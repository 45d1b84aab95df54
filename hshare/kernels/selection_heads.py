"""Which rows and heads a selection reads: the mapping the policies and their kernels' twins share.

Selection head s of H_sel stands for the query heads ``[s * Hq // H_sel, (s + 1) * Hq // H_sel)`` and
reads KV head ``s * Hkv // H_sel``. A selection may run for some rows ``[B']`` (None = all) and, per row,
some selection heads ``[B' or 1, H']`` (None = all H_sel).
"""

from __future__ import annotations

from typing import Callable

import torch


def pick_heads(tensor: torch.Tensor, rows: torch.Tensor | None = None, heads: torch.Tensor | None = None
               ) -> torch.Tensor:
    """A per-selection-head tensor ``[B, H_sel, ...]`` at rows ``[B']`` and heads ``[B' or 1, H']``:
    ``[B', H', ...]``."""
    if rows is not None:
        tensor = tensor.index_select(0, rows)
    if heads is None:
        return tensor
    count = tensor.shape[0]
    return tensor[torch.arange(count, device=tensor.device)[:, None], heads.expand(count, -1)]


def kv_heads_of(sel_heads: int, kv_heads: int, heads: torch.Tensor | None, device: torch.device
                ) -> torch.Tensor | None:
    """The KV head each of the selection heads ``[B' or 1, H']`` reads (None = all H_sel: ``[1, H_sel]``), or None
    where those are every KV head in order (all heads, H_sel = Hkv)."""
    if heads is None:
        if sel_heads == kv_heads:
            return None
        heads = torch.arange(sel_heads, device=device)[None]
    return heads * kv_heads // sel_heads


def kv_heads_read(tensor: torch.Tensor, sel_heads: int, rows: torch.Tensor | None = None,
                  heads: torch.Tensor | None = None) -> torch.Tensor:
    """A per-KV-head tensor ``[B, Hkv, ...]`` as `sel_heads` selection heads read it, at rows ``[B']`` and heads
    ``[B' or 1, H']``: ``[B', H', ...]``."""
    if rows is not None:
        tensor = tensor.index_select(0, rows)
    kv = kv_heads_of(sel_heads, tensor.shape[1], heads, tensor.device)
    if kv is None:
        return tensor
    if heads is None:
        return tensor.index_select(1, kv[0])
    count = tensor.shape[0]
    return tensor[torch.arange(count, device=tensor.device)[:, None], kv.expand(count, -1)]


def refine_into(out: torch.Tensor, candidates: torch.Tensor, heads: torch.Tensor,
                refine: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A refinement of some selection heads written in place: `refine` maps the candidates ``[B', H', C]`` of heads
    ``[B' or 1, H']`` (taken from every selection head's ``[B', H_sel, C]``) to their chosen columns ``[B', H', k]``,
    which land at those heads' rows of `out` ``[B', H_sel, k]``. Returns `out`."""
    index = heads.expand(out.shape[0], -1)[..., None].expand(-1, -1, out.shape[-1])
    return out.scatter_(1, index, refine(pick_heads(candidates, heads=heads)))


def _fits(out: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    """Whether `out` can take columns ``shape``: a contiguous int64 tensor of that shape (a layer's kept buffer)."""
    return out is not None and out.shape == shape and out.dtype == torch.int64 and out.is_contiguous()


def column_buffer(out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where a selection writes its columns ``shape`` int64: `out` when it fits them (written in place), else a new
    tensor."""
    return out if _fits(out, shape) else torch.empty(shape, dtype=torch.int64, device=device)


def columns_into(columns: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A twin's `columns` written into `out` when it fits them (`column_buffer`), else `columns` themselves."""
    return out.copy_(columns) if _fits(out, columns.shape) else columns


def per_head(columns: torch.Tensor, head_slot: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[B', n_src, k]`` columns of a layer's source heads -> ``[B', H_sel, k]``: each head its source's
    (``head_slot`` ``[P, H_sel]``: each head's slot among the source heads, P = 1 or B'); written into `out` when
    it fits them (`column_buffer`), else into a new tensor."""
    slots = head_slot.expand(columns.shape[0], -1)[..., None].expand(-1, -1, columns.shape[-1])
    return torch.gather(columns, 1, slots, out=column_buffer(out, slots.shape, columns.device))


def walk_into(taken: torch.Tensor, best: torch.Tensor, head_slot: torch.Tensor | None,
              out: tuple[torch.Tensor | None, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """A twin walk's ``(taken, best)`` of the source heads into `out` ``(taken, best)`` where each fits: with
    `head_slot`, every selection head's entries, each its source's (`per_head`), as the Triton walk writes them."""
    if head_slot is None:
        return columns_into(taken, out[0]), columns_into(best, out[1])
    return per_head(taken, head_slot, out[0]), per_head(best, head_slot, out[1])
