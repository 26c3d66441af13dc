"""The attention layer's weights (fused q/k/v projection, (qwen3) q/k norms, output
projection) and its step that looks across tokens: the KV write and the backend call.
The row-wise math around it is in `tokenfleet.model.layers`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from tokenfleet.model.attention.backend import AttentionBackend
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.kv_pool import KVPool
from tokenfleet.model.layers import AttnWeights
from tokenfleet.model.norm import RMSNorm
from tokenfleet.model.quant import QuantLinear, weight_of
from tokenfleet.model.tick_inputs import BatchPlan


@dataclass(frozen=True)
class ForwardContext:
    """What every layer of one forward shares: the rotary tables, the tick's batch plan,
    the KV pool, and the attention backend with its per-forward metadata; and for a
    model with sliding-window layers, their rotary tables and metadata."""

    cos: Tensor  # [T, hd]
    sin: Tensor
    plan: BatchPlan
    kv: KVPool
    backend: AttentionBackend
    meta: object
    window_cos: Tensor | None = None  # [T, hd], the sliding layers' rope base
    window_sin: Tensor | None = None
    window_meta: object = None

    def rope(self, windowed: bool) -> tuple[Tensor, Tensor]:
        """(cos, sin) for a sliding-window layer (`windowed`) or a global one."""
        if windowed and self.window_cos is not None and self.window_sin is not None:
            return self.window_cos, self.window_sin
        return self.cos, self.sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = config.window_of(layer_idx)  # None: attends to the whole context
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_out = config.num_heads * config.head_dim
        kv_out = config.num_kv_heads * config.head_dim
        self.split_sizes = [q_out, kv_out, kv_out]
        # q, k and v projections fused into one matmul: rows [q | k | v] of the weight.
        self.qkv_proj: nn.Linear | QuantLinear = nn.Linear(
            config.hidden_size, q_out + 2 * kv_out, bias=config.has_qkv_bias
        )
        self.o_proj: nn.Linear | QuantLinear = nn.Linear(
            q_out, config.hidden_size, bias=config.attention_bias
        )
        # qwen3, gemma3: each head of q and k is RMS-normalised before the rotary embedding
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def weights(self, norm: Tensor) -> AttnWeights:
        """This layer's weights up to attention (`norm`: the layer's input norm)."""
        qn = None if self.q_norm is None else self.q_norm.weight
        kn = None if self.k_norm is None else self.k_norm.weight
        return AttnWeights(norm, weight_of(self.qkv_proj), self.qkv_proj.bias, qn, kn)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext) -> Tensor:
        """Write this tick's k/v [T, KVH, hd] into the pool, then attend: q [T, H, hd] ->
        [T, H, hd]."""
        k_cache, v_cache = ctx.kv.layer_slots(self.layer_idx)  # [slots, KVH, hd] views of the pool
        if k_cache.dtype != k.dtype:  # a float16 pool: attend to k/v as the pool keeps them
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            k_cache.index_copy_(0, ctx.plan.write_slots, k)
            v_cache.index_copy_(0, ctx.plan.write_slots, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            k_cache.index_copy_(0, ctx.plan.write_slots, k)
            v_cache.index_copy_(0, ctx.plan.write_slots, v)
        meta = ctx.meta if self.window is None else ctx.window_meta
        return ctx.backend.attend(q, k, v, k_cache, v_cache, meta)
