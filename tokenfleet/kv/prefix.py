"""Content addresses of full KV blocks, for prefix caching.

A full block's KV depends on every token before it, so its address is a hash chained
over its own tokens and its parent's address. The chain starts at a root that holds
whatever else changes the content, and who may share it: the model's weights and
dtype/quantization, the job's *cache scope* (its tenant, or the cache group an operator
put its tenant in: `cache_scope`) and the job's `cache_salt`. A prefix-cache hit shows
(a faster first token, `usage.cached_tokens`), so a job that could hit another tenant's
blocks could test whether a prompt it guesses was sent recently: blocks are shared only
within one scope, and a salt partitions a scope further (within a tenant, never across).
Two jobs whose token prefixes agree block for block, under the same root, get the same
addresses and can share those blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def cache_scope(tenant: str, group: str | None = None) -> str:
    """Who may share a job's cached blocks: its tenant's jobs, or (when an operator gave
    the tenant a cache group, tenants.py) the jobs of every tenant in that group."""
    return f"group:{group}" if group else f"tenant:{tenant}"


def root_hash(identity: str, scope: str, cache_salt: str | None = None) -> bytes:
    """The chain's start for one model (`identity`), one cache scope and one salt."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"tokenfleet-kv")
    h.update(identity.encode())
    h.update(b"\x00scope\x00" + scope.encode())
    if cache_salt is not None:
        h.update(b"\x00salt\x00" + cache_salt.encode())
    return h.digest()


def chain_hashes(
    tokens: Sequence[int], block_size: int, parent: bytes, *, start_block: int = 0
) -> list[bytes]:
    """Addresses of the full blocks start_block, start_block+1, ... of `tokens`, where
    `parent` is the address of block start_block-1 (or the root when start_block is 0)."""
    out: list[bytes] = []
    for first in range(start_block * block_size, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
        h.update(array("q", tokens[first : first + block_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


__all__ = ["DIGEST_BYTES", "cache_scope", "chain_hashes", "root_hash"]
