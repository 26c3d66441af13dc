"""A Llama-family decoder that runs one engine tick as one forward pass.

All T new tokens of all sequences are concatenated into one flat batch; norms,
projections and the MLP run once over [T, hidden] (that is the batching), and
only attention looks at sequence boundaries (see `attention/`), through the
model's attention backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from tokenfleet.model.attention import Attention, AttentionBackend, SdpaBackend
from tokenfleet.model.attention.layer import ForwardContext
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.kv_pool import KVPool
from tokenfleet.model.layers import (
    AttnWeights,
    LayerShape,
    MlpWeights,
    Weight,
    attn_in,
    attn_out_mlp,
    head,
)
from tokenfleet.model.norm import RMSNorm
from tokenfleet.model.quant import (
    PackedWeight,
    QuantError,
    QuantKind,
    QuantLinear,
    quantize,
    weight_of,
)
from tokenfleet.model.rope import inverse_frequencies, rope_cos_sin
from tokenfleet.model.tick_inputs import SeqInput, TickBuffers

if TYPE_CHECKING:
    from tokenfleet.model.compiled import CompiledSteps
    from tokenfleet.model.cuda_graph import CudaGraphDecode
    from tokenfleet.model.decode_graph import DecodeGraph
    from tokenfleet.model.deterministic import DeterminismReport
    from tokenfleet.model.native_decode import NativeDecode


_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class NarrowWeights(nn.Module):
    """A second, packed copy of every projection and the LM head, for the forwards of
    at most `max_rows` rows (`LlamaModel.add_narrow`): a few-row tick reads each weight
    once and does little arithmetic with it, so fewer bytes win there, while the dense
    weights' matrix units win on wide ones. Held as buffers, so the model's byte count
    sees both copies."""

    def __init__(
        self, kind: QuantKind, max_rows: int, head_rows: int, packed: dict[str, PackedWeight]
    ) -> None:
        super().__init__()
        self.kind = kind
        self.max_rows = max_rows
        self.head_rows = head_rows  # the packed LM head for ticks of at most this many rows
        self.linears = nn.ModuleDict(
            {name.replace(".", "/"): QuantLinear(w, None) for name, w in packed.items()}
        )

    def packed(self, name: str) -> PackedWeight:
        module = self.linears[name.replace(".", "/")]
        assert isinstance(module, QuantLinear)
        return module.packed


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        # gate and up projections fused: rows [gate | up] of the weight.
        self.gate_up_proj: nn.Linear | QuantLinear = nn.Linear(
            config.hidden_size, 2 * inter, bias=config.mlp_bias
        )
        self.down_proj: nn.Linear | QuantLinear = nn.Linear(
            inter, config.hidden_size, bias=config.mlp_bias
        )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)
        # gemma3: norms of the attention's output and of the MLP's, before each residual
        # add (its checkpoints' post_attention_layernorm / post_feedforward_layernorm;
        # `post_attention_layernorm` here is the MLP's input norm in every family).
        sandwich = config.gemma_norms
        self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.mlp_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    def attn_weights(self) -> AttnWeights:
        return self.self_attn.weights(self.input_layernorm.weight)

    def mlp_weights(self) -> MlpWeights:
        o, gu, down = self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj
        norm = self.post_attention_layernorm.weight
        attn_out = None if self.attn_out_norm is None else self.attn_out_norm.weight
        mlp_out = None if self.mlp_out_norm is None else self.mlp_out_norm.weight
        return MlpWeights(
            weight_of(o),
            o.bias,
            norm,
            weight_of(gu),
            gu.bias,
            weight_of(down),
            down.bias,
            attn_out,
            mlp_out,
        )

    def forward(
        self, x: Tensor, ctx: ForwardContext, shape: LayerShape, attn: AttnWeights, mlp: MlpWeights
    ) -> Tensor:
        """`attn` / `mlp`: this layer's weights (`LlamaModel.layer_weights`)."""
        q, k, v = attn_in(x, attn, *ctx.rope(self.self_attn.window is not None), shape)
        return attn_out_mlp(x, self.self_attn.attend(q, k, v, ctx), mlp, shape)


class LlamaModel(nn.Module):
    """Decoder + LM head. Call `forward(input_ids, seqs, kv)` once per engine tick."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        blocks = [DecoderLayer(config, i) for i in range(config.num_layers)]
        self.layers = nn.ModuleList(blocks)
        self.blocks = blocks  # the same layers, typed
        # Each layer's weights for the layer math, gathered once (`layer_weights`); a
        # projection swapped for a quantized one (`quantize`) drops them.
        self._layer_weights: list[tuple[AttnWeights, MlpWeights]] | None = None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | QuantLinear = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self._inv_freq = inverse_frequencies(config, torch.device("cpu"))
        windows = {config.window_of(i) for i in range(config.num_layers)} - {None}
        assert len(windows) <= 1, "one sliding window size per model"
        self._window = next(iter(windows), None)  # of the sliding layers, if any
        self._inv_freq_local = (
            None
            if self._window is None
            else inverse_frequencies(config, torch.device("cpu"), config.rope_local_theta)
        )
        self.attention: AttentionBackend = SdpaBackend()
        self._tick_buffers: TickBuffers | None = None  # the tick's index tensors, reused
        self.shape = LayerShape(
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            gelu=config.hidden_act == "gelu_pytorch_tanh",
            scale_fp32=config.gemma_norms,
            query_scale=config.query_scale,
        )
        # Set by `add_narrow`: packed weights for forwards of few rows.
        self.narrow: NarrowWeights | None = None
        self._narrow_weights: list[tuple[AttnWeights, MlpWeights]] | None = None
        # Set by `compiled.compile_model`: runs the row-wise parts compiled, and (with a
        # narrow set, or alone) whole decode ticks as one graph.
        self.compiled: CompiledSteps | None = None
        # (the native stack where it serves the model: `native_decode.py`; on CUDA,
        # `cuda_graph.install`: decode ticks replayed from CUDA graphs)
        self.decode_graph: DecodeGraph | NativeDecode | CudaGraphDecode | None = None
        # Set by `deterministic.make_deterministic`: batch-invariant numerics, and how.
        self.deterministic: DeterminismReport | None = None
        # Set by `set_kv_dtype`: the KV pool's dtype where it is not the model's.
        self._kv_dtype: torch.dtype | None = None

    def layer_weights(self, narrow: bool = False) -> list[tuple[AttnWeights, MlpWeights]]:
        """Each layer's weights for the layer math: the dense set, or the narrow one."""
        if narrow:
            assert self._narrow_weights is not None, "add_narrow() first"
            return self._narrow_weights
        if self._layer_weights is None:
            self._layer_weights = [(b.attn_weights(), b.mlp_weights()) for b in self.blocks]
        return self._layer_weights

    def head_weight(self, narrow: bool = False, rows: int = 1) -> Weight:
        """The LM head for a forward of `rows` sampled rows: the narrow set's (int8) up to
        its `head_rows`, the dense one above (one matrix: its own crossover)."""
        if narrow:
            assert self.narrow is not None, "add_narrow() first"
            if rows <= self.narrow.head_rows:
                return self.narrow.packed("lm_head")
        return weight_of(self.lm_head)

    def is_narrow(self, rows: int, seqs: Sequence[SeqInput]) -> bool:
        """Whether a forward of `rows` rows runs on the narrow set: a decode-only tick
        (one new token per sequence) of at most its `max_rows` rows."""
        n = self.narrow
        return n is not None and rows <= n.max_rows and all(s.num_new == 1 for s in seqs)

    def projection_names(self) -> list[str]:
        """Every layer's projections by module name ("layers.0.self_attn.qkv_proj", ...),
        then "lm_head": the matrices a packed weight set holds."""
        names = [f"layers.{i}.{p}" for i in range(len(self.blocks)) for p in _PROJECTIONS]
        return [*names, "lm_head"]

    def add_narrow(
        self,
        kind: QuantKind,
        max_rows: int,
        prepacked: Mapping[str, PackedWeight] | None = None,
        head_rows: int | None = None,
    ) -> None:
        """Keep a packed copy of every projection and the LM head (`kind`; `prepacked` by
        module name, e.g. a GGUF file's own Q4 blocks, used as they are) beside the dense
        weights, for decode ticks of at most `max_rows` rows (`is_narrow`), the head for
        up to `head_rows` of them (default: as many). Biases (Qwen2's q/k/v) stay dense,
        added after the packed matmul, as `QuantLinear` keeps them."""
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise QuantError(f"{kind} weights go beside bfloat16 or float32 ones, not {self.dtype}")
        if self.compiled is not None or self.decode_graph is not None:
            raise QuantError("add the narrow weights before compiling")
        given = prepacked or {}
        packed: dict[str, PackedWeight] = {}

        for name in self.projection_names():
            linear = self.get_submodule(name)
            if isinstance(linear, QuantLinear):
                raise QuantError(f"{name} is quantized already: no dense set to keep beside")
            # the head as `quantize` keeps it, int8: the most sensitive matrix
            as_kind: QuantKind = "int8" if name == "lm_head" else kind
            weight = linear.weight
            assert isinstance(weight, Tensor)
            packed[name] = given.get(name) or quantize(weight, as_kind)
        rows_for_head = max_rows if head_rows is None else head_rows
        self.narrow = NarrowWeights(kind, max_rows, rows_for_head, packed)
        self._narrow_weights = []
        for (attn_w, mlp_w), i in zip(self.layer_weights(), range(len(self.blocks)), strict=True):
            at = f"layers.{i}."
            self._narrow_weights.append(
                (
                    dataclasses.replace(attn_w, qkv=packed[f"{at}self_attn.qkv_proj"]),
                    dataclasses.replace(
                        mlp_w,
                        o=packed[f"{at}self_attn.o_proj"],
                        gate_up=packed[f"{at}mlp.gate_up_proj"],
                        down=packed[f"{at}mlp.down_proj"],
                    ),
                )
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV pool holds: the model's dtype, or float16 under a float32 model on
        the CPU (`set_kv_dtype`)."""
        return self.dtype if self._kv_dtype is None else self._kv_dtype

    def set_kv_dtype(self, dtype: torch.dtype) -> None:
        """Keep K/V in `dtype`: the model's own, or float16 for a float32 model on the CPU
        (each new key and value rounded to it as it is written, and attended to as
        rounded, whether it is read back from the pool or not; half the bytes each tick's
        attention reads and each token's KV budget holds). Before `new_kv_pool`."""
        if dtype == self.dtype:
            self._kv_dtype = None
            return
        if dtype != torch.float16 or self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError(
                f"a {dtype} KV pool under a {self.dtype} model on {self.device}: the pool "
                "holds the model's dtype, or float16 under a float32 model on the CPU"
            )
        self._kv_dtype = dtype

    def new_kv_pool(self, num_blocks: int, block_size: int) -> KVPool:
        """A zeroed pool in `kv_dtype` on this model's device."""
        return KVPool(self.config, num_blocks, block_size, dtype=self.kv_dtype, device=self.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor | Sequence[int],
        seqs: Sequence[SeqInput],
        kv: KVPool,
        rows: Sequence[int] | None = None,
    ) -> Tensor:
        """Run one tick and return float32 logits [len(seqs), vocab].

        `input_ids` [T] holds every sequence's new tokens concatenated in `seqs`
        order (T = sum of num_new). Their K/V are written into `kv` at the slots
        their block tables give; the logits are for each sequence's LAST new token,
        or, when `rows` is given, for those rows of the T tokens ([len(rows), vocab]).
        """
        if kv.dtype != self.kv_dtype or kv.device != self.device:
            raise ValueError(
                f"KV pool is {kv.dtype} on {kv.device}, the model keeps {self.kv_dtype} K/V "
                f"on {self.device}"
            )
        narrow = rows is None and self.is_narrow(len(input_ids), seqs)
        graph = self.decode_graph
        if graph is not None and rows is None and graph.serves(seqs, narrow):
            return graph.forward(input_ids, seqs, kv)
        device = self.device
        if self._tick_buffers is None or self._tick_buffers.device != device:
            self._tick_buffers = TickBuffers(device)
        plan = self._tick_buffers.build(input_ids, seqs, kv.block_size, kv.num_blocks)
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        cos, sin = rope_cos_sin(self._inv_freq, plan.positions, self.dtype)  # [T, hd] each
        ctx = ForwardContext(cos, sin, plan, kv, self.attention, self.attention.prepare(plan))
        if self._inv_freq_local is not None:  # sliding-window layers: their rope and masks
            if self._inv_freq_local.device != device:
                self._inv_freq_local = self._inv_freq_local.to(device)
            wcos, wsin = rope_cos_sin(self._inv_freq_local, plan.positions, self.dtype)
            wmeta = self.attention.prepare(plan, window=self._window)
            ctx = dataclasses.replace(ctx, window_cos=wcos, window_sin=wsin, window_meta=wmeta)

        x = self.embed_tokens(plan.input_ids)  # [T, hidden]
        if self.config.embed_scale is not None:  # rounded to the model dtype, as reference
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=device)
        compiled = None if narrow else self.compiled  # the pieces hold the dense set
        if compiled is not None:
            x = compiled.layers(self, x, ctx)
        else:
            weights = self.layer_weights(narrow)
            for layer, (attn_w, mlp_w) in zip(self.blocks, weights, strict=True):
                x = layer(x, ctx, self.shape, attn_w, mlp_w)
        picked = plan.last_rows if rows is None else torch.tensor(list(rows), device=device)
        out = x[picked]  # [S, hidden]; the norm is per row
        if compiled is not None:
            return compiled.head(out, self.norm.weight)
        lm_head = self.head_weight(narrow, out.shape[0])
        return head(out, self.norm.weight, lm_head, self.shape)  # [S, vocab]

    def quantize(
        self, kind: QuantKind, prepacked: Mapping[str, PackedWeight] | None = None
    ) -> None:
        """Keep every projection and the LM head quantized (the head as int8 at least; the
        embedding stays dense: a tick reads only its rows). Activations in bf16, or in
        float32 (a CPU without bf16: tokenfleet's kernels take them as they are, torch's
        get them rounded to bf16, `PackedWeight.matmul`).
        `prepacked` (by module name, e.g. "layers.0.self_attn.qkv_proj", "lm_head") are
        used as they are; a projection already quantized is left alone."""
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise QuantError(
                f"{kind} weights run with bfloat16 or float32 activations; this model is "
                f"{self.dtype} (load it with dtype auto, bfloat16 or float32)"
            )
        if self.compiled is not None:
            raise QuantError("quantize before compiling")

        given = prepacked or {}
        self._layer_weights = None

        def packed(
            name: str, linear: nn.Linear | QuantLinear, as_kind: QuantKind = kind
        ) -> QuantLinear:
            if isinstance(linear, QuantLinear):
                return linear
            weight = given.get(name) or quantize(linear.weight, as_kind)
            return QuantLinear(weight, linear.bias)

        for i, layer in enumerate(self.blocks):
            attn, mlp, at = layer.self_attn, layer.mlp, f"layers.{i}."
            attn.qkv_proj = packed(f"{at}self_attn.qkv_proj", attn.qkv_proj)
            attn.o_proj = packed(f"{at}self_attn.o_proj", attn.o_proj)
            mlp.gate_up_proj = packed(f"{at}mlp.gate_up_proj", mlp.gate_up_proj)
            mlp.down_proj = packed(f"{at}mlp.down_proj", mlp.down_proj)
        # The LM head is the most sensitive matrix: with int4 it is kept int8 (as
        # llama.cpp's 4-bit files keep it at Q6_K / Q8_0), unless a file's own 4-bit
        # blocks are given for it (SmolLM2 int4 perplexity: 23.2 with an int4 head,
        # measured in docs/benchmarks-history.md).
        self.lm_head = packed("lm_head", self.lm_head, "int8")
