"""Programmatic dependent launch (PDL) of hshare's Triton kernels inside decode steps.

On a GPU of compute capability 9 or newer a kernel launched with ``launch_pdl`` may be scheduled while
the kernel before it in the stream drains, instead of after it has finished and its completion has
reached the host's launch queue (in a replayed CUDA graph: the gap between two dependent launches).

Contract of every kernel here that takes a ``PDL`` constexpr: its first statement is
`wait_for_previous_kernel` (``griddepcontrol.wait``: every kernel before it in the stream has finished
and its writes are visible), so no load or store of it can overlap the kernel before it; then it lets
the kernel after it be scheduled (``griddepcontrol.launch_dependents``), which waits in turn. A kernel
launched without ``launch_pdl`` (``PDL=False``) runs exactly as before.

Launches use it only inside `dependent_launches` (the static decode step, `hshare.static_decode`, while
it runs eagerly and while it is captured; ``runtime.dependent_launch``), only on CUDA devices of compute
capability >= 9 and only with a Triton that has it (3.4 and newer): `pdl_options` gives each launch its
two arguments.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import triton
import triton.language as tl

MIN_CAPABILITY = 9  # Hopper: griddepcontrol
TRITON_HAS_PDL = hasattr(triton.language.extra.cuda, "gdc_wait")  # and the launch_pdl option (Triton >= 3.4)
_active = False


@contextlib.contextmanager
def dependent_launches(active: bool = True) -> Iterator[None]:
    """Inside this block, launches on a capable CUDA device are programmatic dependent launches."""
    global _active
    before, _active = _active, active
    try:
        yield
    finally:
        _active = before


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= MIN_CAPABILITY


def pdl_options(device: torch.device) -> dict:
    """A launch's ``PDL`` constexpr and, where it is on, its ``launch_pdl`` option: on inside
    `dependent_launches` on a CUDA device of compute capability >= 9 with a Triton that has them, else off."""
    on = _active and TRITON_HAS_PDL and device.type == "cuda" and _capable(device.index if device.index is not None
                                                        else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """A PDL kernel's first statement (see the module docstring); nothing where ``PDL`` is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
