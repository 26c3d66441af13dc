"""RMSNorm's weight, as the Llama family names it (the math: `layers.rms_norm`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tokenfleet.model.layers import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)
