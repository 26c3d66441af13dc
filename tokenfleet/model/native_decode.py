"""A decode tick's layers in one C++ call: the native decode stack.

The compiled decode graph (`decode_graph.py`) turns a tick into ~290 calls from
generated code: a fused loop per norm, rope or activation, each int4 / int8 / attention
kernel through the dispatcher with its output buffer, dynamo's guards around it all. On
SmolLM2 that is 0.6-0.8 ms of a one-row tick and 1.2-1.55 ms of an eight-row one that
are neither matmul nor attention (bench/tick_profile.py, EPYC Zen 4). `DecodeStack`
(`attention/paged_cpu.cpp`) runs the same layers as one loop in C++: the pointwise work
in plain loops on the calling thread, the matmul and paged-attention kernels called
directly, each layer's new K/V written straight into the pool before its attention reads
it. The weights are bound once, when the stack is built.

A tick is one call from token ids to float32 logits (`DecodeStack.decode`): the
embedding, each row's rope values taken from a table by position (`RopeTable`), the
layers, and the LM head writing float32 values already rounded as its bf16 result's
`.float()` would be. Done in Python around the layers' call, the embedding, rope, head
call and float copy took 0.2 ms of a one-row tick and 0.4 of an eight-row one on an
EPYC Zen 4; the bits are the same either way (tests/test_native_decode.py).

It serves the decode ticks of every family tokenfleet loads (Llama / SmolLM2, Mistral,
Qwen2's projection biases, Qwen3's q/k norms, Gemma 3's float32-scaled norms, output
norms, query scale, GeGLU and sliding-window layers) for a bf16 or a float32 model (what
a default start serves on a CPU without bf16) on the CPU, with dense weights in the
model's dtype or int8 / int4 ones in tokenfleet's 16-row layouts; `unsupported()` says
why not for any other (weights in torch's packed layout, the deterministic mode's row
tiles), which keeps the compiled decode graph. Its arithmetic is the eager forward's op
by op (`layers.py`: float32 inside an op, bf16 between ops for a bf16 model), so nothing
is compiled for it: the worker starts without the decode graph's minutes of compiling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tokenfleet.model.attention import paged_cpu
from tokenfleet.model.layers import AttnWeights, MlpWeights, linear
from tokenfleet.model.quant import PACKED_MAX_ROWS, PackedWeight
from tokenfleet.model.rope import rope_cos_sin
from tokenfleet.model.tick_inputs import SeqInput, decode_rows

if TYPE_CHECKING:
    from tokenfleet.model.kv_pool import KVPool
    from tokenfleet.model.llama import LlamaModel

# the kernels a projection runs on, as DecodeStack numbers them
_DENSE, _INT8, _INT4 = 0, 1, 2


def _kind(w: Tensor | PackedWeight, dtype: torch.dtype) -> int | str:
    """A projection's kernel in the stack, or why it has none."""
    if isinstance(w, Tensor):
        return _DENSE if w.dtype == dtype else f"a dense {w.dtype} weight in a {dtype} model"
    if not w.rows16:
        return f"{w.kind} weights in torch's packed layout"
    return _INT8 if w.kind == "int8" else _INT4


def unsupported(model: LlamaModel, narrow: bool) -> str | None:
    """Why the stack cannot run `model`'s decode ticks on its dense or narrow weight set
    (None: it can)."""
    shape = model.shape
    if model.device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float32):
        return (
            f"a bf16 or float32 model on the CPU only (this one: {model.dtype} on {model.device})"
        )
    if shape.row_tile or shape.min_rows or shape.one_kernel:
        return "deterministic row tiles run eagerly"
    embed = model.embed_tokens.weight
    if embed.dtype != model.dtype or embed.dim() != 2:
        return f"an embedding in {embed.dtype}, not the model's {model.dtype}"
    if not paged_cpu.load():
        return f"the C++ kernels did not build: {paged_cpu.failure()}"
    for attn_w, mlp_w in model.layer_weights(narrow):
        for w in (attn_w.qkv, mlp_w.o, mlp_w.gate_up, mlp_w.down):
            kind = _kind(w, model.dtype)
            if isinstance(kind, str):
                return kind
    return None


def _parts(w: Tensor | PackedWeight) -> list[Tensor]:
    """A projection as the stack takes it: its matrix and its scales (empty if dense)."""
    if isinstance(w, Tensor):
        return [w.contiguous(), _NONE]
    return [w.data.contiguous(), w.scales.contiguous()]


def _opt(t: Tensor | None) -> Tensor:
    """An optional vector (a bias, a norm weight) as the stack takes it: empty if none."""
    return _NONE if t is None else t.contiguous()


_NONE = torch.empty(0)


def _layer(attn_w: AttnWeights, mlp_w: MlpWeights) -> list[Tensor]:
    """One layer's tensors in `DecodeStack`'s order (its constructor names them)."""
    return [
        attn_w.norm.contiguous(),
        *_parts(attn_w.qkv),
        _opt(attn_w.qkv_bias),
        _opt(attn_w.q_norm),
        _opt(attn_w.k_norm),
        *_parts(mlp_w.o),
        _opt(mlp_w.o_bias),
        _opt(mlp_w.attn_out_norm),
        mlp_w.norm.contiguous(),
        *_parts(mlp_w.gate_up),
        _opt(mlp_w.gate_up_bias),
        *_parts(mlp_w.down),
        _opt(mlp_w.down_bias),
        _opt(mlp_w.mlp_out_norm),
    ]


class RopeTable:
    """cos / sin rows for positions 0 .. P - 1 (`rope_cos_sin` over all of them, which
    gives each row the values it computes for that position alone, whatever the others:
    tests/test_native_decode.py checks it), grown by doubling when a tick's position
    passes the end, so a tick takes its rows by index instead of computing them."""

    def __init__(self, inv_freq: Tensor, dtype: torch.dtype, rows: int = 1024) -> None:
        self._inv_freq = inv_freq
        self._dtype = dtype
        self.cos, self.sin = self._compute(rows)

    def _compute(self, rows: int) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self._inv_freq, torch.arange(rows), self._dtype)

    def cover(self, last: int) -> None:
        """Rows up to position `last` at least."""
        rows = self.cos.shape[0]
        if last >= rows:
            while rows <= last:
                rows *= 2
            self.cos, self.sin = self._compute(rows)


class NativeDecode:
    """Whole decode ticks of one weight set through `DecodeStack` (module docstring)."""

    def __init__(self, model: LlamaModel, *, narrow: bool) -> None:
        why = unsupported(model, narrow)
        if why is not None:
            raise ValueError(f"the native decode stack cannot serve this model: {why}")
        cfg = model.config
        weights: list[Tensor] = []
        kinds: list[int] = []
        for attn_w, mlp_w in model.layer_weights(narrow):
            assert isinstance(attn_w, AttnWeights) and isinstance(mlp_w, MlpWeights)
            weights += _layer(attn_w, mlp_w)
            ws = (attn_w.qkv, mlp_w.o, mlp_w.gate_up, mlp_w.down)
            kinds += [int(_kind(w, model.dtype)) for w in ws]
        windows = [cfg.window_of(i) or 0 for i in range(cfg.num_layers)]
        s = model.shape
        self.narrow = narrow
        self._model = model
        self._rope = RopeTable(model._inv_freq, model.dtype)
        local = model._inv_freq_local
        self._rope_local = self._rope if local is None else RopeTable(local, model.dtype)
        self._stack = torch.classes.tokenfleet.DecodeStack(
            weights,
            kinds,
            windows,
            model.norm.weight.contiguous(),
            model.embed_tokens.weight.contiguous(),
            float(cfg.embed_scale or 0.0),
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            cfg.hidden_size,
            s.intermediate_size,
            float(s.eps),
            s.gelu,
            s.scale_fp32,
            float(s.query_scale),
        )

    def serves(self, seqs: Sequence[SeqInput], narrow: bool) -> bool:
        """Whether a forward over `seqs` runs here: every seq a decode, on this set."""
        return narrow == self.narrow and all(s.num_new == 1 for s in seqs)

    @torch.inference_mode()
    def forward(
        self, input_ids: Tensor | Sequence[int], seqs: Sequence[SeqInput], kv: KVPool
    ) -> Tensor:
        """Every seq one new token (a decode): float32 logits [B, vocab]; K/V written to
        `kv`. One C++ call from the token ids to the logits where the stack takes the LM
        head (dense, or int8 / int4 in the 16-row layout); else the layers in one call
        and the head here."""
        m = self._model
        tables, pos, slots = decode_rows(seqs, kv.block_size)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        flat = (kv.num_layers, kv.num_slots, kv.num_kv_heads, kv.head_dim)
        rows = (kv.k.view(flat), kv.v.view(flat), tables, pos, slots, kv.block_size)
        lm_head = m.head_weight(self.narrow, ids.shape[0])
        head = _head(lm_head, m.dtype, ids.shape[0])
        if head is not None:
            last = max(s.start_pos for s in seqs)
            self._rope.cover(last)
            self._rope_local.cover(last)
            logits: Tensor = self._stack.decode(
                ids,
                self._rope.cos,
                self._rope.sin,
                self._rope_local.cos,
                self._rope_local.sin,
                *rows,
                *head,
            )
            return logits
        x = torch.nn.functional.embedding(ids, m.embed_tokens.weight)
        if m.config.embed_scale is not None:  # rounded to the model dtype, as the reference
            x = x * torch.tensor(m.config.embed_scale, dtype=x.dtype)
        cos, sin = rope_cos_sin(m._inv_freq, pos, m.dtype)
        wcos, wsin = cos, sin
        if m._inv_freq_local is not None:
            wcos, wsin = rope_cos_sin(m._inv_freq_local, pos, m.dtype)
        normed: Tensor = self._stack.run(x, cos, sin, wcos, wsin, *rows)
        return linear(normed, lm_head, None, m.shape).float()


def _head(
    w: Tensor | PackedWeight, dtype: torch.dtype, rows: int
) -> tuple[Tensor, Tensor, int, int] | None:
    """The LM head as `DecodeStack.decode` takes it (matrix, scales, kind, outputs) for a tick of
    `rows` rows, or None where its call is not one of the stack's kernels (a packed
    weight in torch's layout, or one `linear` would dequantize at this many rows)."""
    kind = _kind(w, dtype)
    if isinstance(kind, str) or (kind != _DENSE and rows > PACKED_MAX_ROWS):
        return None
    data, scales = _parts(w)
    return data, scales, kind, w.shape[0] if isinstance(w, Tensor) else w.out_features
