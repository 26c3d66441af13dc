"""Block allocator with whole-session reservations and lazy physical allocation.

Sessions are never evicted mid-generation, so a session is admitted only if its
whole worst case (prompt + max_new_tokens) can be *reserved* up front. Physical
blocks are then handed out lazily by `ensure` as tokens arrive, so each session
wastes at most one partly filled block, and a session that stops early (stop
token, cancel) never touched the rest of its reservation.

Accounting, in blocks:

    num_blocks == num_free_blocks + num_allocated_blocks
    num_reserved_blocks == sum of per-session reservations (allocated ones included)
    available_blocks == num_blocks - num_reserved_blocks   (what a new session may reserve)

Every reservation can always be honoured: a session allocates only inside its
own reservation, and reservations never exceed the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class KVCapacityError(ValueError):
    """A reservation the pool cannot honour, or a duplicate/unknown session id.

    Admission checks `can_reserve` first, so reaching this is a caller bug.
    """


@dataclass
class _Session:
    reserved_blocks: int
    table: list[int] = field(default_factory=list)  # block ids, in token order
    used_tokens: int = 0  # token slots covered by `ensure` so far


class BlockManager:
    """One pool of block ids `0..num_blocks-1` shared by per-session block tables.

    Token `i` of a session lives in block `table[i // block_size]`, slot
    `i % block_size`. Predicate/action pairs: `can_reserve` / `reserve`,
    `ensure` (allocate inside the reservation), `free`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is handed out first (warm in cache);
        # reversed so a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(reversed(range(num_blocks)))
        self._sessions: dict[str, _Session] = {}
        self._reserved_total = 0

    # ---- accounting -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_allocated_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_reserved_blocks(self) -> int:
        return self._reserved_total

    @property
    def available_blocks(self) -> int:
        return self.num_blocks - self._reserved_total

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

    def reserved_tokens(self, session_id: str) -> int:
        return self._get(session_id).reserved_blocks * self.block_size

    def block_table(self, session_id: str) -> list[int]:
        return list(self._get(session_id).table)

    # ---- actions ----------------------------------------------------------------

    def can_reserve(self, num_tokens: int) -> bool:
        return num_tokens >= 0 and self.blocks_for(num_tokens) <= self.available_blocks

    def reserve(self, session_id: str, num_tokens: int) -> None:
        """Set aside enough blocks for `num_tokens` token slots; allocates nothing yet."""
        if session_id in self._sessions:
            raise KVCapacityError(f"session {session_id!r} already holds a reservation")
        if not self.can_reserve(num_tokens):
            raise KVCapacityError(
                f"cannot reserve {num_tokens:,} tokens ({self.blocks_for(num_tokens):,} blocks)"
                f" for {session_id!r}: {self.available_blocks:,} of {self.num_blocks:,}"
                " blocks are unreserved"
            )
        blocks = self.blocks_for(num_tokens)
        self._sessions[session_id] = _Session(reserved_blocks=blocks)
        self._reserved_total += blocks
        self._check()

    def ensure(self, session_id: str, total_tokens: int) -> list[int]:
        """Grow the session's table to cover `total_tokens` slots; return a copy of it.

        Never shrinks. Allocating beyond the session's reservation is a caller bug.
        """
        session = self._get(session_id)
        needed = self.blocks_for(total_tokens)
        assert needed <= session.reserved_blocks, (
            f"{session_id!r} needs {needed} blocks for {total_tokens} tokens"
            f" but reserved {session.reserved_blocks}"
        )
        while len(session.table) < needed:
            # Cannot fail: unallocated reservations never exceed the free list.
            assert self._free, "free list empty inside a reservation"
            session.table.append(self._free.pop())
        session.used_tokens = max(session.used_tokens, total_tokens)
        self._check()
        return list(session.table)

    def free(self, session_id: str) -> None:
        """Return the session's blocks to the pool and release its reservation."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise KVCapacityError(f"unknown session {session_id!r}")
        # Reverse so the session's first block is the next one handed out.
        self._free.extend(reversed(session.table))
        self._reserved_total -= session.reserved_blocks
        self._check()

    # ---- internals --------------------------------------------------------------

    def _get(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise KVCapacityError(f"unknown session {session_id!r}")
        return session

    def _check(self) -> None:
        # O(1) invariants on every change; the full disjointness check is `check_invariants`.
        # Allocated blocks all sit inside reservations, and reservations fit the pool,
        # so every unallocated reservation is backed by a free block.
        assert self.num_allocated_blocks <= self._reserved_total <= self.num_blocks

    def check_invariants(self) -> None:
        """Full O(num_blocks) consistency check, for tests and debugging."""
        seen: set[int] = set(self._free)
        assert len(seen) == len(self._free), "a block is on the free list twice"
        allocated = 0
        reserved = 0
        for sid, s in self._sessions.items():
            assert len(s.table) <= s.reserved_blocks, f"{sid!r} allocated past its reservation"
            assert s.used_tokens <= len(s.table) * self.block_size
            for block in s.table:
                assert 0 <= block < self.num_blocks
                assert block not in seen, f"block {block} is in two places"
                seen.add(block)
            allocated += len(s.table)
            reserved += s.reserved_blocks
        assert len(seen) == self.num_blocks, "a block leaked"
        assert allocated == self.num_allocated_blocks
        assert reserved == self._reserved_total
