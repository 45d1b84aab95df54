"""A tree-shaped `tl.reduce` for Triton's interpreter, installed by `conftest.py` under ``TRITON_INTERPRET=1``.

The interpreter reduces with numpy where the combine is one of Triton's own (sum, min, max, argmin, argmax);
any other combine (the key search's fused count / min / max, `hshare.kernels.key_search_triton`) falls back to
calling the combine once per element, on 0-d tensors, which made such kernels most of the suite's time. This
reduces instead as the GPU does, by halves: ``log2(N)`` calls of the combine on whole blocks, the first half of
the axis with the second. A combine `tl.reduce` accepts is associative, so the result is the element-by-element
one up to the rounding of float sums (the GPU's order is a tree too). An axis whose length is not a power of two
(never a Triton block's) keeps the interpreter's own reduction.
"""

from __future__ import annotations

import numpy as np

ELEMENT_BY_ELEMENT = None  # the interpreter's own `ReduceOps.generic_reduce`, once `install` replaced it


def install() -> bool:
    """Replace the interpreter's element-by-element reduction by `tree_reduce`. Returns False, changing nothing,
    where the installed Triton's interpreter is not laid out as this expects (its own reduction then runs)."""
    global ELEMENT_BY_ELEMENT
    try:
        from triton.runtime.interpreter import ReduceOps
    except ImportError:
        return False
    element_by_element = getattr(ReduceOps, "generic_reduce", None)
    if element_by_element is None or not hasattr(ReduceOps, "to_tensor"):
        return False
    if ELEMENT_BY_ELEMENT is not None:  # installed already
        return True

    def generic_reduce(self, input):
        return tree_reduce(self, input, element_by_element)

    ELEMENT_BY_ELEMENT = element_by_element
    ReduceOps.generic_reduce = generic_reduce
    return True


def tree_reduce(self, input, fallback):
    """`ReduceOps.generic_reduce` by halves. `input`: the reduction's operand tensors (one shape);
    ``self.axis`` (None: all axes), ``self.keep_dims``, ``self.combine_fn`` as the interpreter gives them."""
    axis = 0 if self.axis is None else self.axis
    # the reduced axis first (every operand flattened where all axes reduce)
    data = [operand.handle.data.reshape(-1) if self.axis is None else np.moveaxis(operand.handle.data, axis, 0)
            for operand in input]
    length = data[0].shape[0]
    if length == 0 or length & (length - 1):
        return fallback(self, input)
    dtypes = [operand.dtype for operand in input]
    while data[0].shape[0] > 1:
        half = data[0].shape[0] // 2
        first = [self.to_tensor(np.ascontiguousarray(d[:half]), dtype) for d, dtype in zip(data, dtypes)]
        second = [self.to_tensor(np.ascontiguousarray(d[half:]), dtype) for d, dtype in zip(data, dtypes)]
        combined = self.combine_fn.fn(*first, *second)
        combined = combined if isinstance(combined, tuple) else (combined,)
        data = [np.broadcast_to(np.asarray(c.handle.data if hasattr(c, "handle") else c), d[:half].shape)
                for c, d in zip(combined, data)]
    out = []
    for d, dtype in zip(data, dtypes):
        reduced = d[0]
        if self.keep_dims:
            reduced = (np.expand_dims(reduced, axis) if self.axis is not None
                       else reduced.reshape((1,) * input[0].handle.data.ndim))
        elif self.axis is None:
            reduced = reduced.item()
        out.append(self.to_tensor(reduced, dtype))
    return out
