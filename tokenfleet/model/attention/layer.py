"""The attention layer: fused q/k/v projection, (qwen3) q/k norms, rotary embedding, KV
write, backend, output."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from tokenfleet.model.attention.backend import AttentionBackend
from tokenfleet.model.batch import BatchPlan
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.kv_pool import KVPool
from tokenfleet.model.norm import RMSNorm
from tokenfleet.model.rope import apply_rope


@dataclass(frozen=True)
class ForwardContext:
    """What every layer of one forward shares: the rotary tables, the tick's batch plan,
    the KV pool, and the attention backend with its per-forward metadata."""

    cos: Tensor  # [T, hd]
    sin: Tensor
    plan: BatchPlan
    kv: KVPool
    backend: AttentionBackend
    meta: object


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_out = config.num_heads * config.head_dim
        kv_out = config.num_kv_heads * config.head_dim
        self.split_sizes = [q_out, kv_out, kv_out]
        # q, k and v projections fused into one matmul: rows [q | k | v] of the weight.
        self.qkv_proj = nn.Linear(config.hidden_size, q_out + 2 * kv_out, bias=config.has_qkv_bias)
        self.o_proj = nn.Linear(q_out, config.hidden_size, bias=config.attention_bias)
        # qwen3: each head of q and k is RMS-normalised before the rotary embedding
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        cos, sin, plan = ctx.cos, ctx.sin, ctx.plan
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, hd]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]

        k_cache, v_cache = ctx.kv.layer_slots(self.layer_idx)  # [slots, KVH, hd] views of the pool
        k_cache.index_copy_(0, plan.write_slots, k)
        v_cache.index_copy_(0, plan.write_slots, v)
        out = ctx.backend.attend(q, k, v, k_cache, v_cache, ctx.meta)  # [T, H, hd]
        projected: Tensor = self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        return projected
