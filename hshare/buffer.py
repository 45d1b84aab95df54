"""A tensor that grows along its token dimension, or is sized once for a whole generation.

Decode appends one token per step. ``torch.cat`` (what transformers' DynamicCache does) copies
the whole cache every step: 2x the bytes dense attention reads, far more than a sparse step
reads. The buffer over-allocates and hands out views ``[..., :length, ...]`` of its storage, so a
step writes one token and the attention kernels read the cache in place.

Static shapes (`hshare.static_decode`, CUDA graphs): given a `reserve` (the prompt plus
``max_new_tokens`` - 1, known when ``generate`` starts) the first allocation is that final size and
nothing is ever copied to grow. `freeze` then makes `view` the whole storage (a fixed shape every
step) and decode writes its token at a column held in a device tensor (`write`), so one captured
step serves every step; the host-side `length` is advanced by the caller (`HShareCache.advance`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_GRANULE = 256  # capacity is a multiple of this many tokens
_HEADROOM = 0.25  # extra capacity on growth, relative to the needed length


class GrowingBuffer:
    """Storage for ``[B, H, n, ...]`` tensors growing along dim 2 (tokens).

    Args:
        reserve: tokens to allocate at the first allocation (no headroom, no growth below it).
        tokens_last: store the tokens as the last dimension in memory (``[B, H, ..., n]``, seen as the
            ``[B, H, n, ...]`` view): each trailing entry's tokens are adjacent, so a kernel reading one
            entry of many tokens reads them coalesced. Every view, write and row selection keeps the layout.
    """

    def __init__(self, reserve: int = 0, tokens_last: bool = False) -> None:
        self.storage: torch.Tensor | None = None
        self.length = 0
        self.reserve = reserve
        self.frozen = False
        self.tokens_last = tokens_last

    @property
    def capacity(self) -> int:
        return 0 if self.storage is None else self.storage.shape[2]

    def view(self) -> torch.Tensor | None:
        """``[B, H, length, ...]`` view of the stored tokens (frozen: the whole storage)."""
        if self.storage is None:
            return None
        return self.storage if self.frozen else self.storage[:, :, : self.length]

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """Append ``[B, H, t, ...]`` tokens; returns the view of all tokens."""
        self.claim(tuple(new.shape[:2]), new.shape[2], tuple(new.shape[3:]), new.dtype, new.device).copy_(new)
        return self.view()

    def claim(self, batch_heads: tuple[int, int], tokens: int, tail: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """Grow by `tokens` and return the ``[B, H, tokens, *tail]`` view to write them into (a kernel
        writes new tokens straight into the storage)."""
        if self.frozen:
            raise RuntimeError("a frozen (static-shape) buffer takes tokens through write(); thaw() it first")
        needed = self.length + tokens
        if self.storage is None or needed > self.capacity or self.storage.shape[:2] != batch_heads:
            if self.storage is not None and self.storage.shape[:2] != batch_heads and self.length:
                raise ValueError(
                    f"cannot append tokens of batch/heads {batch_heads} to a buffer holding "
                    f"{tuple(self.storage.shape[:2])}"
                )
            if self.storage is None and needed <= self.reserve:
                # zeroed: a frozen view exposes the columns not yet written, and attention masks them by
                # weight 0, which turns stale NaN / inf bits into NaN (0 * inf)
                grown = self._allocate(batch_heads, self.reserve, tail, dtype, device, torch.zeros)
            else:
                capacity = -(-int(needed * (1 + _HEADROOM)) // _GRANULE) * _GRANULE
                grown = self._allocate(batch_heads, capacity, tail, dtype, device, torch.empty)
            if self.length:
                grown[:, :, : self.length] = self.storage[:, :, : self.length]
            self.storage = grown
        start, self.length = self.length, needed
        return self.storage[:, :, start:needed]

    def _allocate(self, batch_heads: tuple[int, int], capacity: int, tail: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device, make: Callable[..., torch.Tensor]) -> torch.Tensor:
        """A ``[B, H, capacity, *tail]`` tensor from `make` (torch.zeros / torch.empty), tokens last in memory
        when `tokens_last`."""
        if not self.tokens_last:
            return make((*batch_heads, capacity, *tail), dtype=dtype, device=device)
        return make((*batch_heads, *tail, capacity), dtype=dtype, device=device).movedim(-1, 2)

    # ---- static shapes ----------------------------------------------------------------
    def freeze(self) -> None:
        """Static decode: `view` is the whole storage from now on (its shape never changes)."""
        self.frozen = self.storage is not None

    def thaw(self) -> None:
        self.frozen = False

    def write(self, column: torch.Tensor, new: torch.Tensor) -> None:
        """Write ``[B, H, 1, ...]`` at the column held in `column` (``[1]`` int64, on the device):
        no host value involved, so a captured step writes where the replayed step is."""
        self.storage.index_copy_(2, column, new)

    # ---- rows and length ----------------------------------------------------------------
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat / reorder) batch rows: beam search, ``batch_select_indices``."""
        if self.storage is not None:
            rows = rows.to(self.storage.device)
            if self.tokens_last:  # index_select returns a contiguous tensor: select in the stored order
                self.storage = self.storage.movedim(2, -1).index_select(0, rows).movedim(-1, 2)
            else:
                self.storage = self.storage.index_select(0, rows)

    def crop(self, length: int) -> None:
        self.length = max(0, min(self.length, length))

    def nbytes(self) -> int:
        """Bytes of the stored tokens (not of the spare capacity)."""
        if self.storage is None:
            return 0
        stored = self.storage[:, :, : self.length]
        return stored.numel() * stored.element_size()

    def reserved_bytes(self) -> int:
        """Bytes allocated (stored tokens and spare capacity)."""
        return 0 if self.storage is None else self.storage.numel() * self.storage.element_size()
