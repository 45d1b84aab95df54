"""The attention's query, key and value projections as one weight product inside a recorded decode step.

At decode a weight product reads its whole weight for a few rows: it is bound by memory, and a small
one, such as a GQA model's key and value projections, by the ramp of its launch (`benchmarks/decode_linear.py`
times them). One product over the three weights
stacked reads the same bytes in one launch, as gpt-fast's ``wqkv`` and vLLM's ``QKVParallelLinear`` do.

* **Storage.** For the duration of one ``generate`` (`QKVFusion.stack` at its first static decode step,
  `QKVFusion.unstack` when it ends), an attention's three weights (and biases) live in one
  ``[Nq + Nk + Nv, K]`` tensor and each parameter's ``.data`` is its rows: the parameters stay the same
  objects with the same values, and no second copy exists. Afterwards each parameter has its own storage
  again: outside a generate nothing of this layout lingers in the model (saved, moved, unpatched). Each
  move copies the weights once (milliseconds on a GPU; transient memory: one attention's q/k/v weights).
* **Product.** Inside `QKVFusion.active` (only around the recorded decode steps, as
  `hshare.elementwise_fusion`), the first of the three projections called with an input computes the
  stacked product; each returns its own columns of it (a view, unit stride on the features). A
  projection called with another input (e.g. cross-attention's keys) runs its own product.

Only plain ``nn.Linear`` projections of one dtype, device and input width, all with or all without
bias, with no hooks or instance ``forward`` (accelerate's offload, quantized or DTensor weights are
left alone). Nothing here knows of HShare.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn.functional as F

PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _plain_linear(module: object) -> bool:
    return (type(module) is torch.nn.Linear and "forward" not in vars(module) and not module._forward_hooks
            and not module._forward_pre_hooks and type(module.weight.data) is torch.Tensor)


def unfusable(attention: torch.nn.Module) -> str | None:
    """Why the module's q/k/v projections cannot be stacked, or None when they can."""
    projections = [getattr(attention, name, None) for name in PROJECTIONS]
    if not all(_plain_linear(p) for p in projections):
        return "its q_proj, k_proj and v_proj are not all plain nn.Linear modules without hooks"
    first = projections[0].weight
    if any(p.weight.dtype != first.dtype or p.weight.device != first.device or p.in_features != projections[0].in_features
           for p in projections):
        return "its q, k and v weights differ in dtype, device or input width"
    if len({p.bias is None for p in projections}) > 1:
        return "only some of its q, k and v projections have a bias"
    return None


class QKVGroup:
    """One attention module's query, key and value projections over one stacked weight.

    Args:
        projections: the ``(q_proj, k_proj, v_proj)`` modules (`unfusable` returned None for them).
    """

    def __init__(self, projections: tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear]) -> None:
        self.projections = projections
        self.weight: torch.Tensor | None = None  # [Nq + Nk + Nv, K]
        self.bias: torch.Tensor | None = None  # [Nq + Nk + Nv] or None
        self.bounds = [0]
        for projection in projections:
            self.bounds.append(self.bounds[-1] + projection.out_features)
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served: set[int] = set()

    def _rows(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each parameter (weights, then biases if any) with its rows of the stacked tensors."""
        for stacked, name in ((self.weight, "weight"), (self.bias, "bias")):
            if stacked is not None:
                for index, projection in enumerate(self.projections):
                    yield getattr(projection, name), stacked[self.bounds[index]:self.bounds[index + 1]]

    @staticmethod
    def _is(parameter: torch.Tensor, rows: torch.Tensor) -> bool:
        return (parameter.dtype == rows.dtype and parameter.device == rows.device and parameter.shape == rows.shape
                and parameter.stride() == rows.stride() and parameter.data_ptr() == rows.data_ptr())

    def stacked(self) -> bool:
        """Whether every weight (and bias) is its rows of the stacked tensors."""
        return self.weight is not None and all(self._is(parameter, rows) for parameter, rows in self._rows())

    def stack(self) -> None:
        """Move the three weights (and biases) into the stacked tensors (unless they are there already)."""
        if self.stacked():
            return
        self.weight = torch.cat([p.weight.data for p in self.projections])
        biased = self.projections[0].bias is not None
        self.bias = torch.cat([p.bias.data for p in self.projections]) if biased else None
        for parameter, rows in self._rows():
            parameter.data = rows

    def unstack(self) -> None:
        """Give each parameter still in the stacked tensors its own storage again (a copy of its rows), and
        drop the stacked tensors."""
        for parameter, rows in self._rows():
            if self._is(parameter, rows):
                parameter.data = rows.clone()
        self.weight = self.bias = None
        self.release()

    def project(self, index: int, module: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        """Projection `index`'s output ``[..., N_index]``: its columns of the stacked product of `hidden`
        (computed by the first of the three called with this very tensor), else its own product."""
        if hidden is not self._input:  # a new input: the stacked product, of which each takes its part once
            self._input, self._served = hidden, set()
            self._output = F.linear(hidden, self.weight, self.bias)
        elif index in self._served:  # the same projection again on one input: its own product
            return F.linear(hidden, module.weight, module.bias)
        self._served.add(index)
        out = self._output[..., self.bounds[index]:self.bounds[index + 1]]
        if len(self._served) == len(self.projections):
            self.release()
        return out

    def release(self) -> None:
        """Drop the held input and product (kept only until the three projections have taken their part)."""
        self._input = self._output = None
        self._served = set()


class QKVFusion:
    """The stackable q/k/v projections of one model (see the module docstring).

    Args:
        model: a transformers model whose attention modules have ``q_proj``, ``k_proj``, ``v_proj``.

    Attributes:
        groups: one `QKVGroup` per attention module that qualifies (`unfusable`).
        reason: why no module qualifies ("" when some do).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.groups: list[QKVGroup] = []
        reasons = []
        for module in model.modules():
            if not all(hasattr(module, name) for name in PROJECTIONS):
                continue
            reason = unfusable(module)
            if reason:
                reasons.append(f"{type(module).__name__}: {reason}")
            else:
                self.groups.append(QKVGroup(tuple(getattr(module, name) for name in PROJECTIONS)))
        self.reason = "" if self.groups else (reasons[0] if reasons else "no attention module with q_proj, k_proj "
                                                                            "and v_proj")

    def stack(self) -> None:
        """Stack every group's weights; outside any capture. The tensors are ordinary ones even under
        ``torch.inference_mode`` (the parameters must stay usable with autograd)."""
        with torch.inference_mode(False), torch.no_grad():
            for group in self.groups:
                group.stack()

    def unstack(self) -> None:
        """Every parameter back in its own storage (after the generate whose steps used the stacked ones)."""
        with torch.inference_mode(False), torch.no_grad():
            for group in self.groups:
                group.unstack()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside this block each group's projections take their columns of one stacked product."""
        for group in self.groups:
            for index, projection in enumerate(group.projections):
                projection.forward = functools.partial(group.project, index, projection)
        try:
            yield
        finally:
            for group in self.groups:
                group.release()
                for projection in group.projections:
                    del projection.forward
