"""How many bytes one token and one block of KV cache cost for a given model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """The shape of one model's paged KV cache.

    The pool the model allocates is, per layer, one K and one V tensor of shape
    `[num_blocks, block_size, num_kv_heads, head_dim]`, so a token costs
    `2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_bytes`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "block_size"):
            value = getattr(self, name)
            # bool is an int subclass; KVLayout(True, ...) is always a mistake.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` token slots (the last block may be partly filled)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return -(-tokens // self.block_size)

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """Whole blocks that fit in `budget_bytes`; a partial block is worth nothing."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        return budget_bytes // self.bytes_per_block

    def bytes_for_blocks(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block
