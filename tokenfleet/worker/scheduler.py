"""Pure continuous-batching scheduler: which tokens go into the next forward pass.

One tick = one forward pass. Every decoding session contributes exactly one
token (its last sampled one) first; then up to `max_prefill_tokens_per_tick`
prompt tokens of waiting sessions, FIFO and chunked. Decode first, then bounded
prefill: a burst of new prompts never stalls generations in flight.

Token bookkeeping of one `SeqState` (n = num_tokens = len(prompt) + len(output)):

    all_ids        [p0 .. p_k, o0 .. o_j]       prompt, then tokens sampled so far
    num_computed   tokens whose KV is in the cache
    prefill        feeds all_ids[num_computed:n]; the logits at position n-1 give
                   the next token, so prefill of *all* known tokens ends in a sample
    decode         feeds all_ids[n-1] at position n-1 (num_computed == n-1), samples

A resumed session (crash recovery) starts with the outputs already emitted and
simply prefills prompt + outputs; its next sample continues at index len(output).

Ownership: the scheduler owns positions (`num_computed`, the status) and a
session's KV lifetime: `add` reserves prompt + max_new_tokens in the
`BlockManager` (admission has checked it fits), `finish` frees it, and physical
blocks are ensured in `schedule`. With prefix caching, `add` starts a session at
the end of its longest cached prefix (whole blocks, never the last known token:
there must be logits to sample from), and `complete_tick` registers each block that
a tick filled with computed KV, so later sessions can share it. A session about to start
whose next block another session is computing right now (the same address: the same
prefix in the same cache scope and salt, e.g. the n choices of one request) waits in line
until that block is registered, then takes it from the cache: a prefix that several
sessions need at once is prefilled once (`_look_up`). It never writes
`output_ids`: that list is the session's record of its emitted tokens
(`Session.emitted`, the same list), and the session alone decides when a job ends
(stop token, stop string, length).
Each tick the engine appends the sampled tokens, ends the sessions that are
done, then calls `complete_tick`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenfleet.kv import BlockManager
from tokenfleet.kv.prefix import chain_hashes
from tokenfleet.seam import DecodeStep, PrefillChunk, SeqState, SeqStatus, TickPlan


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int  # decode sequences per tick
    max_prefill_tokens_per_tick: int

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_prefill_tokens_per_tick < 1:
            raise ValueError(
                f"max_prefill_tokens_per_tick must be >= 1, got {self.max_prefill_tokens_per_tick}"
            )


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        rank: Callable[[str], int] = lambda _session_id: 0,
    ) -> None:
        self.config = config
        self.blocks = blocks
        # Where a session stands in the prefill order (lower first), as its owner says
        # (the engine's BandPolicy: bands, starved ones first); the default is one rank.
        self.rank = rank
        self._seqs: dict[str, SeqState] = {}
        # WAITING/PREFILL, FIFO; partial ones are at the head, but for one that started
        # while an unstarted one before it waited for a prefix in flight (`_look_up`)
        self._waiting: deque[SeqState] = deque()
        self._running: deque[SeqState] = deque()  # DECODE, rotated when over max_batch_size
        self._in_flight: TickPlan | None = None

    # ---- membership -------------------------------------------------------------

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, session_id: str) -> SeqState:
        return self._seqs[session_id]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_unstarted(self) -> int:
        """Admitted sessions no prefill chunk has touched yet."""
        return sum(1 for seq in self._waiting if seq.status is SeqStatus.WAITING)

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens admitted sessions still have to prefill."""
        return sum(seq.prefill_remaining for seq in self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def is_idle(self) -> bool:
        return not self._seqs

    def add(self, seq: SeqState) -> None:
        """Take an admitted session and reserve its worst-case KV (raises if it cannot)."""
        if seq.status is not SeqStatus.WAITING or seq.num_computed != 0:
            raise ValueError(f"{seq.session_id!r}: add() takes a fresh WAITING sequence")
        prefill_only = seq.max_new_tokens == 0 and not seq.output_ids  # its sample unused
        if not seq.prompt_ids or (seq.remaining_new_tokens < 1 and not prefill_only):
            raise ValueError(
                f"{seq.session_id!r}: needs a prompt and >= 1 token left to generate"
                f" (prompt {len(seq.prompt_ids)}, {len(seq.output_ids)}/{seq.max_new_tokens} done)"
            )
        cached = self.blocks.reserve(seq.session_id, seq.max_kv_tokens, seq.block_hashes)
        seq.num_computed = seq.num_cached = cached
        seq.num_registered = cached // self.blocks.block_size
        self._seqs[seq.session_id] = seq
        # Ahead of every unstarted sequence that ranks below it; never ahead of one whose
        # prefill has begun (only the head is partial).
        at = len(self._waiting)
        rank = self.rank(seq.session_id)
        while at > 0:
            before = self._waiting[at - 1]
            if before.status is not SeqStatus.WAITING or before.num_computed > before.num_cached:
                break
            if self.rank(before.session_id) <= rank:
                break
            at -= 1
        self._waiting.insert(at, seq)

    # ---- one tick -----------------------------------------------------------------

    def schedule(self) -> TickPlan:
        """Plan the next forward pass and ensure KV blocks for every scheduled token."""
        assert self._in_flight is None, "schedule() called twice without complete_tick()"
        decode: list[DecodeStep] = []
        take = min(len(self._running), self.config.max_batch_size)
        for seq in list(self._running)[:take]:
            n = seq.num_tokens
            assert seq.num_computed == n - 1
            table = self.blocks.ensure(seq.session_id, n)
            decode.append(DecodeStep(seq, seq.output_ids[-1], n - 1, n, table))
        # Round robin: the ones served now go to the back of the line.
        self._running.rotate(-take)

        prefill: list[PrefillChunk] = []
        budget = self.config.max_prefill_tokens_per_tick
        started: list[SeqState] = []  # sessions whose first prefill chunk is in this plan
        for seq in self._waiting:
            if budget == 0:
                break
            if seq.status is SeqStatus.WAITING and seq.num_computed == seq.num_cached:
                if self._look_up(seq, started):
                    continue  # its prefix is being computed: it waits for the cache
                started.append(seq)
            length = min(seq.prefill_remaining, budget)
            start = seq.num_computed
            table = self.blocks.ensure(seq.session_id, start + length)
            samples = start + length == seq.num_tokens
            prefill.append(PrefillChunk(seq, start, length, samples, table))
            budget -= length

        plan = TickPlan(decode, prefill)
        self._in_flight = None if plan.is_empty else plan
        return plan

    def complete_tick(self, plan: TickPlan) -> None:
        """Record that `plan` ran: advance the cache positions, start decoding.

        Call it after every sampling session's token was appended to its
        `output_ids` (or the session was finished). Sessions finished while the
        plan ran are skipped.
        """
        if plan.is_empty:
            return
        assert plan is self._in_flight, "complete_tick() for a plan that is not in flight"
        self._in_flight = None
        for step in plan.decode:
            seq = step.seq
            if self._seqs.get(seq.session_id) is seq:
                assert seq.num_tokens == step.context_len + 1, "decode token not appended"
                seq.num_computed = step.context_len
                self._register(seq)
        for chunk in plan.prefill:
            seq = chunk.seq
            if self._seqs.get(seq.session_id) is not seq:
                continue
            seq.num_computed = chunk.context_len
            self._register(seq)
            if not chunk.samples:
                seq.status = SeqStatus.PREFILL
                continue
            assert seq.num_tokens == chunk.context_len + 1, "first token not appended"
            seq.status = SeqStatus.DECODE
            self._waiting.remove(seq)
            self._running.append(seq)

    def _look_up(self, seq: SeqState, started: list[SeqState]) -> bool:
        """Just before a session's first prefill chunk: adopt what the cache holds of its
        prefix now (sessions admitted together find the blocks the first of them
        computed in the ticks since). True: the next block it would compute is being
        computed by another session (`started` in this plan, or prefilling since an
        earlier tick), so it waits: it looks again next tick, and it computes only what
        no one else is computing. Waiting, not forking the other's blocks before they
        hold KV: the block manager and the runner keep one rule (a shared block is a
        computed one), a session that waits loses no work (it would spend the same
        ticks computing the same tokens), and a cancelled or preempted leader leaves it
        to compute what is missing itself. Otherwise it counts its lookup, once."""
        if seq.hash_root is None or not self.blocks.prefix_cache:
            return False
        size = self.blocks.block_size
        cached = self.blocks.extend_prefix(seq.session_id, seq.block_hashes)
        seq.num_computed = seq.num_cached = cached
        seq.num_registered = max(seq.num_registered, cached // size)
        if self._computed_elsewhere(seq, started):
            return True
        if not seq.looked_up:
            seq.looked_up = True
            queried = len(seq.block_hashes)
            self.blocks.record_query(seq.num_tokens, cached, queried, cached // size)
        return False

    def _computed_elsewhere(self, seq: SeqState, started: list[SeqState]) -> bool:
        """Whether another session's prefill in flight will register `seq`'s next block
        (chained addresses: equal at one index means the whole prefix up to it is). With
        no other prefill in flight, or none sharing it, this is a few comparisons."""
        block = seq.num_cached // self.blocks.block_size
        if block >= len(seq.block_hashes):
            return False  # the cache has all it could give
        address = seq.block_hashes[block]

        def computes(other: SeqState) -> bool:
            hashes = other.block_hashes
            return other.num_registered <= block < len(hashes) and hashes[block] == address

        if any(computes(other) for other in started):
            return True
        return any(other.status is SeqStatus.PREFILL and computes(other) for other in self._waiting)

    def _register(self, seq: SeqState) -> None:
        """Offer the blocks the last tick filled to the prefix cache."""
        if seq.hash_root is None or not self.blocks.prefix_cache:
            return
        size = self.blocks.block_size
        full = seq.num_computed // size
        if seq.num_registered >= full:
            return
        known = len(seq.block_hashes)
        if known < full:
            parent = seq.block_hashes[-1] if known else seq.hash_root
            tokens = seq.all_ids[: full * size]
            seq.block_hashes += chain_hashes(tokens, size, parent, start_block=known)
        for index in range(seq.num_registered, full):
            self.blocks.register(seq.session_id, index, seq.block_hashes[index])
        seq.num_registered = full

    # ---- endings ------------------------------------------------------------------

    def finish(self, session_id: str) -> SeqState:
        """End a session in any state, free its KV, and return it marked FINISHED."""
        seq = self._seqs.pop(session_id)
        if seq.status is SeqStatus.DECODE:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.blocks.free(session_id)
        return seq
