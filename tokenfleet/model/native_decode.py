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
from tokenfleet.model.quant import PackedWeight
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
        self._stack = torch.classes.tokenfleet.DecodeStack(
            weights,
            kinds,
            windows,
            model.norm.weight.contiguous(),
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
        """Every seq one new token (a decode): logits [B, vocab]; K/V written to `kv`."""
        m = self._model
        tables, pos, slots = decode_rows(seqs, kv.block_size)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        x = torch.nn.functional.embedding(ids, m.embed_tokens.weight)
        if m.config.embed_scale is not None:  # rounded to the model dtype, as the reference
            x = x * torch.tensor(m.config.embed_scale, dtype=x.dtype)
        cos, sin = rope_cos_sin(m._inv_freq, pos, m.dtype)
        wcos, wsin = cos, sin
        if m._inv_freq_local is not None:
            wcos, wsin = rope_cos_sin(m._inv_freq_local, pos, m.dtype)
        flat = (kv.num_layers, kv.num_slots, kv.num_kv_heads, kv.head_dim)
        normed: Tensor = self._stack.run(
            x,
            cos,
            sin,
            wcos,
            wsin,
            kv.k.view(flat),
            kv.v.view(flat),
            tables,
            pos,
            slots,
            kv.block_size,
        )
        lm_head = m.head_weight(self.narrow, normed.shape[0])
        return linear(normed, lm_head, None, m.shape).float()
