"""The forward's row-wise parts compiled with `torch.compile`; attention stays eager.

An eager tick is ~50 small ops per layer (norms, rope, casts, splits, adds) around
the matmuls; at a few rows each one costs more in dispatch than in arithmetic.
Compiled, each stretch between two attentions (`layers.between`: the rest of layer
i and the start of layer i + 1) is one call into fused code: inductor's C++ loops on
CPU, Triton kernels on CUDA, the matmuls through the same BLAS.

Piecewise, as vLLM compiles: attention and the KV write run eagerly between the
compiled pieces, because they look at sequence boundaries and context lengths that
change every tick. Everything else is row-wise, so the pieces do not care whether a
row is a decode token or part of a prefill chunk: the batch dimension is compiled
dynamic, and one graph serves every tick size (a one-token tick gets its own graph:
torch specialises size 1). `mode="reduce-overhead"` on CUDA also records CUDA graphs
per tick size.

`compile_model` compiles and warms up (so the first job does not pay for it) and
says how long that took; inductor's on-disk cache makes a restart's warm-up cheaper.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor

from tokenfleet.model.decode_graph import DecodeGraph
from tokenfleet.model.layers import (
    AttnWeights,
    FieldSpec,
    LayerShape,
    MlpWeights,
    Weight,
    attn_in,
    attn_out_mlp,
    between,
    flatten_weights,
    head,
    unflatten_weights,
)
from tokenfleet.model.native_decode import NativeDecode, unsupported
from tokenfleet.model.quant import PackedWeight, weight_of
from tokenfleet.model.tick_inputs import SeqInput

# Each model compiled in this process adds its own specialisations (its shape, weight
# layout and a one-token graph) to the four shared functions; allow a few dozen.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

if TYPE_CHECKING:
    from tokenfleet.model.attention.layer import ForwardContext
    from tokenfleet.model.llama import LlamaModel

# torch specialises a dynamic size of 1, and ties sizes that happen to be equal when it
# compiles (duck shapes); a decode tick has one row (one stream) or one block of context
# (short ones) all the time, and each would be a compile of its own. The decode graph
# compiles under this (`compile_model`'s warm-up); calls need not.
size_oblivious = fx_config.patch(  # type: ignore[attr-defined]
    backed_size_oblivious=True, use_duck_shape=False
)


# Tick sizes the warm-up runs: 1 (its own graph) and 2 and 3 (the dynamic one; the
# second size checks it really is dynamic, not recompiled per size).
_WARMUP_TOKENS = (1, 2, 3)


@dataclass(frozen=True)
class CompileReport:
    mode: str
    warmup_s: float  # compiling + the warm-up forwards, at load
    graphs: int  # compiled pieces (each may hold a graph per specialised size)


def _first(x: Tensor, cos: Tensor, sin: Tensor, spec: Any, shape: LayerShape, *w: Tensor) -> Any:
    return attn_in(x, AttnWeights(*unflatten_weights(spec, w)), cos, sin, shape)


def _between(
    x: Tensor, attn: Tensor, cos: Tensor, sin: Tensor, spec: Any, shape: LayerShape, *w: Tensor
) -> Any:
    mlp_spec, attn_spec, split = spec
    mlp, nxt = (
        MlpWeights(*unflatten_weights(mlp_spec, w[:split])),
        AttnWeights(*unflatten_weights(attn_spec, w[split:])),
    )
    return between(x, attn, mlp, nxt, cos, sin, shape)


def _last(x: Tensor, attn: Tensor, spec: Any, shape: LayerShape, *w: Tensor) -> Any:
    return attn_out_mlp(x, attn, MlpWeights(*unflatten_weights(spec, w)), shape)


def _head(x: Tensor, norm: Tensor, spec: Any, shape: LayerShape, *w: Tensor) -> Any:
    (lm_head,) = unflatten_weights(spec, w)
    return head(x, norm, lm_head, shape)


class CompiledSteps:
    """The compiled pieces of one model and its weights, flattened once (a model's
    parameters are not swapped after loading)."""

    def __init__(self, model: LlamaModel, mode: str) -> None:
        shape = model.shape
        if shape.row_tile or shape.min_rows:  # row counts bent in Python: eager only
            raise ValueError("deterministic row tiles run eagerly, not compiled")
        attn = [flatten_weights(a) for a, _ in model.layer_weights()]
        mlp = [flatten_weights(m) for _, m in model.layer_weights()]
        # every layer is laid out alike: one spec serves all of them
        attn_spec, mlp_spec = attn[0][0], mlp[0][0]
        if any(a[0] != attn_spec for a in attn) or any(m[0] != mlp_spec for m in mlp):
            raise ValueError("layers with different weight layouts cannot share compiled code")
        self._attn = [a[1] for a in attn]
        self._mlp = [m[1] for m in mlp]
        head_spec, self._lm_head = _flatten_one(weight_of(model.lm_head))

        self.mode = mode
        # CUDA graphs (reduce-overhead) reuse their output buffers: a tick is one step of
        # inductor's graph trees, and what outlives it (the logits) is copied out
        self._graphs = mode == "reduce-overhead"
        self._pieces = _pieces(mode)
        self._shape = shape
        self._attn_spec = attn_spec
        self._between_spec = (mlp_spec, attn_spec, len(self._mlp[0]))
        self._mlp_spec = mlp_spec
        self._head_spec = head_spec

    def layers(self, model: LlamaModel, x: Tensor, ctx: ForwardContext) -> Tensor:
        """All decoder layers over the residual stream x [T, hidden]."""
        first, between_, last_, _ = self._pieces
        shape = self._shape
        blocks = model.blocks
        # each layer's rotary tables: sliding-window layers may have a base of their own
        ropes = [ctx.rope(b.self_attn.window is not None) for b in blocks]
        if self._graphs:  # the last tick's buffers may be reused from here on
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        q, k, v = first(x, *ropes[0], self._attn_spec, shape, *self._attn[0])
        last = len(blocks) - 1
        for i, layer in enumerate(blocks):
            attn = layer.self_attn.attend(q, k, v, ctx)
            if i < last:
                w = (*self._mlp[i], *self._attn[i + 1])
                x, q, k, v = between_(x, attn, *ropes[i + 1], self._between_spec, shape, *w)
            else:
                x = last_(x, attn, self._mlp_spec, shape, *self._mlp[i])
        return x

    def head(self, rows: Tensor, norm: Tensor) -> Tensor:
        head_ = self._pieces[3]
        out: Tensor = head_(rows, norm, self._head_spec, self._shape, *self._lm_head)
        return out.clone() if self._graphs else out


@functools.cache
def _pieces(mode: str) -> tuple[Any, Any, Any, Any]:
    """The four compiled functions, made once per process and mode: compiled code is
    cached per function, and each model (its shape and weight layout, passed as
    constant arguments) adds a specialisation of its own."""

    def compile_(fn: Any) -> Any:
        return torch.compile(fn, dynamic=True, fullgraph=True, mode=mode)

    return compile_(_first), compile_(_between), compile_(_last), compile_(_head)


def _flatten_one(w: Weight) -> tuple[tuple[FieldSpec, ...], list[Tensor]]:
    if isinstance(w, PackedWeight):
        return ((w.kind, w.out_features, w.in_features),), [w.data, w.scales]
    return ("dense",), [w]


def default_mode(device: torch.device) -> str:
    return "reduce-overhead" if device.type == "cuda" else "default"


def compile_model(
    model: LlamaModel, mode: str | None = None, *, decode_graph: bool = False
) -> CompileReport:
    """Switch `model` to the compiled pieces and warm them up on a scratch KV pool.
    `decode_graph`: also compile whole decode ticks as one graph (`decode_graph.py`;
    CPU), for the narrow weight set where the model has one, else for every decode
    tick."""
    mode = mode or default_mode(model.device)
    started = time.perf_counter()
    model.compiled = CompiledSteps(model, mode)
    graphs = 4
    if decode_graph:
        model.decode_graph = _whole_ticks(model, mode)
        graphs += isinstance(model.decode_graph, DecodeGraph)
    # the patch for the decode graph only: the pieces compile as they always have (their
    # one-row graph is part of what the deterministic mode's forward check has passed)
    graph = isinstance(model.decode_graph, DecodeGraph)
    with size_oblivious if graph else contextlib.nullcontext():
        _warm_up(model)
    if model.deterministic is not None:  # the compiled pieces keep its promise too
        from tokenfleet.model.deterministic import check_forward

        check_forward(model)
    return CompileReport(mode, time.perf_counter() - started, graphs=graphs)


def native_decode_wanted() -> bool:
    """Whether whole decode ticks may run on the native stack (`native_decode.py`) where
    it serves the model: unless `TOKENFLEET_NATIVE_DECODE=0`, which keeps the compiled
    decode graph (to compare the two, or to step around a fault in the stack)."""
    return os.environ.get("TOKENFLEET_NATIVE_DECODE", "1") != "0"


def _whole_ticks(model: LlamaModel, mode: str) -> DecodeGraph | NativeDecode:
    """What runs a whole decode tick in one call: the native stack where it serves this
    model on the CPU (nothing to compile; SmolLM2's one-row tick outside the matmuls
    1.1-1.5 ms against the graph's 1.9-2.4 on an EPYC Zen 4: native_decode.py), else the
    compiled decode graph."""
    return _native(model) or DecodeGraph(model, narrow=model.narrow is not None, mode=mode)


def _native(model: LlamaModel) -> NativeDecode | None:
    """The native stack for `model`'s decode ticks, where it serves them (None: not)."""
    narrow = model.narrow is not None
    if model.device.type == "cpu" and native_decode_wanted() and unsupported(model, narrow) is None:
        return NativeDecode(model, narrow=narrow)
    return None


def install_native_decode(model: LlamaModel) -> bool:
    """Whole decode ticks on the native stack for a model that runs eagerly otherwise
    (`--no-compile`, or a compile that failed): the stack compiles nothing, so it needs
    only the C++ kernels. Where it does not serve (or `TOKENFLEET_NATIVE_DECODE=0`, or a
    whole-tick unit is there already) the model stays as it is. Returns whether it did."""
    if model.decode_graph is None:
        model.decode_graph = _native(model)
        return model.decode_graph is not None
    return False


def _warm_up(model: LlamaModel) -> None:
    """Every graph compiled: prefill chunks and decode ticks of the sizes that get one."""
    block = 16
    pool = model.new_kv_pool(4, block)
    for n in _WARMUP_TOKENS:
        model.forward([1] * n, [SeqInput([0], 0, n)], pool)  # a prefill chunk of n tokens
        model.forward([1] * n, [SeqInput([0], i, 1) for i in range(n)], pool)  # n decodes
    if model.narrow is not None:
        rows = model.narrow.max_rows
        for n in (rows, rows + 1, rows + 2):  # the narrow graph past one block; dense decodes
            wide = [SeqInput([0, 1, 2], block + i, 1) for i in range(n)]
            model.forward([1] * n, wide, pool)


def uncompile_model(model: LlamaModel) -> None:
    model.compiled = None
    model.decode_graph = None
