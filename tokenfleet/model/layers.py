"""The decoder's math as plain functions of tensors: what runs between two attentions.

The modules in `llama.py` hold the weights (named as checkpoints name them); these
functions are what they compute. Both the eager forward and the compiled one
(`compiled.py`) call them, so the two cannot drift apart. Every function is
row-wise: token t's output depends on token t's input only, so one call covers a
whole tick's flattened batch, decode rows and prefill rows alike. Only attention
(and the KV write before it) looks across tokens, and it stays outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenfleet.model.quant import PackedWeight

# A projection's weight: dense [out, in], or kept quantized (`tokenfleet.model.quant`).
Weight = Tensor | PackedWeight


def linear(x: Tensor, w: Weight, bias: Tensor | None, s: LayerShape) -> Tensor:
    """x [T, in] -> [T, out]. `s.row_tile` / `s.min_rows` / `s.one_kernel`: the
    deterministic mode's batch invariance (`tokenfleet.model.deterministic`); all off by
    default."""
    if isinstance(w, Tensor):
        t = x.shape[0]
        if s.row_tile and t != s.row_tile:
            return _tiled(x, w, bias, s.row_tile)
        if t < s.min_rows:  # zero rows below: the many-row kernel, not the one-row one
            return F.linear(F.pad(x, (0, 0, 0, s.min_rows - t)), w, bias)[:t]
        return F.linear(x, w, bias)
    y = w.matmul(x, one_kernel=s.one_kernel)
    return y if bias is None else y + bias


def _tiled(x: Tensor, w: Tensor, bias: Tensor | None, tile: int) -> Tensor:
    """F.linear in calls of exactly `tile` rows (the last one padded with zeros), for a
    kernel whose result for a row depends on how many rows the call has."""
    t = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -t % tile))
    parts = [F.linear(padded[i : i + tile], w, bias) for i in range(0, t, tile)]
    return torch.cat(parts)[:t]


@dataclass(frozen=True)
class LayerShape:
    """The constants every layer function needs (the same for all layers of a model)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    gelu: bool = False  # GeGLU (tanh approximation) instead of SwiGLU
    scale_fp32: bool = False  # gemma: norms scale in fp32 too (`rms_norm`)
    query_scale: float = 1.0  # on q after rope (`ModelConfig.query_scale`)
    # Deterministic mode (`tokenfleet.model.deterministic`): dense matmuls in calls of
    # exactly this many rows (0: as they come, the kernel is row-invariant already), or
    # of at least `min_rows` (a CPU whose one-row kernel alone sums in another order),
    # and quantized ones through their packed kernel at any row count.
    row_tile: int = 0
    min_rows: int = 0
    one_kernel: bool = False


def rms_norm(x: Tensor, weight: Tensor, eps: float, scale_fp32: bool = False) -> Tensor:
    """Normalise in fp32 whatever the model dtype (bf16 variance is too coarse), then
    scale in the model dtype, as the reference does (Llama), or still in fp32 and cast
    after (`scale_fp32`, Gemma; its weight here is already 1 + the checkpoint's)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if scale_fp32:
        return (x32 * weight.float()).to(x.dtype)
    return weight * x32.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]. Rotates pairs (i, i + head_dim/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass(frozen=True)
class AttnWeights:
    """One layer's weights up to attention: input norm, fused q/k/v, (qwen3) q/k norms."""

    norm: Tensor
    qkv: Weight
    qkv_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None


@dataclass(frozen=True)
class MlpWeights:
    """One layer's weights after attention: output projection, the MLP's input norm,
    SwiGLU / GeGLU, and (gemma3) the norms of the attention's and the MLP's outputs."""

    o: Weight
    o_bias: Tensor | None
    norm: Tensor
    gate_up: Weight
    gate_up_bias: Tensor | None
    down: Weight
    down_bias: Tensor | None
    attn_out_norm: Tensor | None = None
    mlp_out_norm: Tensor | None = None


def attn_in(
    x: Tensor, w: AttnWeights, cos: Tensor, sin: Tensor, s: LayerShape
) -> tuple[Tensor, Tensor, Tensor]:
    """Residual stream x [T, hidden] -> rotated q [T, H, hd], k and v [T, KVH, hd]."""
    t = x.shape[0]
    h = rms_norm(x, w.norm, s.eps, s.scale_fp32)
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    q, k, v = torch.split(linear(h, w.qkv, w.qkv_bias, s), [q_out, kv_out, kv_out], dim=-1)
    q = q.view(t, s.num_heads, s.head_dim)
    k = k.view(t, s.num_kv_heads, s.head_dim)
    if w.q_norm is not None and w.k_norm is not None:
        q = rms_norm(q, w.q_norm, s.eps, s.scale_fp32)
        k = rms_norm(k, w.k_norm, s.eps, s.scale_fp32)
    q = rotate(q, cos, sin)
    if s.query_scale != 1.0:
        q = q * s.query_scale
    return q, rotate(k, cos, sin), v.view(t, s.num_kv_heads, s.head_dim)


def attn_out_mlp(x: Tensor, attn: Tensor, w: MlpWeights, s: LayerShape) -> Tensor:
    """x [T, hidden] and the attention output [T, H, hd] -> the layer's output x."""
    out = linear(attn.reshape(x.shape[0], -1), w.o, w.o_bias, s)
    if w.attn_out_norm is not None:
        out = rms_norm(out, w.attn_out_norm, s.eps, s.scale_fp32)
    x = x + out
    h = rms_norm(x, w.norm, s.eps, s.scale_fp32)
    gate, up = torch.split(linear(h, w.gate_up, w.gate_up_bias, s), s.intermediate_size, dim=-1)
    act = F.gelu(gate, approximate="tanh") if s.gelu else F.silu(gate)
    down = linear(act * up, w.down, w.down_bias, s)
    if w.mlp_out_norm is not None:
        down = rms_norm(down, w.mlp_out_norm, s.eps, s.scale_fp32)
    return x + down


def between(
    x: Tensor,
    attn: Tensor,
    mlp: MlpWeights,
    nxt: AttnWeights,
    cos: Tensor,
    sin: Tensor,
    s: LayerShape,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Everything between one layer's attention and the next one's: the rest of layer
    i (o_proj, residual, MLP) and the start of layer i + 1 (norm, q/k/v, rope).
    Returns (x, q, k, v)."""
    x = attn_out_mlp(x, attn, mlp, s)
    q, k, v = attn_in(x, nxt, cos, sin, s)
    return x, q, k, v


def head(x: Tensor, norm: Tensor, lm_head: Weight, s: LayerShape) -> Tensor:
    """The final norm and the LM head over the rows that sample -> float32 logits."""
    logits = linear(rms_norm(x, norm, s.eps, s.scale_fp32), lm_head, None, s)
    return logits.float()


# How one weights dataclass is flattened to plain tensors (compiled code guards on
# tensors cheaply, on an object per layer not at all): per field, None, "dense", or
# (kind, out, in) for a `PackedWeight` given as its data and scales tensors.
FieldSpec = None | str | tuple[str, int, int]


def flatten_weights(w: AttnWeights | MlpWeights) -> tuple[tuple[FieldSpec, ...], list[Tensor]]:
    spec: list[FieldSpec] = []
    tensors: list[Tensor] = []
    for name in w.__dataclass_fields__:
        value = getattr(w, name)
        if value is None:
            spec.append(None)
        elif isinstance(value, PackedWeight):
            spec.append((value.kind, value.out_features, value.in_features))
            tensors += [value.data, value.scales]
        else:
            spec.append("dense")
            tensors.append(value)
    return tuple(spec), tensors


def unflatten_weights(spec: tuple[FieldSpec, ...], tensors: tuple[Tensor, ...]) -> list[Any]:
    values: list[Any] = []
    at = 0
    for field in spec:
        if field is None:
            values.append(None)
        elif isinstance(field, tuple):
            kind, out, inp = field
            values.append(PackedWeight(kind, tensors[at], tensors[at + 1], out, inp))  # type: ignore[arg-type]
            at += 2
        else:  # "dense"
            values.append(tensors[at])
            at += 1
    return values
