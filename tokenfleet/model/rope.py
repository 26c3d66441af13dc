"""Rotary position embeddings, including Llama 3.1's frequency scaling.

Computed the way transformers does (fp32 frequencies, `rotate_half` layout, cos/sin
cast to the activation dtype) so logits match the reference to float noise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tokenfleet.model.config import Llama3RopeScaling, ModelConfig


def inverse_frequencies(
    config: ModelConfig, device: torch.device | None = None, theta: float | None = None
) -> Tensor:
    """inv_freq: [head_dim // 2], float32 (`theta`: a base other than the config's, as
    for gemma3's sliding layers)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / ((theta or config.rope_theta) ** exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: Tensor, s: Llama3RopeScaling) -> Tensor:
    # Long wavelengths (beyond the original context) are slowed by `factor`, short ones
    # are kept, and the band in between is interpolated smoothly.
    old_ctx = s.original_max_position_embeddings
    low_freq_wavelen = old_ctx / s.low_freq_factor
    high_freq_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin: [T, head_dim] for positions [T], in `dtype`."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # [T, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)
