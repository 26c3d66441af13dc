"""A node's memory and slot budgets, and the decision for each incoming job.

Admission is arithmetic over named quantities; it reads the live state it is
handed and changes nothing. The worker acts on the decision: on ADMITTED it
hands the session to the scheduler (which reserves its KV), on QUEUED it keeps
the job in its small local waiting list and retries it with `fits_now`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tokenfleet.kv import BlockManager, KVLayout
from tokenfleet.reasons import AdmissionReason


def _human(num_bytes: int) -> str:
    """1536 -> '1.5 KiB', 1048576 -> '1 MiB': the largest unit that keeps the value >= 1."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{value:,.1f}".removesuffix(".0") + f" {unit}"


@dataclass(frozen=True, kw_only=True)
class NodeBudget:
    """What one worker may hold. Validated on construction; derived sizes are properties.

    weight_bytes        resident model weights (reported, not admitted against)
    kv_budget_bytes     bytes for the paged KV pool; rounded down to whole blocks
    scratch_*_bytes     per-session activation/sampler scratch: the most one session
                        may ask for, and the sum all active sessions may hold
    max_active          sessions holding KV at once (prefilling or decoding)
    max_waiting         jobs pulled from Redis that wait locally for room
    max_batch_size      decode sequences in one forward pass
    max_prefill_tokens_per_tick  prefill tokens in one forward pass
    """

    weight_bytes: int
    kv_budget_bytes: int
    scratch_per_session_bytes: int
    scratch_total_bytes: int
    max_active: int
    max_batch_size: int
    max_prefill_tokens_per_tick: int
    layout: KVLayout
    max_waiting: int = 4
    # the runner's bound on one session's KV tokens (`ModelSpec.max_session_tokens`)
    session_cap: int | None = None

    def advertised(self) -> dict[str, int]:
        """The limits a worker's heartbeat shows (`tokenfleet status`, the gateway)."""
        return {
            "kv_budget_bytes": self.kv_budget_bytes,
            "max_active": self.max_active,
            "max_batch_size": self.max_batch_size,
            "max_prefill_tokens_per_tick": self.max_prefill_tokens_per_tick,
            "max_waiting": self.max_waiting,
        }

    def __post_init__(self) -> None:
        non_negative = ("weight_bytes", "scratch_per_session_bytes", "scratch_total_bytes")
        for name in (*non_negative, "max_waiting"):
            if getattr(self, name) < 0:
                raise ValueError(f"NodeBudget.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_active", "max_batch_size", "max_prefill_tokens_per_tick"):
            if getattr(self, name) < 1:
                raise ValueError(f"NodeBudget.{name} must be >= 1, got {getattr(self, name)}")
        if self.scratch_per_session_bytes > self.scratch_total_bytes:
            raise ValueError(
                f"scratch_per_session_bytes ({self.scratch_per_session_bytes:,}) exceeds"
                f" scratch_total_bytes ({self.scratch_total_bytes:,})"
            )
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"kv_budget_bytes ({self.kv_budget_bytes:,}) holds no whole KV block"
                f" of {self.layout.bytes_per_block:,} bytes"
            )

    @property
    def num_kv_blocks(self) -> int:
        return self.layout.num_blocks_for_budget(self.kv_budget_bytes)

    @property
    def max_tokens_per_session(self) -> int:
        """Largest prompt + max_new_tokens one session could hold with the node otherwise empty."""
        whole = self.num_kv_blocks * self.layout.block_size
        return whole if self.session_cap is None else min(whole, self.session_cap)

    def new_block_manager(self, *, prefix_cache: bool = False) -> BlockManager:
        return BlockManager(self.num_kv_blocks, self.layout.block_size, prefix_cache=prefix_cache)


@dataclass(frozen=True)
class AdmissionRequest:
    """What admission needs to know about a job. For a resumed job, `prompt_tokens` and
    `max_new_tokens` are the original ones: tokens already emitted are inside that total."""

    job_id: str
    prompt_tokens: int
    max_new_tokens: int
    scratch_bytes: int = 0
    # content addresses of its leading full blocks: blocks the prefix cache holds
    # under them are shared, not charged again (`BlockManager.cost`)
    block_hashes: tuple[bytes, ...] = ()

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class AdmissionDecision:
    reason: AdmissionReason
    message: str

    @property
    def accepted(self) -> bool:
        return self.reason.accepted


class Admission:
    """Decides each incoming job against a `NodeBudget` and the node's live state.

    `decide` applies these rules in order; the first that matches wins:

    1. prompt_tokens < 1, max_new_tokens < 0 or scratch_bytes < 0 -> REJECTED_INVALID
       (max_new_tokens 0: a prefill-only job, e.g. for its prompt's logprobs)
    2. the id is already active or waiting here                    -> REJECTED_DUPLICATE
    3. prompt + max_new > the whole KV pool (can never fit)        -> REJECTED_KV_BUDGET
    4. scratch > the per-session cap (<= the node's total, validated) -> REJECTED_SCRATCH_BUDGET
    5. nobody waits locally, an active slot is free, its KV can be
       reserved (blocks it shares with the prefix cache are not charged
       again) and its scratch fits next to the active sessions'    -> ADMITTED
    6. the local waiting list has a free slot                      -> QUEUED
    7. otherwise                                                   -> REJECTED_QUEUE_FULL

    Rule 5 keeps the local list FIFO: a new job never overtakes one already
    waiting, so a large job cannot starve behind a stream of small ones. The
    worker promotes the head of its waiting list with `fits_now`.
    """

    def __init__(self, budget: NodeBudget) -> None:
        self.budget = budget

    def decide(
        self,
        req: AdmissionRequest,
        *,
        active_ids: Collection[str],
        waiting_ids: Collection[str],
        kv: BlockManager,
        scratch_in_use: int,
    ) -> AdmissionDecision:
        b = self.budget
        if req.prompt_tokens < 1 or req.max_new_tokens < 0 or req.scratch_bytes < 0:
            return AdmissionDecision(
                AdmissionReason.REJECTED_INVALID,
                f"prompt_tokens ({req.prompt_tokens:,}) must be >= 1, max_new_tokens"
                f" ({req.max_new_tokens:,}) and scratch_bytes ({req.scratch_bytes:,}) >= 0",
            )
        if req.job_id in active_ids or req.job_id in waiting_ids:
            where = "active" if req.job_id in active_ids else "waiting"
            return AdmissionDecision(
                AdmissionReason.REJECTED_DUPLICATE,
                f"job {req.job_id!r} is already {where} on this node",
            )
        if req.kv_tokens > b.max_tokens_per_session:
            need = b.layout.blocks_for(req.kv_tokens) * b.layout.bytes_per_block
            return AdmissionDecision(
                AdmissionReason.REJECTED_KV_BUDGET,
                f"needs {req.kv_tokens:,} KV tokens ({_human(need)}) but "
                + (
                    f"one session may hold {b.max_tokens_per_session:,} on this runner (its "
                    "KV stream per session)"
                    if b.max_tokens_per_session < b.num_kv_blocks * b.layout.block_size
                    else f"the node's whole KV budget holds {b.max_tokens_per_session:,} "
                    f"({_human(b.kv_budget_bytes)})"
                ),
            )
        if req.scratch_bytes > b.scratch_per_session_bytes:
            return AdmissionDecision(
                AdmissionReason.REJECTED_SCRATCH_BUDGET,
                f"needs {req.scratch_bytes:,} scratch bytes ({_human(req.scratch_bytes)}) but one"
                f" session may use at most {b.scratch_per_session_bytes:,}"
                f" ({_human(b.scratch_per_session_bytes)})",
            )
        if not waiting_ids and self.fits_now(
            req, active_count=len(active_ids), kv=kv, scratch_in_use=scratch_in_use
        ):
            return AdmissionDecision(
                AdmissionReason.ADMITTED,
                f"admitted: {req.kv_tokens:,} KV tokens reserved,"
                f" {len(active_ids) + 1:,}/{b.max_active:,} active",
            )
        why = self._why_not_now(
            req,
            active_count=len(active_ids),
            waiting_count=len(waiting_ids),
            kv=kv,
            scratch_in_use=scratch_in_use,
        )
        if len(waiting_ids) < b.max_waiting:
            return AdmissionDecision(
                AdmissionReason.QUEUED,
                f"queued at {len(waiting_ids) + 1:,}/{b.max_waiting:,}: {why}",
            )
        return AdmissionDecision(
            AdmissionReason.REJECTED_QUEUE_FULL,
            f"no room now ({why}) and the local waiting list is full"
            f" ({len(waiting_ids):,}/{b.max_waiting:,})",
        )

    def fits_now(
        self, req: AdmissionRequest, *, active_count: int, kv: BlockManager, scratch_in_use: int
    ) -> bool:
        """Whether `req` can start this moment: a free active slot, reservable KV, scratch."""
        return (
            active_count < self.budget.max_active
            and kv.can_reserve(req.kv_tokens, req.block_hashes)
            and scratch_in_use + req.scratch_bytes <= self.budget.scratch_total_bytes
        )

    def room(self, *, active_count: int, waiting_count: int, kv: BlockManager) -> int:
        """How many jobs the worker should read from Redis now (>= 0).

        Free waiting slots always count. Free active slots count only while nobody
        waits locally (new jobs would queue behind them anyway) and the KV pool has
        an unreserved block. This is optimistic about job sizes: a batch of large
        jobs read into free active slots may still find the waiting list full.
        """
        b = self.budget
        free_waiting = max(0, b.max_waiting - waiting_count)
        free_active = max(0, b.max_active - active_count)
        if waiting_count > 0 or kv.available_blocks == 0:
            free_active = 0
        return free_active + free_waiting

    def _why_not_now(
        self,
        req: AdmissionRequest,
        *,
        active_count: int,
        waiting_count: int,
        kv: BlockManager,
        scratch_in_use: int,
    ) -> str:
        b = self.budget
        if waiting_count > 0:
            return f"{waiting_count:,} job(s) already waiting ahead"
        if active_count >= b.max_active:
            return f"all {b.max_active:,} active slots are taken"
        if not kv.can_reserve(req.kv_tokens, req.block_hashes):
            return (
                f"needs {kv.cost(req.kv_tokens, req.block_hashes):,} KV blocks but"
                f" {kv.available_blocks:,} of {kv.num_blocks:,} are unreserved"
            )
        return (
            f"needs {req.scratch_bytes:,} scratch bytes but {scratch_in_use:,}"
            f" of {b.scratch_total_bytes:,} are in use"
        )
