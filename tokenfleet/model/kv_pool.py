"""The preallocated paged KV cache tensors a model reads and writes by block id.

Which blocks a session owns is decided elsewhere (the pure block manager in
`tokenfleet.kv`); this module only holds the memory and maps a (block table,
position) pair to a flat slot: a token at position p of a session with block
table `bt` lives in block `bt[p // block_size]` at offset `p % block_size`, which
is flat slot `bt[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenfleet.model.config import ModelConfig


class KVPool:
    """K and V for every layer: `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`.

    Zero-initialised, so a slot that was never written holds finite values (the
    attention never reads one unmasked, but a NaN there could still poison 0 * NaN).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1: {num_blocks}, {block_size}")
        self.num_layers = config.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k: Tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v: Tensor = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def layer_slots(self, layer: int) -> tuple[Tensor, Tensor]:
        """Flat views of one layer, k and v: [num_slots, num_kv_heads, head_dim].

        Views, not copies: writing into them writes the pool.
        """
        flat = (self.num_slots, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(flat), self.v[layer].view(flat)
