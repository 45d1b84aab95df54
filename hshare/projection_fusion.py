"""The attention's query, key and value projections as one weight product inside a recorded decode step.

At decode a weight product reads its whole weight for a few rows: it is bound by memory, and a small
one by the ramp of its launch. At Llama-3-8B's shape the key and value projections (8 MiB each)
stream at under half the rate of the MLP's products (`benchmarks/RESULTS.md`, the weight products of a
decode step). One product over the three weights stacked reads the same bytes in one launch, as
gpt-fast's ``wqkv`` and vLLM's ``QKVParallelLinear`` do.

* **Storage.** `QKVGroup.stack` moves an attention's three weights (and biases) into one
  ``[Nq + Nk + Nv, K]`` tensor and points each parameter's ``.data`` at its rows. The parameters stay
  the same objects with the same values; no second copy is kept. A parameter moved or replaced later
  (``model.to(...)``, a new ``weight``) no longer lies in the stacked tensor: `QKVGroup.stacked` sees
  it and the next generate stacks again. Writes into a parameter (``load_state_dict``, ``copy_``) land
  in the stacked tensor.
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
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> its QKVGroup


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

    def stacked(self) -> bool:
        """Whether every weight (and bias) is still its rows of the stacked tensors."""
        if self.weight is None:
            return False
        for index, projection in enumerate(self.projections):
            start, end = self.bounds[index], self.bounds[index + 1]
            pairs = [(projection.weight, self.weight[start:end])]
            if (projection.bias is None) != (self.bias is None):
                return False
            if projection.bias is not None:
                pairs.append((projection.bias, self.bias[start:end]))
            for parameter, rows in pairs:
                if (parameter.dtype != rows.dtype or parameter.device != rows.device or parameter.shape != rows.shape
                        or parameter.stride() != rows.stride() or parameter.data_ptr() != rows.data_ptr()):
                    return False
        return True

    def stack(self) -> None:
        """Move the three weights (and biases) into the stacked tensors, unless they are there already.
        Transient memory: one attention's q/k/v weights once more."""
        if self.stacked():
            return
        with torch.no_grad():
            self.weight = torch.cat([p.weight.data for p in self.projections])
            biased = self.projections[0].bias is not None
            self.bias = torch.cat([p.bias.data for p in self.projections]) if biased else None
            for index, projection in enumerate(self.projections):
                start, end = self.bounds[index], self.bounds[index + 1]
                projection.weight.data = self.weight[start:end]
                if biased:
                    projection.bias.data = self.bias[start:end]

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
        groups: one `QKVGroup` per attention module that qualifies (`unfusable`), kept across
            generates (the stacked tensors live as long as the module).
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
                continue
            group = _GROUPS.get(module)
            if group is None or group.projections != tuple(getattr(module, name) for name in PROJECTIONS):
                group = _GROUPS[module] = QKVGroup(tuple(getattr(module, name) for name in PROJECTIONS))
            self.groups.append(group)
        self.reason = "" if self.groups else (reasons[0] if reasons else "no attention module with q_proj, k_proj "
                                                                            "and v_proj")

    def stack(self) -> None:
        """Stack every group's weights (a no-op for those still stacked); outside any capture."""
        for group in self.groups:
            group.stack()

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
