"""tokenfleet's int8 x int8 kernel (`tokenfleet::int8_linear`, attention/paged_cpu.cpp):
int8 weights (one scale per output row) times the activations quantized to int8 per
block of 32 (d = max |x| / 127), as llama.cpp's Q8_0 dot product. Checked against the
same arithmetic written in torch, against the exact product, for row independence, and
for its fallback to torch's kernel where it does not apply."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.model import quant
from tokenfleet.model.quant import VNNI_MAX_ROWS, quantize_int8

pytestmark = pytest.mark.skipif(
    not quant._vnni_possible(), reason="no AVX512-VNNI kernel on this CPU (or no compiler)"
)


def _case(rows: int, out: int, inp: int, seed: int = 0) -> tuple[torch.Tensor, quant.PackedWeight]:
    g = torch.Generator().manual_seed(seed)
    w = quantize_int8(torch.randn(out, inp, generator=g) * 0.05)
    x = torch.randn(rows, inp, generator=g) * torch.exp(torch.randn(rows, inp, generator=g))
    return x.bfloat16(), w  # activations with a long tail, as a layer's are


def _reference(x: torch.Tensor, w: quant.PackedWeight) -> torch.Tensor:
    """The kernel's arithmetic in torch: per block of 32, qx = round(x * (1/d)) (ties to
    even), integer dot products with the weight, times d, summed, times the row scale."""
    rows, inp = x.shape
    xb = x.float().view(rows, inp // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    qx = torch.round(xb * inv[..., None]).clamp(-127, 127).double()
    wq = w.data.double().view(w.out_features, inp // 32, 32)
    dots = torch.einsum("mbk,nbk->mnb", qx, wq)  # exact integers
    y = (dots * d.double()[:, None, :]).sum(-1) * w.scales.double()[None, :]
    return y.float()


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize(("out", "inp"), [(960, 576), (576, 1536), (200, 64)])
def test_the_kernel_computes_the_q8_dot_product(rows: int, out: int, inp: int) -> None:
    x, w = _case(rows, out, inp)
    got = torch.ops.tokenfleet.int8_linear(x, w.data, w.scales).float()
    want = _reference(x, w)
    scale = want.abs().max()
    # the same integers and scales: only float32 summation order and the bf16 output
    assert float((got - want).abs().max() / scale) < 8e-3
    assert float(((got - want).abs() / (want.abs() + 1e-3 * scale)).median()) < 4e-3
    # and the quantized activations cost what llama.cpp's Q8_0 costs: within 3 % of
    # the exact product's scale (torch's kernel, bf16 activations: ~0.3 %)
    exact = x.float() @ w.dequantize().t()
    assert float((got - exact).abs().max() / exact.abs().max()) < 3e-2


def test_a_row_gets_the_same_bits_alone_or_among_others() -> None:
    x, w = _case(11, 960, 576, seed=3)
    together = torch.ops.tokenfleet.int8_linear(x, w.data, w.scales)
    for i in range(11):
        alone = torch.ops.tokenfleet.int8_linear(x[i : i + 1], w.data, w.scales)
        assert torch.equal(alone[0], together[i]), i
    for m in (4, 5, 8):  # blocks of 4 rows and the rest
        assert torch.equal(torch.ops.tokenfleet.int8_linear(x[:m], w.data, w.scales), together[:m])


def test_where_it_does_not_apply_it_is_torchs_kernel() -> None:
    """An input width that is not a multiple of 64 (any row count is served)."""
    x, w = _case(2, 64, 96)
    got = torch.ops.tokenfleet.int8_linear(x, w.data, w.scales)
    assert torch.equal(got, torch.ops.aten._weight_int8pack_mm(x, w.data, w.scales))
    x, w = _case(VNNI_MAX_ROWS + 1, 64, 576)
    got = torch.ops.tokenfleet.int8_linear(x, w.data, w.scales)
    assert not torch.equal(got, torch.ops.aten._weight_int8pack_mm(x, w.data, w.scales))


def test_packed_int8_calls_take_it_up_to_16_rows_and_at_every_count_in_deterministic_mode() -> None:
    x, w = _case(40, 576, 576, seed=5)
    kernel = torch.ops.tokenfleet.int8_linear(x, w.data, w.scales)
    torchs = torch.ops.aten._weight_int8pack_mm(x, w.data, w.scales)
    assert not torch.equal(kernel, torchs)  # they round differently: the test can tell
    few = x[:VNNI_MAX_ROWS]
    quant.set_int8_vnni(True)
    try:
        assert torch.equal(w.matmul(few), kernel[:VNNI_MAX_ROWS])
        # above 16 rows the dequantized dense matmul, except in deterministic mode,
        # where every row count runs the kernel, so a row rounds alike in any batch
        assert not torch.equal(w.matmul(x), kernel)
        assert torch.equal(w.matmul(x, one_kernel=True), kernel)
        assert torch.equal(w.matmul(x[:1], one_kernel=True), kernel[:1])
        quant.set_int8_vnni(False)
        assert torch.equal(w.matmul(few), torchs[:VNNI_MAX_ROWS])
        assert torch.equal(w.matmul(x, one_kernel=True), torchs)
    finally:
        quant.set_int8_vnni(None)
