"""Paged KV cache accounting: the byte layout of a block and the block allocator.

The torch pool tensor lives in `tokenfleet.model`; this package owns block ids,
per-session block tables and the arithmetic that turns bytes into blocks.
"""

from __future__ import annotations

from tokenfleet.kv.block_manager import BlockManager, KVCapacityError
from tokenfleet.kv.layout import KVLayout

__all__ = ["BlockManager", "KVCapacityError", "KVLayout"]
