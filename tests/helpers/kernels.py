"""Checks shared by the tests of tokenfleet's own matmul kernels (attention/paged_cpu.cpp)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor


def assert_rows_independent(kernel: Callable[[Tensor], Tensor], x: Tensor) -> None:
    """Each row of x gets the same bits alone as among all of them, and so does every
    leading slice whose row count takes the kernel's blocks of 8 and 4 rows and the rest."""
    together = kernel(x)
    for i in range(x.shape[0]):
        assert torch.equal(kernel(x[i : i + 1])[0], together[i]), i
    for m in (4, 5, 8, 9, 17, 33):
        if m <= x.shape[0]:
            assert torch.equal(kernel(x[:m]), together[:m]), m


def assert_float32_kept(
    kernel: Callable[[Tensor], Tensor], reference: Callable[[Tensor], Tensor], x: Tensor
) -> None:
    """A float32 model's activations (off the bf16 grid) are quantized from their float32
    values and the result kept in float32: the reference's arithmetic to float32's
    precision (where x rounded to bf16 is off by far more), and a row's bits its own."""
    x32 = x.float() * (1 + torch.rand(x.shape, generator=torch.Generator().manual_seed(0)) * 1e-3)
    got = kernel(x32)
    assert got.dtype == torch.float32
    want = reference(x32)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert float((kernel(x.bfloat16()).float() - want).abs().max() / want.abs().max()) > 1e-4
    assert_rows_independent(kernel, x32)


def assert_bad_inputs_named(
    op: Callable[..., Tensor], x: Tensor, data: Tensor, scales: Tensor, types: str
) -> None:
    """`op(x, data, scales, 64)` (x [2, 128], 64 outputs) refuses inputs of the wrong
    width, a wrong output count and a float16 x with errors that say what is wrong;
    `types` is what the op names as its input types."""
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(x[:, :96], data, scales, 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(x, data, scales, 65)
    with pytest.raises(RuntimeError, match=types):
        op(x.half(), data, scales, 64)
    assert op(x[:0], data, scales, 64).shape == (0, 64)
