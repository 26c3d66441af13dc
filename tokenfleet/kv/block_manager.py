"""Block allocator: whole-session reservations, lazy allocation, shared prefix blocks.

A session never runs out of KV mid-generation (only the engine's preemption by band
frees a running session's blocks, on purpose), so a session is admitted only if its whole
worst case (prompt + max_new_tokens) can be *reserved* up front. Physical blocks are
handed out lazily by `ensure` as tokens arrive, so each session wastes at most one
partly filled block, and a session that stops early never touched the rest of its
reservation.

Prefix caching. A full block whose KV is computed can be registered under its content
address (`kv.prefix`): a later session whose prompt starts with the same blocks takes
them into its table instead of computing them again. Blocks are reference counted; a
shared block counts once. When its last session ends, a registered block stays
*cached*: free (reclaimable, counted as free) but still findable, until a fresh
allocation needs it, least recently released first. Accounting, in blocks:

    num_blocks == num_in_use_blocks + num_cached_blocks + num_empty_blocks
    committed  == num_in_use_blocks + sum of sessions' unallocated reservations
    available_blocks == num_blocks - committed     (what a new session may still claim)

A new session costs the blocks it will add (its uncached tail + max_new_tokens) plus
the cached blocks it revives (a hit on a block no other session holds takes that block
out of the free ones). Every reservation can always be honoured: unallocated
reservations never exceed the free blocks, so a session that was admitted finishes
without taking a block from anyone (only cached, unreferenced blocks are reclaimed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class KVCapacityError(ValueError):
    """A reservation the pool cannot honour, or a duplicate/unknown session id.

    Admission checks `can_reserve` first, so reaching this is a caller bug.
    """


@dataclass
class _Session:
    unallocated: int  # reserved blocks not allocated yet
    table: list[int] = field(default_factory=list)  # block ids, in token order
    used_tokens: int = 0  # token slots covered by `ensure` so far (cached ones included)
    cached_tokens: int = 0  # leading tokens whose KV came from the cache


@dataclass
class PrefixCacheStats:
    """Counters since start, in the sense vLLM's metrics use: a query is a prompt token
    (or block) looked up at admission, a hit one found cached."""

    queries_tokens: int = 0
    hits_tokens: int = 0
    queries_blocks: int = 0
    hits_blocks: int = 0
    evictions: int = 0  # cached blocks reclaimed for fresh allocations
    # of the hits, tokens the runner had to compute again (`ModelRunner.recomputed`: the
    # llama.cpp runner, where no kept sequence held the block's cells any more)
    recomputed_tokens: int = 0

    def as_fields(self) -> dict[str, int | float]:
        return {
            "prefix_cache_queries": self.queries_tokens,
            "prefix_cache_hits": self.hits_tokens,
            "prefix_cache_hit_rate": round(self.hits_tokens / max(1, self.queries_tokens), 4),
            "prefix_cache_queries_blocks": self.queries_blocks,
            "prefix_cache_hits_blocks": self.hits_blocks,
            "prefix_cache_evictions": self.evictions,
            "prefix_cache_recomputed": self.recomputed_tokens,
        }


class BlockManager:
    """One pool of block ids `0..num_blocks-1` shared by per-session block tables.

    Token `i` of a session lives in block `table[i // block_size]`, slot
    `i % block_size`. Predicate/action pairs: `can_reserve` / `reserve`, `ensure`
    (allocate inside the reservation), `register` (a computed full block), `free`.
    With `prefix_cache=False` nothing is registered or found, and the pool behaves as
    a plain allocator.
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_cache: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.stats = PrefixCacheStats()
        # Empty blocks, a stack: the most recently freed is handed out first (warm in
        # cache); reversed so a fresh pool hands out 0, 1, 2, ...
        self._empty: list[int] = list(reversed(range(num_blocks)))
        # Unreferenced registered blocks, least recently released first.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._sessions: dict[str, _Session] = {}
        self._in_use = 0  # blocks with a reference
        self._unallocated = 0  # sum of the sessions' unallocated reservations

    # ---- accounting -------------------------------------------------------------

    @property
    def num_in_use_blocks(self) -> int:
        """Blocks some session's table holds (a shared one once)."""
        return self._in_use

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a registered prefix (reclaimable)."""
        return len(self._cached)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no session holds: empty ones and cached ones."""
        return len(self._empty) + len(self._cached)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks in use plus reservations not allocated yet: what is committed."""
        return self._in_use + self._unallocated

    @property
    def available_blocks(self) -> int:
        return self.num_blocks - self.num_reserved_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def used_tokens(self, session_id: str) -> int:
        return self._get(session_id).used_tokens

    def cached_tokens(self, session_id: str) -> int:
        return self._get(session_id).cached_tokens

    def reserved_tokens(self, session_id: str) -> int:
        s = self._get(session_id)
        return (len(s.table) + s.unallocated) * self.block_size

    def block_table(self, session_id: str) -> list[int]:
        return list(self._get(session_id).table)

    # ---- prefix lookups -----------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` that is registered."""
        if not self.prefix_cache:
            return []
        found: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def cost(self, num_tokens: int, hashes: Sequence[bytes] = ()) -> int:
        """Blocks a new session of `num_tokens` slots would take from `available_blocks`:
        those it adds, plus the cached ones it revives."""
        hits = self.match(hashes)
        revived = sum(1 for b in hits if self._refs[b] == 0)
        return revived + self.blocks_for(num_tokens) - len(hits)

    # ---- actions ----------------------------------------------------------------

    def can_reserve(self, num_tokens: int, hashes: Sequence[bytes] = ()) -> bool:
        return num_tokens >= 0 and self.cost(num_tokens, hashes) <= self.available_blocks

    def reserve(self, session_id: str, num_tokens: int, hashes: Sequence[bytes] = ()) -> int:
        """Set aside enough blocks for `num_tokens` token slots. The session's table
        starts with the cached blocks of the longest registered prefix of `hashes` (the
        content addresses of its leading full blocks); returns how many tokens those
        cover, whose KV need not be computed. Allocates nothing else yet."""
        if session_id in self._sessions:
            raise KVCapacityError(f"session {session_id!r} already holds a reservation")
        if not self.can_reserve(num_tokens, hashes):
            raise KVCapacityError(
                f"cannot reserve {num_tokens:,} tokens ({self.cost(num_tokens, hashes):,}"
                f" blocks) for {session_id!r}: {self.available_blocks:,} of"
                f" {self.num_blocks:,} blocks are unreserved"
            )
        hits = self.match(hashes)
        for block in hits:
            self._ref(block)
        cached = len(hits) * self.block_size
        session = _Session(self.blocks_for(num_tokens) - len(hits), hits, cached, cached)
        self._sessions[session_id] = session
        self._unallocated += session.unallocated
        self._check()
        return cached

    def extend_prefix(self, session_id: str, hashes: Sequence[bytes]) -> int:
        """Take blocks registered since the session's reservation: a session that has
        not allocated a block of its own yet (its prefill has not started) adopts the
        longest cached prefix of `hashes` as it is now. Each block found replaces one of
        its reserved blocks, so nothing new is committed (a block another session holds
        even frees one). Returns the tokens its cached prefix covers."""
        session = self._get(session_id)
        have = len(session.table)
        if session.cached_tokens != have * self.block_size:
            return session.cached_tokens  # it allocated blocks of its own: too late
        hits = self.match(hashes)
        more = hits[have : have + session.unallocated]
        if hits[:have] != session.table or not more:
            return session.cached_tokens
        for block in more:
            self._ref(block)
        session.table.extend(more)
        session.unallocated -= len(more)
        self._unallocated -= len(more)
        session.cached_tokens = session.used_tokens = len(session.table) * self.block_size
        self._check()
        return session.cached_tokens

    def record_query(
        self, known_tokens: int, cached_tokens: int, queried_blocks: int, hit_blocks: int
    ) -> None:
        """Count one session's lookup, once its prefill starts (what it found is final)."""
        if self.prefix_cache:
            self.stats.queries_tokens += known_tokens
            self.stats.hits_tokens += cached_tokens
            self.stats.queries_blocks += queried_blocks
            self.stats.hits_blocks += hit_blocks

    def ensure(self, session_id: str, total_tokens: int) -> list[int]:
        """Grow the session's table to cover `total_tokens` slots; return a copy of it.

        Never shrinks. Allocating beyond the session's reservation is a caller bug.
        """
        session = self._get(session_id)
        needed = self.blocks_for(total_tokens) - len(session.table)
        assert needed <= session.unallocated, (
            f"{session_id!r} needs {needed} more blocks for {total_tokens} tokens"
            f" but has {session.unallocated} reserved"
        )
        for _ in range(needed):
            session.table.append(self._take_fresh())
            session.unallocated -= 1
            self._unallocated -= 1
        session.used_tokens = max(session.used_tokens, total_tokens)
        self._check()
        return list(session.table)

    def register(self, session_id: str, index: int, address: bytes) -> None:
        """Block `index` of the session's table is full and its KV computed: make it
        findable under `address`. A block already registered, or an address another
        block already holds (two sessions computed the same prefix at once), is left
        as it is: the extra copy is freed as an ordinary block."""
        if not self.prefix_cache:
            return
        block = self._get(session_id).table[index]
        if block in self._hash_of or address in self._by_hash:
            return
        self._hash_of[block] = address
        self._by_hash[address] = block

    def free(self, session_id: str) -> None:
        """Drop the session's references and release its reservation. Its registered
        blocks stay cached (the last ones first to go) until a fresh allocation needs
        them; the others are empty again."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise KVCapacityError(f"unknown session {session_id!r}")
        # Tail first: a chain's later blocks are reclaimed before the ones they extend,
        # and the session's first block is the next empty one handed out.
        for block in reversed(session.table):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            self._in_use -= 1
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._empty.append(block)
        self._unallocated -= session.unallocated
        self._check()

    # ---- internals --------------------------------------------------------------

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._cached[block]
            self._in_use += 1
        self._refs[block] += 1

    def _take_fresh(self) -> int:
        if self._empty:
            block = self._empty.pop()
        else:
            # Cannot fail: unallocated reservations never exceed the free blocks.
            assert self._cached, "no free block inside a reservation"
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
            self.stats.evictions += 1
        self._refs[block] = 1
        self._in_use += 1
        return block

    def _forget(self, block: int) -> None:
        address = self._hash_of.pop(block)
        del self._by_hash[address]

    def _get(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise KVCapacityError(f"unknown session {session_id!r}")
        return session

    def _check(self) -> None:
        # O(1) invariants on every change; the full check is `check_invariants`.
        # Blocks in use plus unallocated reservations fit the pool, so every
        # unallocated reservation is backed by a free block.
        assert self._in_use + len(self._empty) + len(self._cached) == self.num_blocks
        assert 0 <= self._unallocated <= self.num_free_blocks

    def check_invariants(self) -> None:
        """Full O(num_blocks) consistency check, for tests and debugging."""
        refs = [0] * self.num_blocks
        unallocated = 0
        for sid, s in self._sessions.items():
            assert s.unallocated >= 0, f"{sid!r} allocated past its reservation"
            assert s.used_tokens <= len(s.table) * self.block_size
            assert s.cached_tokens <= s.used_tokens
            assert len(set(s.table)) == len(s.table), f"{sid!r} holds a block twice"
            for block in s.table:
                assert 0 <= block < self.num_blocks
                refs[block] += 1
            unallocated += s.unallocated
        assert refs == self._refs, "a reference count is wrong"
        empty, cached = set(self._empty), set(self._cached)
        assert len(empty) == len(self._empty), "a block is empty twice"
        assert not empty & cached, "a block is both empty and cached"
        for block in range(self.num_blocks):
            held = refs[block] > 0
            assert held + (block in empty) + (block in cached) == 1, f"block {block} is lost"
            if block in cached:
                assert block in self._hash_of, f"cached block {block} has no address"
            if block in empty:
                assert block not in self._hash_of, f"empty block {block} has an address"
        assert sum(r > 0 for r in refs) == self._in_use
        assert unallocated == self._unallocated <= self.num_free_blocks
        assert {b: h for h, b in self._by_hash.items()} == self._hash_of


__all__ = ["BlockManager", "KVCapacityError", "PrefixCacheStats"]
