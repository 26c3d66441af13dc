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
