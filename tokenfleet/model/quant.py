"""Weights kept quantized: int8 per output channel, or int4 in groups of 32.

A decode step at a few rows reads every weight once and does little arithmetic
with it, so its time is the weight bytes over the memory bandwidth: halving the
bytes halves the step. Both formats run on tokenfleet's own kernels where the CPU has
AVX512-VNNI or AVX2 (`int_kernels`, attention/paged_cpu.cpp: the activations quantized
per block of 32 as llama.cpp's Q8_0 / Q8_1, bf16 or float32 in and out), else on
torch's, with bf16 activations (their fast path: with float32 activations torch's int8
is ~20x slower, 642 vs 30 us for SmolLM2's gate/up matrix at one row):

    int8  w = q * scale[out], q in [-127, 127]. With tokenfleet's kernels laid out 16
          output rows at a time (`int8_linear`); elsewhere torch's `_weight_int8pack_mm`
    int4  w = q * d[out, g] + m[out, g] for each group g of 32 input columns, q in
          [0, 15] (llama.cpp's Q4_1). With tokenfleet's kernels d and m kept in
          float16 (a GGUF file's values exactly), the nibbles laid out 16 output rows at
          a time (`q4_linear`: one instruction multiplies four inputs of 8 or 16 rows by
          four broadcast activation bytes); elsewhere torch's
          `_weight_int4pack_mm_for_cpu` (its private packed layout, scale d and zero
          m + 8d in bf16)

Measured here (SmolLM2-135M's 121 matrices in a row, 2 threads, bf16 13.8 ms):
int8 5.1 ms and int4 3.2 ms at one row, 10.7 / 7.0 ms at 8 rows (bf16 15.4); at 256
rows (a prefill chunk) they are 2.7x slower than bf16, see `PackedWeight.matmul`.
The int4 x int8 kernel against torch's int4 one, in SmolLM2 decode ticks on the Xeon
AMX (bench/tick_profile.py, 2026-12-04): 2.25 vs 3.61 ms of layer matmuls at one row,
5.07 vs 12.05 at 8 rows; the decode path's perplexity +0.11 % of fp32 there
(bench/default_quality.py).

Quantized from the dense weights at load, except where a GGUF file's matrices are
already llama.cpp Q4_0 / Q4_1 blocks (32 values, one scale, one offset: int4's
layout): `--quant int4` takes those as they are (`gguf.q4_fields`, `Q4Fields`),
exactly on tokenfleet's kernel (up to the bf16 rounding of the scales in torch's layout),
instead of quantizing the dequantized values a second time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

QuantKind = Literal["int8", "int4"]
QUANT_KINDS: tuple[QuantKind, ...] = ("int8", "int4")
INT4_GROUP = 32
# Rows up to which `_weight_int8pack_mm` beats dequantize + bf16 matmul (measured on
# SmolLM2's matrices, 2 threads: equal at 16 rows, 1.5x slower at 32, 2.7x at 256).
# The same bound serves tokenfleet's kernels (the rows16 layouts).
PACKED_MAX_ROWS = 16
_vnni: bool | None = None
_q4_blocks: bool | None = None


def int8_vnni() -> bool:
    """Whether int8 weights are packed from now on (16 output rows at a time) for
    `tokenfleet::int8_linear` (attention/paged_cpu.cpp): int8 weights times the
    activations quantized to int8 per block of 32, summed in integers, where torch's
    `_weight_int8pack_mm` widens every weight to bf16. On wherever the kernel builds
    (AVX512-VNNI or AVX2: `int_kernels`), unless `TOKENFLEET_INT8_VNNI=0` (the name is
    older than the AVX2 build); decided at packing, a weight keeps
    its layout. Calls of up to PACKED_MAX_ROWS rows run it; in deterministic mode
    (`one_kernel`) every row count does: a row's result depends on no other row (each
    row quantized on its own), and torch's kernel, which deterministic mode once fell
    back to, cost 0.66x of the mixed workload's tok/s on the Xeon AMX
    (bench/deterministic.py)."""
    global _vnni
    if _vnni is None:
        _vnni = os.environ.get("TOKENFLEET_INT8_VNNI", "1") != "0" and bool(int_kernels())
    return _vnni


def set_int8_vnni(on: bool | None) -> None:
    """Force the int8 layout for weights packed from now on (benchmarks, tests); None:
    decide again as at start."""
    global _vnni
    _vnni = None if on is None else (on and bool(int_kernels()))


def int4_blocks() -> bool:
    """Whether int4 weights are packed from now on in Q4_1 blocks laid out 16 rows at a
    time for `tokenfleet::q4_linear` (see `int8_vnni`), else in torch's layout for
    `_weight_int4pack_mm_for_cpu`. Decided at packing: a weight keeps its layout. Off
    with `TOKENFLEET_INT4_VNNI=0`."""
    global _q4_blocks
    if _q4_blocks is None:
        _q4_blocks = os.environ.get("TOKENFLEET_INT4_VNNI", "1") != "0" and bool(int_kernels())
    return _q4_blocks


def set_int4_blocks(on: bool | None) -> None:
    """Force the int4 layout for weights packed from now on (benchmarks, tests); None:
    decide again as at start."""
    global _q4_blocks
    _q4_blocks = None if on is None else (on and bool(int_kernels()))


def int_kernels() -> str:
    """Which build of tokenfleet's int8 / int4 kernels this CPU runs: "avx512-vnni",
    "avx2", or "" (no compiler, or neither instruction set: torch's kernels serve)."""
    from tokenfleet.model.attention import paged_cpu

    if not paged_cpu.load():
        return ""
    isa: str = torch.ops.tokenfleet.int_kernels()
    return isa


class QuantError(ValueError):
    """A weight that this format cannot hold (shape, dtype)."""


@dataclass(frozen=True)
class PackedWeight:
    """One linear layer's weight in a quantized format (see the module docstring).
    Each kind comes in two layouts, told apart by the scales' dtype (so compiled graphs,
    which see the tensors, specialise on it): 16 output rows at a time for tokenfleet's
    kernels (`rows16`: int8 with float32 scales, int4 with float16 ones) or torch's
    (bf16 scales)."""

    kind: QuantKind
    # int8: [out, in], or rows16 [out rounded up to 16, in]: for each group g of 16 rows
    # and step s of 4 inputs, 64 bytes, lane j holding row 16 g + j's inputs 4 s..4 s + 3.
    # int4 rows16: uint8 [out rounded up to 16, in / 2], for each group g of 16 rows,
    # block b of 32 inputs and step c of 8 inputs, 64 bytes: row 16 g + j's inputs 32 b +
    # 8 c + i (i < 4) in the low nibbles of bytes 4 j + i and 32 b + 8 c + 4 + i in their
    # high ones; or int4 in torch's packed layout
    data: Tensor
    # int8: bf16 [out], rows16 float32 [out rounded up to 16]; int4 rows16: float16 [2,
    # out rounded up / 16, in / 32, 16] (d, m); torch's int4: bf16 [in / 32, out, 2]
    # (d, m + 8 d)
    scales: Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        data = self.data.numel() * self.data.element_size()
        return data + self.scales.numel() * self.scales.element_size()

    @property
    def rows16(self) -> bool:
        """Laid out 16 output rows at a time for tokenfleet's kernels (`int8_linear`,
        `q4_linear`)."""
        wanted = torch.float32 if self.kind == "int8" else torch.float16
        return self.scales.dtype == wanted

    def matmul(self, x: Tensor, *, one_kernel: bool = False) -> Tensor:
        """x [T, in] bf16 or float32 -> x @ w.T [T, out] in x's dtype (torch's packed
        kernels get float32 activations rounded to bf16; tokenfleet's take either).

        The packed kernels win while a call reads more weight bytes than it does
        arithmetic: up to ~16 rows here. A longer int8 call (a prefill chunk)
        dequantizes the matrix to bf16 for that call and runs the dense matmul, 1.9x
        faster at 256 rows; int4 has no cheap way back to bf16 (torch keeps its packed
        layout private), so its prefill runs at the packed kernel's speed.
        int4 in blocks has its way back: above 16 rows it is dequantized for the call.
        `one_kernel` (deterministic mode): the packed kernel at every row count, since
        the two kernels round differently, so a row's result would depend on how many
        rows share its call."""
        if self.rows16:
            if x.shape[0] > PACKED_MAX_ROWS and not one_kernel:
                return torch.nn.functional.linear(x, self._dense(x.dtype))
            op = (
                torch.ops.tokenfleet.int8_linear
                if self.kind == "int8"
                else torch.ops.tokenfleet.q4_linear
            )
            xk = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()  # theirs
            yk: Tensor = op(xk, self.data, self.scales, self.out_features)
            return yk if xk is x else yk.to(x.dtype)
        if x.dtype != torch.bfloat16 and (self.kind == "int4" or x.shape[0] <= PACKED_MAX_ROWS):
            # torch's packed kernels' fast path is bf16 activations (with float32 ones int8
            # was 9.6x slower on an AVX2 EPYC Zen 3, ~20x on AVX-512: module docstring):
            # a float32 model rounds its activations to bf16 for the call
            return self.matmul(x.bfloat16(), one_kernel=one_kernel).to(x.dtype)
        if self.kind == "int8" and x.shape[0] > PACKED_MAX_ROWS and not one_kernel:
            dense = self.data.to(x.dtype) * self.scales[:, None]
            y: Tensor = torch.nn.functional.linear(x, dense)
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, INT4_GROUP, self.scales)
        return y

    def _dense(self, dtype: torch.dtype) -> Tensor:
        """A rows16 weight [out, in] in `dtype` for one dense call. int8 goes straight
        to `dtype` (q and the bf16-valued scales are exact there, their product rounded
        once: the bits `dequantize().to(dtype)` gives, without its float32 copy)."""
        if self.kind == "int8":
            n = self.out_features
            return self._int8_rows().to(dtype) * self.scales[:n, None].to(dtype)
        return self.dequantize().to(dtype)

    def _int8_rows(self) -> Tensor:
        """A rows16 int8 weight's q [out, in], back in row order."""
        rows, inp = self.data.shape
        q = self.data.view(rows // 16, inp // 4, 16, 4).permute(0, 2, 1, 3)
        return q.reshape(rows, inp)[: self.out_features]

    def dequantize(self) -> Tensor:
        """The float32 weight [out, in] these bytes stand for: exact for int8 and for int4
        in blocks; int4 in torch's layout is read back through its kernel (torch keeps
        that layout private), so each value is rounded to bf16."""
        if self.kind == "int8" and self.rows16:
            w8: Tensor = self._int8_rows().float() * self.scales[: self.out_features, None]
            return w8
        if self.kind == "int8":
            return self.data.float() * self.scales.float()[:, None]
        if self.rows16:
            rows, blocks = self.data.shape[0], self.in_features // INT4_GROUP
            nib = self.data.view(rows // 16, blocks, 4, 16, 1, 4)
            q = torch.cat([nib & 0x0F, nib >> 4], dim=4)  # [G, b, c, j, h, i]
            q = q.permute(0, 3, 1, 2, 4, 5).reshape(rows, blocks, INT4_GROUP).float()
            d, m = (s.permute(0, 2, 1).reshape(rows, blocks) for s in self.scales.float())
            w: Tensor = q * d[..., None] + m[..., None]
            return w.view(rows, self.in_features)[: self.out_features]
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.data.device)
        return self.matmul(eye).float().t().contiguous()


def quantize_int8(w: Tensor) -> PackedWeight:
    """Symmetric per-output-channel int8 of a dense [out, in] weight."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    scale = scale.bfloat16().float()  # quantize against the scale the kernel will use
    q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
    out, inp = w.shape
    if int8_vnni() and inp % 32 == 0:  # 16 rows at a time (see `PackedWeight`)
        rows = -(-out // 16) * 16
        q = torch.nn.functional.pad(q, (0, 0, 0, rows - out))
        scale = torch.nn.functional.pad(scale, (0, rows - out))
        data = q.view(rows // 16, 16, inp // 4, 4).permute(0, 2, 1, 3).reshape(rows, inp)
        return PackedWeight("int8", data.contiguous(), scale.contiguous(), out, inp)
    return PackedWeight("int8", q.contiguous(), scale.bfloat16(), out, inp)


def quantize_int4(w: Tensor) -> PackedWeight:
    """Asymmetric int4 in groups of 32 input columns (min/max per group)."""
    out, inp = w.shape
    if inp % INT4_GROUP:
        raise QuantError(f"int4 needs in_features divisible by {INT4_GROUP}, got {inp}")
    g = w.detach().float().view(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [out, groups]
    scale = ((hi - lo) / 15.0).clamp(min=1e-12).bfloat16().float()
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return _pack_int4(q.view(out, inp).to(torch.int32), scale, lo)  # w = q * scale + lo


def from_q4_blocks(d: Tensor, m: Tensor | None, q: Tensor) -> PackedWeight:
    """llama.cpp Q4_0 (m None: w = (q - 8) * d) or Q4_1 (w = q * d + m) blocks as they
    are: d, m [out, in / 32] float, q [out, in] ints in [0, 15]."""
    d = d.float()
    return _pack_int4(q.to(torch.int32), d, -8.0 * d if m is None else m.float())


@dataclass(frozen=True)
class Q4Fields:
    """llama.cpp Q4_0 / Q4_1 blocks unpacked: w = q * d + m, with d and m [rows, in / 32]
    and q [rows, in] in [0, 15] (Q4_0's w = (q - 8) * d is m = -8 d)."""

    d: Tensor
    m: Tensor
    q: Tensor

    @staticmethod
    def cat(parts: Sequence[Q4Fields]) -> Q4Fields:
        """Row blocks of several matrices stacked (q | k | v, gate | up)."""
        return Q4Fields(
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]),
            torch.cat([p.q for p in parts]),
        )

    def pack(self) -> PackedWeight:
        return from_q4_blocks(self.d, self.m, self.q)


def _pack_int4(q: Tensor, d: Tensor, m: Tensor) -> PackedWeight:
    """w = q * d + m: q [out, in] in [0, 15], d and m [out, in / 32]."""
    out, inp = q.shape
    if int4_blocks():  # Q4_1 blocks, 16 output rows at a time (see `PackedWeight`)
        rows, blocks = -(-out // 16) * 16, inp // INT4_GROUP
        pad = rows - out
        q, d, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d, m))
        # q[16 g + j, 32 b + 8 c + 4 h + i] -> byte (g, b, c, j, i), nibble h
        qv = q.to(torch.uint8).view(rows // 16, 16, blocks, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
        data = (qv[..., 0, :] | (qv[..., 1, :] << 4)).reshape(rows, inp // 2)
        dm = torch.stack([t.view(rows // 16, 16, blocks).permute(0, 2, 1) for t in (d, m)])
        return PackedWeight("int4", data.contiguous(), dm.half().contiguous(), out, inp)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    zero = m + 8.0 * d  # torch's kernel: w = (q - 8) * scale + zero
    scales = torch.stack([d.t(), zero.t()], dim=-1).bfloat16().contiguous()  # [G, out, 2]
    return PackedWeight("int4", packed, scales, out, inp)


def quantize(w: Tensor, kind: QuantKind) -> PackedWeight:
    if w.dim() != 2:
        raise QuantError(f"only matrices are quantized, got shape {tuple(w.shape)}")
    return quantize_int8(w) if kind == "int8" else quantize_int4(w)


class QuantLinear(nn.Module):
    """A linear layer whose weight is a `PackedWeight` (kept as buffers, so the model's
    byte count and `.to()` see it); the bias, if any, stays dense."""

    def __init__(self, packed: PackedWeight, bias: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qdata", packed.data)
        self.register_buffer("qscales", packed.scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kind = packed.kind
        self.in_features, self.out_features = packed.in_features, packed.out_features

    @property
    def packed(self) -> PackedWeight:
        data, scales = self.get_buffer("qdata"), self.get_buffer("qscales")
        return PackedWeight(self.kind, data, scales, self.out_features, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        y = self.packed.matmul(x)
        return y if self.bias is None else y + self.bias


def weight_of(module: nn.Module) -> Tensor | PackedWeight:
    """A projection's weight for the layer math: packed for a `QuantLinear`."""
    if isinstance(module, QuantLinear):
        return module.packed
    weight = module.weight
    assert isinstance(weight, Tensor)
    return weight


def resident_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer, each tensor counted once (a tied head)."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
