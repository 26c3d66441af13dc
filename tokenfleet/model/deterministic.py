"""Deterministic mode (`--deterministic`): a sequence's numbers do not depend on its batch.

By default a row's logits change, in the last bits, with what else runs in its tick,
with a prefix-cache hit and with a resume (which re-prefills what was decoded), and a
greedy or seeded job's tokens follow them. Measured on the CPU this was built on
(docs/operations.md, "Deterministic mode"), the causes are:

- attention: `scaled_dot_product_attention` gives a query other bits with another
  padded key length, another number of query rows, and decode rows that share a
  cached prefix take another path; fixed by `ExactBackend` (`attention/exact.py`);
- int8 weights: up to 16 rows run the packed kernel, more rows a dequantized bf16
  matmul, which rounds differently; fixed by the packed kernel at every row count
  (`LayerShape.one_kernel`);
- dense matmuls whose kernel depends on the row count. Where only a one-row call
  differs (bf16 on an AVX512-BF16 CPU without AMX: its matrix-vector kernel sums a
  long row, K = 1,536, in another order), calls of one row get a zero row added
  (`LayerShape.min_rows`); where the GEMM's blocking changes with M too (float32 here),
  each call is cut into tiles of exactly `ROW_TILE` rows (`LayerShape.row_tile`).
  Where the probe finds the kernel row-invariant as it is (bf16 on AVX2), nothing and
  no cost.

`make_deterministic` probes the model's own matrices for the last point (every probe
row alone, in prefixes and in shifted windows of a call, the rows' magnitudes spread
as activations are: rounding that differs only on some data shows on some rows) and
then checks the whole forward: a sequence's logits must be bitwise equal prefilled in
one chunk, in two chunks beside other sequences, and decoded beside longer contexts.
Where that fails (another CPU's kernels), it raises `DeterminismError` rather than
promise what it cannot keep.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tokenfleet.model.attention.exact import ExactBackend, bmm
from tokenfleet.model.layers import LayerShape, Weight, linear
from tokenfleet.model.quant import PackedWeight, weight_of
from tokenfleet.model.tick_inputs import SeqInput

if TYPE_CHECKING:
    from tokenfleet.model.llama import LlamaModel

ROW_TILE = 16
_PROBE_ROWS = 40  # rows of the probe input; calls of 1, 2, 3, 5, 8, 17 and 33 of them
_PREFIXES = (1, 2, 3, 5, 8, 17, 33)
_SHIFTS = (1, 7)


class DeterminismError(ValueError):
    """This machine's kernels cannot give batch-invariant results for this model."""


@dataclass(frozen=True)
class DeterminismReport:
    row_tile: int  # dense matmuls in calls of this many rows; 0: as they come
    min_rows: int  # ... or of at least this many (zero rows added); 0: as they come
    attention: str  # the attention backend
    probe_s: float  # the probe and the check at load

    def as_fields(self) -> dict[str, object]:
        return {"row_tile": self.row_tile, "min_rows": self.min_rows, "attention": self.attention}


# How dense matmuls are called, the cheapest first: as they come, one-row calls padded
# to two rows, fixed tiles, one row at a time.
_TILINGS = ((0, 0), (0, 2), (ROW_TILE, 0), (1, 0))


def row_invariant(fn: Callable[[Tensor], Tensor], x: Tensor) -> bool:
    """Whether fn's result for a row of x [R, in] is the same bits whatever other rows
    share the call: calls over every row alone, prefixes and shifted windows of x
    against one over all."""
    full = fn(x)
    return (
        all(torch.equal(fn(x[:m]), full[:m]) for m in _PREFIXES)
        and all(torch.equal(fn(x[s:]), full[s:]) for s in _SHIFTS)
        and all(torch.equal(fn(x[i : i + 1]), full[i : i + 1]) for i in range(x.shape[0]))
    )


def probe_rows(rows: int, width: int, g: torch.Generator, dtype: torch.dtype) -> Tensor:
    """[rows, width] inputs whose magnitudes spread over a few orders, as a layer's
    activations do (a long tail of large values): a kernel that sums in another order
    rounds to other bits on such rows far more often than on plain normal ones."""
    x = torch.randn(rows, width, generator=g)
    return (x * torch.exp(2 * torch.randn(rows, width, generator=g))).to(dtype)


def _matrices(model: LlamaModel) -> list[Weight]:
    """One of each projection (every layer has the same shapes) and the LM head."""
    attn, mlp = model.layer_weights()[0]
    return [attn.qkv, mlp.o, mlp.gate_up, mlp.down, weight_of(model.lm_head)]


def choose_tiling(model: LlamaModel) -> tuple[int, int]:
    """(row_tile, min_rows): the first of `_TILINGS` under which every dense matrix's
    kernel is row-invariant here; `DeterminismError` when none is, or when a quantized
    matrix's packed kernel is not."""
    g = torch.Generator().manual_seed(0)
    dense = [w for w in _matrices(model) if isinstance(w, Tensor)]
    for w in _matrices(model):
        if isinstance(w, PackedWeight):
            x = probe_rows(_PROBE_ROWS, w.in_features, g, model.dtype).to(model.device)
            if not row_invariant(functools.partial(w.matmul, one_kernel=True), x):
                raise DeterminismError(f"the {w.kind} kernel is not row-invariant here")
    inputs = [probe_rows(_PROBE_ROWS, w.shape[1], g, w.dtype).to(w.device) for w in dense]
    for tile, min_rows in _TILINGS:
        shape = dataclasses.replace(model.shape, row_tile=tile, min_rows=min_rows)
        if all(_invariant_linear(w, x, shape) for w, x in zip(dense, inputs, strict=True)):
            return tile, min_rows
    raise DeterminismError(f"no row tiling makes {model.dtype} matmuls row-invariant here")


def _invariant_linear(w: Tensor, x: Tensor, shape: LayerShape) -> bool:
    return row_invariant(lambda rows: linear(rows, w, None, shape), x)


def check_attention(model: LlamaModel, keys: int = 4096) -> None:
    """The exact backend's two products at the model's head shape: a decode row's (its
    G query heads) against the same query's in a 40-query chunk, over `keys` keys."""
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    heads = cfg.num_heads // cfg.num_kv_heads
    dev, dt = model.device, model.dtype  # drawn on the CPU, then moved
    q = probe_rows(heads * _PROBE_ROWS, cfg.head_dim, g, dt)[None].to(dev)  # [1, G*R, hd]
    k = torch.randn(1, keys, cfg.head_dim, generator=g).to(dev, dt)
    v = torch.randn(1, keys, cfg.head_dim, generator=g).to(dev, dt)
    p = torch.softmax(3 * torch.randn(1, heads * _PROBE_ROWS, keys, generator=g), -1)
    p = p.to(dev, dt)
    for name, a, b in (("q @ K", q, k.transpose(1, 2)), ("probs @ V", p, v)):
        full = bmm(a, b).view(heads, _PROBE_ROWS, -1)
        chunk = a.view(heads, _PROBE_ROWS, -1)
        for r in range(_PROBE_ROWS):
            if not torch.equal(bmm(chunk[None, :, r].contiguous(), b)[0], full[:, r]):
                raise DeterminismError(f"attention's {name} differs for a decode row here")


def make_deterministic(model: LlamaModel) -> DeterminismReport:
    """Switch `model` to batch-invariant numerics (before compiling it), then check them."""
    if model.compiled is not None:
        raise DeterminismError("switch deterministic mode on before compiling")
    started = time.perf_counter()
    model.attention = ExactBackend()
    model.shape = dataclasses.replace(model.shape, one_kernel=True)
    tile, min_rows = choose_tiling(model)
    model.shape = dataclasses.replace(model.shape, row_tile=tile, min_rows=min_rows)
    check_attention(model)
    check_forward(model)
    took = time.perf_counter() - started
    report = DeterminismReport(tile, min_rows, model.attention.name, took)
    model.deterministic = report
    return report


def check_forward(model: LlamaModel) -> None:
    """A sequence of 40 tokens: its logits at positions 24..39 prefilled in one chunk, in
    two chunks (0..23, 24..39) beside another sequence's chunk and decode rows, and at
    position 39 decoded beside a longer context, must be the same bits."""
    block = 16
    pool = model.new_kv_pool(12, block)
    vocab = model.config.vocab_size
    ids = [(37 * i + 11) % vocab for i in range(40)]
    other = [(53 * i + 5) % vocab for i in range(70)]
    a, b, c = [0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10]  # block tables
    want = model.forward(ids, [SeqInput(a, 0, 40)], pool, rows=range(24, 40))
    # B: 64 tokens, then A's second chunk beside B's decode and C's chunk (fresh KV for A)
    model.forward(other[:64], [SeqInput(b, 0, 64)], pool)
    model.forward(ids[:24], [SeqInput(c, 0, 24)], pool)
    mixed = [SeqInput(b, 64, 1), SeqInput(c, 24, 16), SeqInput(a, 0, 3)]
    got = model.forward([other[64], *ids[24:], *ids[:3]], mixed, pool, rows=range(1, 17))
    if not torch.equal(got, want):
        raise DeterminismError(
            f"{model.dtype}: a chunked prefill beside other rows changed a sequence's logits"
        )
    # C's last token again, as a decode step beside B's longer context
    decoded = model.forward(
        [ids[39], other[65]], [SeqInput(c, 39, 1), SeqInput(b, 65, 1)], pool, rows=[0]
    )
    if not torch.equal(decoded[0], want[-1]):
        raise DeterminismError(
            f"{model.dtype}: a decode step's logits differ from the same token's in a prefill"
        )
