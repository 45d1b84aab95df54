"""A tensor that grows along its token dimension with amortized reallocation.

Decode appends one token per step. ``torch.cat`` (what transformers' DynamicCache does) copies
the whole cache every step: 2x the bytes dense attention reads, far more than a sparse step
reads. The buffer over-allocates and hands out views ``[..., :length, ...]`` of its storage, so a
step writes one token and the attention kernels read the cache in place.
"""

from __future__ import annotations

import torch

_GRANULE = 256  # capacity is a multiple of this many tokens
_HEADROOM = 0.25  # extra capacity on growth, relative to the needed length


class GrowingBuffer:
    """Storage for ``[B, H, n, ...]`` tensors growing along dim 2 (tokens)."""

    def __init__(self) -> None:
        self.storage: torch.Tensor | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        return 0 if self.storage is None else self.storage.shape[2]

    def view(self) -> torch.Tensor | None:
        """``[B, H, length, ...]`` view of the stored tokens."""
        return None if self.storage is None else self.storage[:, :, : self.length]

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """Append ``[B, H, t, ...]`` tokens; returns the view of all tokens."""
        self.claim(tuple(new.shape[:2]), new.shape[2], tuple(new.shape[3:]), new.dtype, new.device).copy_(new)
        return self.view()

    def claim(self, batch_heads: tuple[int, int], tokens: int, tail: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """Grow by `tokens` and return the ``[B, H, tokens, *tail]`` view to write them into (a kernel
        writes new tokens straight into the storage)."""
        needed = self.length + tokens
        if self.storage is None or needed > self.capacity or self.storage.shape[:2] != batch_heads:
            if self.storage is not None and self.storage.shape[:2] != batch_heads and self.length:
                raise ValueError(
                    f"cannot append tokens of batch/heads {batch_heads} to a buffer holding "
                    f"{tuple(self.storage.shape[:2])}"
                )
            capacity = -(-int(needed * (1 + _HEADROOM)) // _GRANULE) * _GRANULE
            grown = torch.empty((*batch_heads, capacity, *tail), dtype=dtype, device=device)
            if self.length:
                grown[:, :, : self.length] = self.storage[:, :, : self.length]
            self.storage = grown
        start, self.length = self.length, needed
        return self.storage[:, :, start:needed]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat / reorder) batch rows: beam search, ``batch_select_indices``."""
        if self.storage is not None:
            self.storage = self.storage.index_select(0, rows.to(self.storage.device))

    def crop(self, length: int) -> None:
        self.length = max(0, min(self.length, length))

    def nbytes(self) -> int:
        """Bytes of the stored tokens (not of the spare capacity)."""
        view = self.view()
        return 0 if view is None else view.numel() * view.element_size()
