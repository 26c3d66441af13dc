"""The worker's Redis loop: pull → admit → tick → publish+finish.

One process, one engine, one model's jobs streams (one per priority band). Each
iteration:

1. pull     take the entries the last round trip read (and, about once a second,
            the entries of dead workers); block briefly for new ones only when
            nothing is running.
2. admit    check each entry against its job's state (only the entry the submit
            script recorded is the job: accept.lua), decode it, hand it to the engine.
3. tick     one engine step (one forward pass).
4. publish  ONE pipelined round trip: tick.lua with every held job's new token
            events and terminal writes — each accepted only while this worker owns
            the job's current delivery — plus the heartbeat when due, plus a read
            of what the engine has room for next (pull.lua: the highest band first).

Between the replies and the next pull, a job this worker has held past `--hold-s`
without starting it (its slots kept busy by higher bands) goes back to its band's
stream (requeue.lua, fenced), for any worker with room (worker/bands.py).

Ownership is fenced in the same script that writes, per job per tick: a worker
that was paused (SIGSTOP) or cut off while another worker took its jobs over
learns so at its next publish, writes nothing for them, and drops them at once
(KV freed, no more compute). Each token index reaches a job's replay stream
once: the job hash counts the indices the stream holds (`emitted`), so a
resync after a reconnect resends every event and only what is missing is
appended.

The loop never touches Redis itself: `WorkerQueue` (worker/queue.py) is the edge, one
call per thing the loop wants, and a round trip's replies come back by name. Entries
read become held jobs or dead letters in `Intake` (worker/intake.py); what is to be
published for a job is the engine's outbox for it (`Engine.outbox`).

Nothing is dropped when Redis goes away: tokens live in the engine's outboxes
until a publish reports them written, a job stays held until its terminal write
succeeded, the engine is not stepped while a tick's writes are unsent, and the
loop reconnects with backoff. redis-py's own command retries are switched off:
a retried XREADGROUP whose first reply was lost would leave entries pending to
this worker that it never saw; instead every lost connection makes the loop
re-read its own pending list once it is back. An out-of-memory Redis is waited
out the same way (every held job kept); a refused password or a missing ACL
permission stops the worker with exit code 3 and a message naming it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import redis

from tokenfleet.backoff import Backoff
from tokenfleet.keys import BANDS, GROUP, Keys
from tokenfleet.protocol import MAX_STREAM_INTERVAL
from tokenfleet.reasons import FinishReason
from tokenfleet.redis_errors import RedisAccessError, classify_redis_error
from tokenfleet.worker.engine import Engine
from tokenfleet.worker.intake import Held, Intake
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.queue import PullAsk, RoundTrip, TickReply, TickVerdict, WorkerQueue
from tokenfleet.worker.recovery import Delivery
from tokenfleet.worker.session import Finished

log = logging.getLogger("tokenfleet.worker")
T = TypeVar("T")
EXIT_REDIS_ACCESS = 3  # exit code: Redis refused our credentials or a command


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerOptions:
    name: str = field(default_factory=default_worker_name)
    model: str | None = None  # which jobs streams (None: the default model's)
    burst: bool = False  # exit once the streams are empty and nothing is active
    idle_block_ms: int = 500  # XREADGROUP BLOCK when nothing runs
    heartbeat_s: float = 1.0
    claim_every_s: float = 1.0
    max_deliveries: int = 3  # a job delivered more often goes to the dead letters
    drain_timeout_s: float = 30.0
    # Nothing running here and the last entries read were all put back (their tenants
    # are at max_running): wait this long before reading again rather than spin on them.
    deferred_backoff_s: float = 0.05
    reconnect_max_s: float = 5.0
    overlap: bool = True  # read a tick's replies after the next forward (see `iteration`)
    # Send a job's token events every this many ticks, coalesced into one replay entry
    # and one message (its first token and its end at once): Redis's work per token
    # falls about as 1/interval, each token waits up to interval-1 ticks more
    # (docs/benchmarks.md, coordination cost)
    stream_interval: int = 1
    # Or by time (`--stream-interval-ms`): a tick sends the held tokens once this many
    # seconds passed since the last tick that did (or MAX_STREAM_INTERVAL ticks, the
    # payload's bound): fast ticks share a send, a tick slower than this sends every
    # time, and at steady ticks no token waits as long as this
    stream_interval_s: float | None = None
    # Durable mode (a Redis with replicas): each round trip ends with WAIT for this many
    # replicas, and a token reaches clients only once acknowledged (docs/design.md,
    # "Failover"); 0: off, tokens are published as they are written
    wait_replicas: int = 0
    wait_timeout_ms: int = 100
    info: dict[str, Any] = field(default_factory=dict)  # identity fields for the heartbeat

    @property
    def durable(self) -> bool:
        return self.wait_replicas > 0

    def __post_init__(self) -> None:
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(
                f"stream_interval must be in 1..{MAX_STREAM_INTERVAL}, got {self.stream_interval}"
            )
        if self.stream_interval_s is not None:
            if not self.stream_interval_s > 0:
                raise ValueError(f"stream_interval_s must be > 0, got {self.stream_interval_s}")
            if self.stream_interval != 1:
                raise ValueError("stream_interval and stream_interval_s exclude each other")


@dataclass
class _Sent:
    """A round trip in flight: the held jobs it wrote for (in order), and the engine
    error each carried instead of a terminal block (None for most)."""

    trip: RoundTrip
    held: list[Held]
    errors: list[Finished | None]
    durable: list[int]  # durable mode: per write, the `durable` index it announced


class Worker:
    def __init__(
        self,
        engine: Engine,
        client: redis.Redis,
        keys: Keys,
        options: WorkerOptions,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.keys = keys
        self.options = options
        self.queue = WorkerQueue(client, keys, options.name, options.model)
        self.held: dict[str, Held] = {}  # job id -> what this worker answers for
        self.intake = Intake(
            engine, self.queue, self.held, max_deliveries=options.max_deliveries, metrics=metrics
        )
        self.prefetched: list[Delivery] = []  # deliveries read with the last publish, not admitted
        self.in_flight: _Sent | None = None  # sent, replies not read yet
        self.draining = False
        self.stop_now = False
        self.redis_oom = False  # Redis refused a write for lack of memory; backing off
        self._drain_deadline = 0.0
        self._last_heartbeat = 0.0
        self._last_claim = 0.0
        self._last_floor = 0.0
        self._ticks = 0  # engine ticks run (flush ticks: every stream_interval'th)
        # by time (stream_interval_s): the last flush tick's number and when it ended
        self._flush_tick = 0
        self._last_flush = -math.inf
        self._replicas_warned = -math.inf  # when durable mode last said a WAIT fell short
        self._resync = False  # after a reconnect: re-read own pending list, resend events
        self._all_deferred = False  # the last admit put back every entry it read
        self.started_at = time.time()

    # ---- lifecycle -------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.draining:
            log.warning("second signal: stopping now; unfinished jobs go to other workers")
            self.stop_now = True
            return
        log.info(
            "signal %s: draining (no new jobs, %.0fs to finish)",
            signum,
            self.options.drain_timeout_s,
        )
        self.draining = True
        self._drain_deadline = time.monotonic() + self.options.drain_timeout_s

    def run(self) -> int:
        """Serve until drained, stopped, or (burst) the stream is empty. Returns the exit code."""
        try:
            self._with_reconnect(self._start)
            while not self.stop_now:
                self._with_reconnect(self.iteration)
                if self._with_reconnect(self._should_exit):  # burst mode asks Redis too
                    break
            self._with_reconnect(self._leave, once=self.stop_now)
        except RedisAccessError as exc:
            log.error("%s", exc)
            return EXIT_REDIS_ACCESS
        return 0

    def _start(self) -> None:
        self.queue.ensure_group()
        self.queue.preflight()  # every command the loop will send, or a named error now
        self.heartbeat(force=True)

    def _leave(self) -> None:
        """Hand back what was not finished: drop the heartbeat so others claim it now."""
        self._receive()
        left = len(self.held) + len(self.prefetched)
        if left:
            log.info("handing back %d unfinished job(s)", left)
        self.queue.leave()

    def _should_exit(self) -> bool:
        busy = bool(self.engine.has_work or self.held or self.prefetched or self.in_flight)
        if self.draining:
            return not busy or time.monotonic() >= self._drain_deadline
        if self.options.burst and not busy:
            return self.queue.is_empty()
        return False

    def _with_reconnect(self, action: Callable[[], T], *, once: bool = False) -> T | None:
        """Run `action` and return its value; while Redis is unreachable or out of memory,
        back off and retry until it answers (None if told to stop, or the drain deadline
        passed, meanwhile; `once`: a single try).

        Any lost connection may have lost a reply (a read, a claim) or, on a Redis
        without persistence, writes: the next iteration resyncs first. Credentials or
        ACL permissions refused raise `RedisAccessError`: retrying cannot fix them."""
        backoff = Backoff(first_s=0.05, max_s=self.options.reconnect_max_s, jitter=0.0)
        while True:
            try:
                value = action()
                if backoff.since is not None:
                    back = "reconnected to redis"
                    if self.redis_oom:
                        back = "redis accepts writes again"
                    log.warning("%s after %.1fs", back, backoff.lasted(time.monotonic()))
                self.redis_oom = False
                return value
            except redis.RedisError as exc:
                kind = classify_redis_error(exc)  # raises RedisAccessError for auth / ACL
                if kind is None:
                    raise
                self._resync = True
                pause = backoff.failed(time.monotonic())
                if kind == "oom":
                    self.redis_oom = True
                    log.warning(
                        "redis is out of memory (%s); holding %d job(s), retrying in %.2fs",
                        exc,
                        len(self.held),
                        pause,
                    )
                else:
                    log.warning("redis unavailable (%s); retrying in %.2fs", exc, pause)
            if once or self.stop_now or self._drain_expired():
                return None
            time.sleep(pause)
            self._keep_alive()

    def _drain_expired(self) -> bool:
        if self.draining and time.monotonic() >= self._drain_deadline:
            log.warning("drain deadline passed while redis was unavailable: exiting")
            self.stop_now = True
            return True
        return False

    def _keep_alive(self) -> None:
        """Between retries: rejoin the group and keep the heartbeat alive. Under maxmemory
        the heartbeat's HSET is refused but its EXPIRE is not, so held jobs stay ours."""
        try:
            self.queue.ping()
            if self.redis_oom:
                self.heartbeat(force=True)
            else:
                self.queue.ensure_group()
        except redis.RedisError as exc:
            classify_redis_error(exc)

    # ---- one iteration -----------------------------------------------------------

    def iteration(self) -> None:
        """tick → (replies of the last round trip) → pull + admit → send this tick's.

        The round trip of tick N is read after tick N+1 computed, so Redis's work and
        the network overlap the forward pass. Its writes are fenced all the same; a job
        lost or cancelled is dropped one tick later than it could be, never written."""
        if self._resync:
            self._resync_after_reconnect()
        flush = self._flush
        durable = self.options.durable
        if self.in_flight is None and any(h.outbox.due(flush, durable) for h in self.held.values()):
            self.publish()  # catch up (after a failure) before computing anything new
            return
        self.tick()
        self._receive()
        self._give_back_overdue()  # nothing is in flight here
        self.pull()
        self._send()
        if not self.options.overlap:
            self._receive()

    def _resync_after_reconnect(self) -> None:
        """Recover what a lost connection may have hidden: the round trip it cut (its
        replies are gone; what it carried is still in the outboxes and goes out again),
        entries read but never seen, and token events written but not persisted
        (tick.lua appends only missing ones)."""
        sent, self.in_flight = self.in_flight, None
        if sent is not None:
            sent.trip.abandon()
        known = {h.delivery.entry_id for h in self.held.values()}
        known |= {d.entry_id for d in self.prefetched}
        self.intake.admit([d for d in self.queue.own_pending(1000) if d.entry_id not in known])
        for held in self.held.values():
            held.outbox.rewind()
        self._resync = False

    def tick(self) -> None:
        if not self.engine.has_work:
            return
        self._ticks += 1
        out = self.engine.step()  # outcomes land in the held jobs' outboxes
        if self.options.stream_interval_s is not None:
            self._time_flush(time.monotonic())
        if self.metrics is not None:
            self.metrics.observe_tick(self.engine, out)

    def pull(self) -> None:
        deliveries, self.prefetched = self.prefetched, []
        room = self.engine.room() - len(deliveries)
        if not self.draining and room > 0:
            now = time.monotonic()
            if now - self._last_claim >= self.options.claim_every_s:
                self._last_claim = now
                claimed = self.queue.claim_orphans(room)
                if claimed:
                    log.info("claimed %d orphaned job(s) of dead workers", len(claimed))
                deliveries += claimed
                room -= len(claimed)
            if not (self.engine.has_work or self.held or deliveries):
                if self._all_deferred:
                    self._all_deferred = False
                    time.sleep(self.options.deferred_backoff_s)
                fresh = self.queue.read(room, self.options.idle_block_ms)
                if 0 < len(fresh) < room:
                    # A blocked read wakes on the first new entry; take what else is there
                    # now rather than start a tick with one job while the others wait.
                    fresh += self.queue.read(room - len(fresh), None)
                deliveries += fresh
        self._all_deferred = self.intake.admit(deliveries)

    def _give_back_overdue(self) -> None:
        """Jobs this worker could not start within the hold bound go back to their band's
        stream (requeue.lua, fenced), for a worker with room: a job never waits behind one
        worker's higher-band traffic while another could serve it. Only jobs whose
        published state is whole (no event unsent) move; the next worker resumes after
        their published tokens. Not while draining: those are handed back at exit."""
        if self.draining:
            return
        for job_id in self.engine.overdue():
            held = self.held.get(job_id)
            if held is None or held.dirty:
                continue
            if self.queue.requeue(held.delivery) is None:
                continue  # not ours any more: the next round trip says so and drops it
            self.engine.give_back(job_id)
            del self.held[job_id]
            log.info("job %s waited here past the hold bound: back in its stream", job_id)

    # ---- publish -----------------------------------------------------------------

    def publish(self) -> None:
        """Send this tick's round trip (see `_send`) and wait for its replies."""
        self._send()
        self._receive()

    def _send(self) -> None:
        """Send, without waiting: every held job's fenced writes, the heartbeat when due,
        and a read of the entries the engine has room for next (WorkerQueue.send)."""
        assert self.in_flight is None, "a round trip is already in flight"
        flush = self._flush
        durable = self.options.durable
        held = [h for h in self.held.values() if h.outbox.in_tick(flush, durable)]
        writes = [h.write(durable) for h in held]
        beat = self._heartbeat_fields() if self._heartbeat_due() else None
        pull = None
        # Between flush ticks a busy worker reads no new entries unless a round trip goes
        # anyway (a first token, an end, the heartbeat): a tick with nothing to write then
        # costs no round trip at all, and a job waiting in the stream is read within
        # stream_interval ticks, as its tokens would be sent
        reads = flush or bool(held) or beat is not None
        if not self.draining and (self.engine.has_work or held) and reads:
            # plus interactive jobs that would preempt lower bands running here (looked
            # for on flush ticks: a full worker's every-tick look was most of a coalescing
            # fleet's Redis work per tick)
            top = sum(1 for d in self.prefetched if d.band.rank == 0)
            pull = PullAsk(
                count=max(0, self.engine.room() - len(self.prefetched)),
                extra=max(0, self.engine.interactive_room() - top) if flush else 0,
                floor=self._floor_bands() if flush else (),
            )
        wait = None
        if durable and writes:
            wait = (self.options.wait_replicas, self.options.wait_timeout_ms)
        trip = self.queue.send(writes, pull, beat, wait)
        if beat is not None:
            self._last_heartbeat = time.monotonic()
        if trip is not None:
            # an engine error travels instead of a terminal block (an end held back in
            # durable mode until its tokens are acknowledged is none)
            errors = [
                h.outbox.end
                if w.end is None
                and h.outbox.end
                and h.outbox.end.event.reason is FinishReason.ERROR
                else None
                for h, w in zip(held, writes, strict=True)
            ]
            self.in_flight = _Sent(trip, held, errors, [w.durable for w in writes])

    @property
    def _flush(self) -> bool:
        """Whether this tick sends every job's held tokens: every tick at interval 1 and
        while draining (nothing held back), else every `stream_interval`'th tick, the
        same one for all jobs, so the ticks between send no write but first tokens and
        ends (and no pull when the worker is full)."""
        if self.draining:
            return True
        if self.options.stream_interval_s is not None:
            return self._flush_tick == self._ticks
        return self._ticks % self.options.stream_interval == 0

    def _time_flush(self, now: float) -> None:
        """By time: the tick that just ended flushes once stream_interval_s passed since
        the last one that did (or MAX_STREAM_INTERVAL ticks). Decided at the tick's end:
        a held token goes out with the first tick that ends stream_interval_s or more
        after the last send, so at steady ticks it waits less than stream_interval_s
        (less than that plus one tick when a tick runs long)."""
        assert self.options.stream_interval_s is not None
        due = now - self._last_flush >= self.options.stream_interval_s
        if due or self._ticks - self._flush_tick >= MAX_STREAM_INTERVAL:
            self._flush_tick, self._last_flush = self._ticks, now

    def _floor_bands(self) -> tuple[str, ...]:
        """The lower bands this worker holds no job of, about once a second (pull.lua
        then takes one of each that has jobs waiting, room or not): a band's share of
        this worker's tokens (worker/bands.py) needs a job of it here to act on."""
        now = time.monotonic()
        if now - self._last_floor < self.options.claim_every_s:
            return ()
        self._last_floor = now
        holding = {h.delivery.band.name for h in self.held.values()}
        holding |= {d.band.name for d in self.prefetched}
        return tuple(band for band in BANDS[1:] if band not in holding)

    def _receive(self) -> None:
        """Apply the replies of the round trip in flight, if any."""
        sent, self.in_flight = self.in_flight, None
        if sent is None:
            return
        replies = sent.trip.replies()
        if replies.tick is not None:
            self._apply(sent, replies.tick, replies.replicated)
            if replies.replicated is not None and not all(replies.replicated):
                self._short_of_replicas(replies.replicated.count(False))
        self.prefetched += replies.pulled
        if replies.failures:
            raise replies.failures[0]

    def _apply(self, sent: _Sent, verdicts: list[TickReply], replicated: list[bool] | None) -> None:
        for n, (job, error, reply) in enumerate(zip(sent.held, sent.errors, verdicts, strict=True)):
            job.outbox.confirm(reply.next_index)
            if self.options.durable and reply.verdict is not TickVerdict.LOST:
                job.outbox.acknowledged(
                    sent.durable[n], reply.next_index, replicated is not None and replicated[n]
                )
            if reply.verdict is TickVerdict.LOST:
                self.engine.drop(job.job_id)
                del self.held[job.job_id]
                log.warning(
                    "job %s belongs to another worker now (or has finished): dropped it",
                    job.job_id,
                )
            elif reply.verdict is TickVerdict.DONE:
                del self.held[job.job_id]
                if self.metrics is not None and job.outbox.end is not None:
                    self.metrics.observe_finished(job.outbox.end, job.delivery.tenant)
            elif error is not None and reply.verdict is not TickVerdict.GAP:
                self.intake.retry_or_dead_letter(job, error)  # an engine error: events out
            elif reply.verdict is TickVerdict.CANCEL and job.outbox.end is None:
                self.engine.cancel(job.job_id)

    def _short_of_replicas(self, writes: int) -> None:
        """Durable mode: a round trip's WAIT counted fewer replicas than asked; what it
        wrote is held back from clients until a later WAIT covers it. Said at most every
        10 s (a primary without replicas would say it every tick)."""
        now = time.monotonic()
        if now - self._replicas_warned >= 10.0:
            self._replicas_warned = now
            log.warning(
                "durable mode: fewer than %d replica(s) acknowledged %d job(s)' writes; "
                "their tokens wait for a replica before clients see them",
                self.options.wait_replicas,
                writes,
            )

    # ---- heartbeat ---------------------------------------------------------------

    def _heartbeat_due(self) -> bool:
        return time.monotonic() - self._last_heartbeat >= self.options.heartbeat_s

    def heartbeat(self, *, force: bool = False) -> None:
        """Write the heartbeat now, on its own (at start; under maxmemory between tries)."""
        if force or self._heartbeat_due():
            self._last_heartbeat = time.monotonic()
            self.queue.heartbeat(self._heartbeat_fields())

    def _heartbeat_fields(self) -> dict[str, Any]:
        budget = self.engine.budget
        return {
            **self.options.info,
            "stream": self.keys.jobs(self.options.model),  # the default band's
            "streams": self.queue.streams,
            "group": GROUP,
            "status": "draining" if self.draining else "running",
            "wait_replicas": self.options.wait_replicas,  # durable mode (0: off)
            "redis_oom": self.redis_oom,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "budget": budget.advertised(),
            "held_jobs": len(self.held) + len(self.prefetched),
            # what it holds, by tenant and by the band each was read from
            "tenants": dict(Counter(h.delivery.tenant for h in self.held.values())),
            "bands": dict(Counter(h.delivery.band.name for h in self.held.values())),
            **self.engine.telemetry(),
        }


__all__ = ["EXIT_REDIS_ACCESS", "Worker", "WorkerOptions", "default_worker_name"]
