"""tokenfleet's int8 x int8 kernel (`tokenfleet::int8_linear`, attention/paged_cpu.cpp):
int8 weights (one scale per output row), laid out 16 output rows at a time, times the
activations quantized to int8 per block of 32 (d = max |x| / 127), as llama.cpp's Q8_0
dot product. Checked against the same arithmetic written in torch, against the exact
product, for row independence at any row count, for output counts that leave a short
last group of 16, and through `PackedWeight` (which layout int8 weights get, and which
kernel a call of how many rows runs)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.helpers.kernels import (
    assert_bad_inputs_named,
    assert_float32_kept,
    assert_rows_independent,
)
from tokenfleet.model import quant
from tokenfleet.model.quant import PACKED_MAX_ROWS, quantize_int8

pytestmark = pytest.mark.skipif(
    not quant.int_kernels(), reason="no AVX2 or AVX512-VNNI kernel on this CPU (or no compiler)"
)


@pytest.fixture(autouse=True)
def rows16_layout() -> Iterator[None]:
    quant.set_int8_vnni(True)
    yield
    quant.set_int8_vnni(None)


class Case:
    """A weight quantized in both layouts (the same q and scales), and activations with a
    long tail, as a layer's are."""

    def __init__(self, rows: int, out: int, inp: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        dense = torch.randn(out, inp, generator=g) * 0.05
        x = torch.randn(rows, inp, generator=g) * torch.exp(torch.randn(rows, inp, generator=g))
        self.x = x.bfloat16()
        self.w = quantize_int8(dense)
        quant.set_int8_vnni(False)
        self.torchs = quantize_int8(dense)  # q [out, in], bf16 scales
        quant.set_int8_vnni(True)

    def kernel(self, x: torch.Tensor | None = None) -> torch.Tensor:
        w = self.w
        return torch.ops.tokenfleet.int8_linear(
            self.x if x is None else x, w.data, w.scales, w.out_features
        )

    def reference(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel's arithmetic in torch: per block of 32, qx = round(x * (1/d)) (ties
        to even), integer dot products with the weight, times d, summed, times the row
        scale."""
        x = self.x if x is None else x
        rows, inp = x.shape
        xb = x.float().view(rows, inp // 32, 32)
        d = xb.abs().amax(-1) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        qx = torch.round(xb * inv[..., None]).clamp(-127, 127).double()
        t = self.torchs
        wq = t.data.double().view(t.out_features, inp // 32, 32)
        dots = torch.einsum("mbk,nbk->mnb", qx, wq)  # exact integers
        y = (dots * d.double()[:, None, :]).sum(-1) * t.scales.double()[None, :]
        return y.float()


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 21])
@pytest.mark.parametrize(
    ("out", "inp"),
    [(960, 576), (576, 1536), (200, 64), (5, 96), (64, 32)],  # 200 / 5: a short last group
)
def test_the_kernel_computes_the_q8_dot_product(rows: int, out: int, inp: int) -> None:
    c = Case(rows, out, inp)
    assert c.w.rows16 and c.w.scales.dtype == torch.float32 and not c.torchs.rows16
    # both layouts hold the same weights, exactly
    assert torch.equal(c.w.dequantize(), c.torchs.dequantize())
    got = c.kernel().float()
    assert got.shape == (rows, out)
    want = c.reference()
    scale = want.abs().max()
    # the same integers and scales: only float32 summation order and the bf16 output
    assert float((got - want).abs().max() / scale) < 8e-3
    assert float(((got - want).abs() / (want.abs() + 1e-3 * scale)).median()) < 4e-3
    # and the quantized activations cost what llama.cpp's Q8_0 costs: within 3 % of
    # the exact product's scale (6 % at 32-96 inputs, where fewer roundings average out)
    exact = c.x.float() @ c.w.dequantize().t()
    limit = 3e-2 if inp >= 576 else 6e-2
    assert float((got - exact).abs().max() / exact.abs().max()) < limit


def test_a_row_gets_the_same_bits_alone_or_among_others_at_any_row_count() -> None:
    c = Case(37, 968, 576, seed=3)  # 968: a last group of 8 rows
    assert_rows_independent(c.kernel, c.x)


def test_float32_activations_are_quantized_as_they_are() -> None:
    c = Case(21, 200, 576, seed=7)
    assert_float32_kept(c.kernel, c.reference, c.x)


def test_bad_shapes_and_types_are_named() -> None:
    c = Case(2, 64, 128)
    op = torch.ops.tokenfleet.int8_linear
    assert_bad_inputs_named(
        op, c.x, c.w.data, c.w.scales, "x bf16 or float32, w int8, scales float32"
    )


def test_packed_int8_calls_take_it_up_to_16_rows_and_at_every_count_in_deterministic_mode() -> None:
    c = Case(40, 576, 576, seed=5)
    w, x = c.w, c.x
    kernel = c.kernel()
    dense = torch.nn.functional.linear(x, w.dequantize().bfloat16())
    assert not torch.equal(kernel, dense)  # they round differently: the test can tell
    assert torch.equal(w.matmul(x[:PACKED_MAX_ROWS]), kernel[:PACKED_MAX_ROWS])
    # above 16 rows the dequantized dense matmul, except in deterministic mode, where
    # every row count runs the kernel, so a row rounds alike in any batch
    assert torch.equal(w.matmul(x), dense)
    assert torch.equal(w.matmul(x, one_kernel=True), kernel)
    assert torch.equal(w.matmul(x[:1], one_kernel=True), kernel[:1])
    # float32 activations go in as they are and come back float32, unrounded: the bf16
    # output is the same sums rounded
    y32 = w.matmul(x[:3].float())
    assert y32.dtype == torch.float32 and torch.equal(y32.bfloat16(), kernel[:3])
    assert not torch.equal(y32, kernel[:3].float())
    # torch's layout runs torch's kernel
    t = c.torchs
    torchs = torch.ops.aten._weight_int8pack_mm(x[:PACKED_MAX_ROWS], t.data, t.scales)
    assert torch.equal(t.matmul(x[:PACKED_MAX_ROWS]), torchs)


def test_a_width_the_kernel_cannot_take_keeps_torchs_layout() -> None:
    w = quantize_int8(torch.randn(64, 48))  # 48 inputs: not whole blocks of 32
    assert not w.rows16 and w.data.shape == (64, 48)
