"""Checks shared by the tests of tokenfleet's own matmul kernels (attention/paged_cpu.cpp)."""

from __future__ import annotations

from collections.abc import Callable

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
