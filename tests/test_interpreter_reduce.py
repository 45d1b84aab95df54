"""The interpreter's tree-shaped `tl.reduce` (`interpreter_reduce`, installed by conftest) against numpy and against
the interpreter's own element-by-element reduction, on fresh random blocks: a tuple combine over each axis, over all
axes, with and without keep_dims."""

import os

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")]

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _count_min_max(count_a, low_a, high_a, count_b, low_b, high_b):
    return count_a + count_b, tl.minimum(low_a, low_b), tl.maximum(high_a, high_b)


@triton.jit
def _reduce_kernel(x_ptr, count_ptr, low_ptr, high_ptr, pivot, AXIS: tl.constexpr, KEEP: tl.constexpr,
                   ROWS: tl.constexpr, COLS: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offsets)
    above = x >= pivot
    operands = (above.to(tl.int32), tl.where(above, x, 2147483647), tl.where(above, -2147483648, x))
    if AXIS == 0:
        count, low, high = tl.reduce(operands, 0, _count_min_max, keep_dims=KEEP)
        out = tl.arange(0, COLS)[None, :] if KEEP else tl.arange(0, COLS)
    elif AXIS == 1:
        count, low, high = tl.reduce(operands, 1, _count_min_max, keep_dims=KEEP)
        out = tl.arange(0, ROWS)[:, None] if KEEP else tl.arange(0, ROWS)
    else:
        count, low, high = tl.reduce(operands, None, _count_min_max, keep_dims=KEEP)
        out = tl.zeros((1, 1), tl.int32) if KEEP else 0
    tl.store(count_ptr + out, count)
    tl.store(low_ptr + out, low)
    tl.store(high_ptr + out, high)


def _run(x: torch.Tensor, pivot: int, axis, keep: bool):
    size = {0: x.shape[1], 1: x.shape[0], None: 1}[axis]
    outs = [torch.empty(size, dtype=torch.int32) for _ in range(3)]
    _reduce_kernel[(1,)](x, *outs, pivot, AXIS=-1 if axis is None else axis, KEEP=keep, ROWS=x.shape[0],
                         COLS=x.shape[1])
    return outs


@pytest.mark.parametrize("axis", [0, 1, None])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("shape", [(1, 16), (8, 4), (4, 64)])
def test_tree_reduce_equals_numpy_and_the_element_by_element_reduction(axis, keep, shape):
    from triton.runtime.interpreter import ReduceOps

    import interpreter_reduce

    x = torch.randint(-50, 50, shape, dtype=torch.int32)
    pivot = int(torch.randint(-60, 60, ()))
    tree = _run(x, pivot, axis, keep)
    assert interpreter_reduce.ELEMENT_BY_ELEMENT is not None, "conftest did not install the tree reduction"
    values, above = x.numpy(), x.numpy() >= pivot
    expected = [above.sum(axis=axis), np.where(above, values, 2**31 - 1).min(axis=axis),
                np.where(above, -2**31, values).max(axis=axis)]
    for got, want in zip(tree, expected):
        np.testing.assert_array_equal(got.numpy(), np.asarray(want, dtype=np.int32).reshape(-1))
    if axis is None:  # the interpreter's own reduces only the first operand of a tuple over all axes
        return
    tree_reduce = ReduceOps.generic_reduce
    try:  # the interpreter's own element-by-element reduction gives the same
        ReduceOps.generic_reduce = interpreter_reduce.ELEMENT_BY_ELEMENT
        own = _run(x, pivot, axis, keep)
    finally:
        ReduceOps.generic_reduce = tree_reduce
    for got, want in zip(tree, own):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
