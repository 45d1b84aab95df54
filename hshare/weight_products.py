"""The linear layers of a captured decode step through `kernels.decode_linear` (``weight_kernels``).

A decode step of few rows reads every weight once; `kernels.decode_linear` runs each product on the
faster of cuBLAS and a weight-streaming Triton product at its shape on this GPU (timed once per shape,
outside capture). `routed` routes every ``torch.nn.Linear`` through it inside the steps
`hshare.static_decode` records (the first, eager step of a kind, where the plans are made, and its
capture; `routed`); prefill and everything outside a static decode run ``F.linear`` untouched.

The route is one function, ``torch.nn.Linear.forward`` swapped for the block: a module-level swap, as
`hshare.elementwise_fusion` swaps the rotary function, so that inductor's compiled MLP (one compiled
forward per class, shared by the layers) sees the same function in every layer. Inside it the product is
a custom op (``hshare::decode_linear``), opaque to the compiler, which fuses the elementwise work around
it as before.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from hshare.kernels.decode_linear import decode_linear


@torch.library.custom_op("hshare::decode_linear", mutates_args=())
def decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`kernels.decode_linear.decode_linear` as an op the compiler keeps whole."""
    return decode_linear(x, weight, bias)


@decode_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.hshare.decode_linear(x, self.weight, self.bias)


@contextlib.contextmanager
def routed() -> Iterator[None]:
    """Every ``torch.nn.Linear`` of the process runs `kernels.decode_linear` inside this block."""
    original = torch.nn.Linear.forward
    torch.nn.Linear.forward = _linear_forward
    try:
        yield
    finally:
        torch.nn.Linear.forward = original
