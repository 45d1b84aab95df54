"""Which implementation of a hot operation runs: the Triton kernel or its plain-PyTorch twin.

CUDA tensors go to the Triton kernels (float64 excepted), everything else to the twins. ``HSHARE_KERNELS=torch``
forces the twins, ``HSHARE_KERNELS=triton`` the kernels (on CPU with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch


def kernel_mode() -> str:
    """``HSHARE_KERNELS``: auto (by device), torch (the twins) or triton (the Triton kernels)."""
    mode = os.environ.get("HSHARE_KERNELS", "auto")
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"HSHARE_KERNELS={mode!r} is invalid; accepted: auto, torch, triton")
    return mode


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s operation runs the Triton kernel: CUDA tensors of the kernels' dtypes (fp16, bf16,
    fp32); float64, which they do not compute, runs the twin (exact) wherever it lives."""
    mode = kernel_mode()
    return mode == "triton" or (mode == "auto" and tensor.is_cuda and tensor.dtype != torch.float64)


def use_fused(tensor: torch.Tensor) -> bool:
    """Whether a CUDA tensor goes to PyTorch's fused attention kernels (flash / memory-efficient,
    which return the LSE) rather than the plain-PyTorch twin (``HSHARE_KERNELS=torch`` forces it)."""
    return tensor.is_cuda and kernel_mode() != "torch"
