"""tokenfleet's int4 x int8 kernel (`tokenfleet::q4_linear`, attention/paged_cpu.cpp): int4
weights as llama.cpp's Q4_1 blocks hold them (w = q * d + m per block of 32, float16 d
and m), laid out 16 output rows at a time, times the activations quantized to int8 per
block of 32 (d = max |x| / 127), as llama.cpp's Q4_1 x Q8_1 dot product. Checked against
the same arithmetic written in torch, against the exact product, for row independence at
any row count, for output counts that leave a short last group of 16, and through
`PackedWeight` (which layout int4 weights get, and which kernel a call of how many rows
runs)."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch

from tests.helpers.kernels import (
    assert_bad_inputs_named,
    assert_float32_kept,
    assert_rows_independent,
)
from tokenfleet.model import quant
from tokenfleet.model.quant import PACKED_MAX_ROWS, from_q4_blocks, quantize_int4

pytestmark = pytest.mark.skipif(
    not quant.int_kernels(), reason="no AVX2 or AVX512-VNNI kernel on this CPU (or no compiler)"
)


@pytest.fixture(autouse=True)
def blocks_layout() -> Iterator[None]:
    quant.set_int4_blocks(True)
    yield
    quant.set_int4_blocks(None)


class Case:
    """A Q4_1 weight built from known integers: q [out, in] in [0, 15], d and m [out, in /
    32] (float16 values, so the packed weight holds them exactly), and activations with a
    long tail, as a layer's are."""

    def __init__(self, rows: int, out: int, inp: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randint(0, 16, (out, inp), generator=g)
        self.d = (torch.rand(out, inp // 32, generator=g) * 0.01 + 1e-3).half().float()
        self.m = (torch.randn(out, inp // 32, generator=g) * 0.05).half().float()
        self.w = from_q4_blocks(self.d, self.m, self.q)
        x = torch.randn(rows, inp, generator=g) * torch.exp(torch.randn(rows, inp, generator=g))
        self.x = x.bfloat16()

    def kernel(self, x: torch.Tensor | None = None) -> torch.Tensor:
        w = self.w
        return torch.ops.tokenfleet.q4_linear(
            self.x if x is None else x, w.data, w.scales, w.out_features
        )

    def reference(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel's arithmetic in torch: per block of 32, qx = round(x * (1/dx)) (ties
        to even), exact integer dot products with q, then dx * (d * dot + m * sum qx)."""
        x = self.x if x is None else x
        rows, inp = x.shape
        groups = inp // 32
        xb = x.float().view(rows, groups, 32)
        dx = xb.abs().amax(-1) / 127.0
        inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
        qx = torch.round(xb * inv[..., None]).clamp(-127, 127).double()
        q = self.q.view(-1, groups, 32).double()
        dots = torch.einsum("mbk,nbk->mnb", qx, q)  # exact integers
        d, m = self.d.double(), self.m.double()
        y = dx.double()[:, None, :] * (d[None] * dots + m[None] * qx.sum(-1)[:, None, :])
        return y.sum(-1).float()


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 13, 16, 21])
@pytest.mark.parametrize(
    ("out", "inp"),
    [(960, 576), (576, 1536), (200, 64), (5, 96), (64, 32)],  # 200 / 5: a short last group
)
def test_the_kernel_computes_the_q4_1_times_q8_1_dot_product(rows: int, out: int, inp: int) -> None:
    c = Case(rows, out, inp)
    w = c.w
    assert w.rows16 and w.data.dtype == torch.uint8 and w.scales.dtype == torch.float16
    # the weight holds q * d + m exactly (float16 d and m, 4-bit q), whatever the layout
    want_w = (c.q.view(out, -1, 32) * c.d[..., None] + c.m[..., None]).view(out, inp)
    assert torch.equal(w.dequantize(), want_w)
    got = c.kernel().float()
    assert got.shape == (rows, out)
    want = c.reference()
    scale = want.abs().max()
    # the same integers and scales: only float32 summation order and the bf16 output
    assert float((got - want).abs().max() / scale) < 8e-3
    assert float(((got - want).abs() / (want.abs() + 1e-3 * scale)).median()) < 4e-3
    # and the quantized activations cost what llama.cpp's Q8_1 costs: within 3 % of the
    # exact product with the same int4 weights at a layer's widths (6 % at 32-96 inputs,
    # where fewer roundings average out)
    exact = c.x.float() @ want_w.t()
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
    op = torch.ops.tokenfleet.q4_linear
    assert_bad_inputs_named(op, c.x, c.w.data, c.w.scales, "x bf16 or float32, w uint8, dm float16")


def test_packed_int4_calls_take_it_up_to_16_rows_and_always_in_deterministic_mode() -> None:
    """Up to 16 rows the kernel; above, the weight dequantized for the call and a dense
    bf16 matmul; `one_kernel` (deterministic mode) the kernel at every row count. A
    float32 model's activations go in as they are and come back float32."""
    c = Case(40, 576, 576, seed=5)
    w, x = c.w, c.x
    kernel = c.kernel()
    dense = torch.nn.functional.linear(x, w.dequantize().bfloat16())
    assert not torch.equal(kernel, dense)  # they round differently: the test can tell
    assert torch.equal(w.matmul(x[:PACKED_MAX_ROWS]), kernel[:PACKED_MAX_ROWS])
    assert torch.equal(w.matmul(x), dense)
    assert torch.equal(w.matmul(x, one_kernel=True), kernel)
    # float32 activations go in as they are and come back float32, unrounded: the bf16
    # output is the same sums rounded
    y32 = w.matmul(x[:3].float())
    assert y32.dtype == torch.float32 and torch.equal(y32.bfloat16(), kernel[:3])
    assert not torch.equal(y32, kernel[:3].float())


def test_the_layout_follows_the_switch_and_both_hold_the_same_weights() -> None:
    w = torch.randn(48, 128) + torch.linspace(-2, 2, 128)
    blocks = quantize_int4(w)
    quant.set_int4_blocks(False)
    torchs = quantize_int4(w)
    assert blocks.rows16 and not torchs.rows16
    assert torchs.scales.dtype == torch.bfloat16 and blocks.nbytes == torchs.nbytes
    # the same q, d and m: torch's layout rounds d and m + 8 d to bf16, the blocks keep
    # them in float16
    a, b = blocks.dequantize(), torchs.dequantize()
    assert float((a - b).abs().max()) <= float(w.abs().max()) * 2**-7
    x = torch.randn(3, 128).bfloat16()
    ref = x.float() @ a.t()
    for p in (blocks, torchs):
        torch.testing.assert_close(
            p.matmul(x).float(), ref, atol=0.05 * float(ref.abs().max()), rtol=0
        )


def test_a_gguf_files_q4_1_blocks_are_kept_exactly() -> None:
    w = np.random.default_rng(1).standard_normal((16, 96)).astype(np.float32)
    q4 = gguf.GGMLQuantizationType.Q4_1
    blocks = gguf.quants.quantize(w, q4)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, q4).copy())
    raw = blocks.reshape(16, 3, 20)
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    qs = torch.from_numpy(raw[..., 4:].astype(np.int32))  # [16, 3, 16]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(16, 96)
    p = from_q4_blocks(d, m, q)
    assert p.rows16
    # llama.cpp's own values: its 4-bit q, its float16 d and m, the bytes as many
    assert p.nbytes == blocks.nbytes
    assert torch.equal(p.dequantize(), ref)
