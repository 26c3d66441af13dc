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

Nothing is dropped when Redis goes away: tokens live in the engine's sessions
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
import os
import signal
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry

from tokenfleet.errors import ProtocolError
from tokenfleet.keys import BANDS, GROUP, Keys
from tokenfleet.protocol import (
    ErrorInfo,
    GenerationRequest,
    TokenEvent,
    decode_request,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine
from tokenfleet.worker.errors import RedisAccessError, classify_redis_error
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.queue import (
    Accepted,
    InFlight,
    TickReply,
    TickVerdict,
    TickWrite,
    Verdict,
    WorkerQueue,
)
from tokenfleet.worker.recovery import Delivery
from tokenfleet.worker.session import Finished, Session, terminal

log = logging.getLogger("tokenfleet.worker")
T = TypeVar("T")
EXIT_REDIS_ACCESS = 3  # exit code: Redis refused our credentials or a command


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerOptions:
    name: str = field(default_factory=default_worker_name)
    model: str | None = None  # which jobs stream (None: the default one)
    burst: bool = False  # exit once the stream is empty and nothing is active
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
    info: dict[str, Any] = field(default_factory=dict)  # identity fields for the heartbeat


@dataclass
class _Held:
    """A job this worker has read and answers for until its terminal write succeeded."""

    delivery: Delivery
    job_id: str
    session: Session | None  # owns the emitted tokens; None when rejected before one existed
    sent: int = 0  # token indices its replay stream holds, as the last publish reported
    end: Finished | None = None  # its terminal outcome, once the engine decided it

    def unsent(self) -> list[TokenEvent]:
        return [] if self.session is None else self.session.events[self.sent :]

    @property
    def dirty(self) -> bool:
        """Something this worker decided for the job is not in Redis yet."""
        pending_tokens = self.session is not None and len(self.session.events) > self.sent
        return pending_tokens or self.end is not None


@dataclass
class _RoundTrip:
    """One tick's pipeline, sent: the held jobs it wrote for (in order), the engine error
    each carried instead of a terminal block (None for most), and whether it reads."""

    call: InFlight
    held: list[_Held]
    errors: list[Finished | None]
    reads: bool


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
        self.redis = client
        # The loop retries, then resyncs (see the module docstring); the client must not.
        client.set_retry(Retry(NoBackoff(), 0))
        self.keys = keys
        self.options = options
        self.queue = WorkerQueue(client, keys, options.name, options.model)
        self.held: dict[str, _Held] = {}  # job id -> what this worker answers for
        self.prefetched: list[Delivery] = []  # read with the last publish, not yet admitted
        self.in_flight: _RoundTrip | None = None  # sent, replies not read yet
        self.draining = False
        self.stop_now = False
        self.redis_oom = False  # Redis refused a write for lack of memory; backing off
        self._drain_deadline = 0.0
        self._last_heartbeat = 0.0
        self._last_claim = 0.0
        self._last_floor = 0.0
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
            return all(int(self.redis.xlen(stream)) == 0 for stream in self.queue.streams)
        return False

    def _with_reconnect(self, action: Callable[[], T], *, once: bool = False) -> T | None:
        """Run `action` and return its value; while Redis is unreachable or out of memory,
        back off and retry until it answers (None if told to stop, or the drain deadline
        passed, meanwhile; `once`: a single try).

        Any lost connection may have lost a reply (a read, a claim) or, on a Redis
        without persistence, writes: the next iteration resyncs first. Credentials or
        ACL permissions refused raise `RedisAccessError`: retrying cannot fix them."""
        delay = 0.05
        trouble_at: float | None = None
        while True:
            try:
                value = action()
                if trouble_at is not None:
                    back = "reconnected to redis"
                    if self.redis_oom:
                        back = "redis accepts writes again"
                    log.warning("%s after %.1fs", back, time.monotonic() - trouble_at)
                self.redis_oom = False
                return value
            except redis.RedisError as exc:
                kind = classify_redis_error(exc)  # raises RedisAccessError for auth / ACL
                if kind is None:
                    raise
                self._resync = True
                if trouble_at is None:
                    trouble_at = time.monotonic()
                if kind == "oom":
                    self.redis_oom = True
                    log.warning(
                        "redis is out of memory (%s); holding %d job(s), retrying in %.2fs",
                        exc,
                        len(self.held),
                        delay,
                    )
                else:
                    log.warning("redis unavailable (%s); retrying in %.2fs", exc, delay)
            if once or self.stop_now or self._drain_expired():
                return None
            time.sleep(delay)
            delay = min(delay * 2, self.options.reconnect_max_s)
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
            self.redis.ping()
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
            self._receive_quietly()
            self._resync_after_reconnect()
        if self.in_flight is None and any(h.dirty for h in self.held.values()):
            self.publish()  # catch up (after a failure) before computing anything new
            return
        self.tick()
        self._receive()
        self._give_back_overdue()  # nothing is in flight here
        self.pull()
        self._send()
        if not self.options.overlap:
            self._receive()

    def _receive_quietly(self) -> None:
        """A round trip cut by a lost connection: its replies are gone; what it carried
        is still in the sessions and goes out again."""
        sent, self.in_flight = self.in_flight, None
        if sent is not None:
            sent.call.abandon()

    def _resync_after_reconnect(self) -> None:
        """Recover what a lost connection may have hidden: entries read but never seen,
        and token events written but not persisted (tick.lua appends only missing ones)."""
        known = {h.delivery.entry_id for h in self.held.values()}
        known |= {d.entry_id for d in self.prefetched}
        self._admit([d for d in self.queue.own_pending(1000) if d.entry_id not in known])
        for held in self.held.values():
            held.sent = 0
        self._resync = False

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
        self._admit(deliveries)

    def _admit(self, deliveries: list[Delivery]) -> None:
        """Decode, check and hand entries to the engine; anything unservable goes to the
        dead letters without touching the job it names."""
        decoded: list[tuple[Delivery, GenerationRequest]] = []
        for delivery in deliveries:
            request = self._decode(delivery)
            if request is not None:
                decoded.append((delivery, request))
        if not decoded:
            return
        verdicts = self.queue.accept([d for d, _ in decoded])
        deferred = 0
        for (delivery, request), accepted in zip(decoded, verdicts, strict=True):
            verdict = accepted.verdict
            if verdict is Verdict.OK:
                if request.job_id in self.held:
                    continue  # held here already (its entry read again after a reconnect)
                if delivery.deliveries <= self.options.max_deliveries:
                    self._submit(delivery, request, accepted)
                    continue
                message = (
                    f"delivered {delivery.deliveries} times (limit {self.options.max_deliveries})"
                )
                self._dead_letter(
                    delivery, "too_many_deliveries", message, job_id=request.job_id, error=True
                )
            elif verdict is Verdict.DEFERRED:
                deferred += 1  # its tenant runs max_running jobs: back in its band's queue
            elif verdict is Verdict.LOST:
                log.warning("entry %s belongs to another worker now: skipped", delivery.entry_id)
            elif verdict is Verdict.UNSUBMITTED:
                message = f"job {request.job_id} was never submitted (or its state expired)"
                self._dead_letter(delivery, "rejected_unsubmitted", message)
            else:
                message = f"job {request.job_id} was submitted as another entry"
                if verdict is Verdict.FINISHED:
                    message = f"job {request.job_id} has finished already"
                self._dead_letter(delivery, "rejected_duplicate", message)
        self._all_deferred = deferred == len(decoded)

    def _decode(self, delivery: Delivery) -> GenerationRequest | None:
        if delivery.payload is None:
            message = "the entry has no payload (deleted?)"
            self._dead_letter(delivery, "missing_payload", message, job_id=delivery.job_id)
            return None
        try:
            request = decode_request(delivery.payload)
        except ProtocolError as exc:
            self._dead_letter(
                delivery, exc.reason, exc.message, job_id=exc.job_id or delivery.job_id
            )
            return None
        if delivery.job_id != request.job_id:
            message = (
                f"entry job_id {delivery.job_id!r} differs from the payload's {request.job_id!r}"
            )
            self._dead_letter(delivery, "job_id_mismatch", message, job_id=delivery.job_id)
            return None
        return request

    def _submit(self, delivery: Delivery, request: GenerationRequest, accepted: Accepted) -> None:
        job_id = request.job_id
        # A claimed job, or one another worker gave back, resumes after its published
        # tokens: the job hash's count of them (accept.lua) says whether there are any.
        resume = self.queue.emitted_tokens(job_id) if accepted.emitted > 0 else []
        submitted_at = accepted.submitted_at
        if submitted_at is None:  # a state hash without it: the entry id's time
            submitted_at = int(delivery.entry_id.split("-")[0]) / 1000.0
        band = self._band(delivery)  # the band it waited in decides here too
        if band != request.priority:
            request = request.model_copy(update={"priority": band})
        self.engine.submit(
            request,
            resume_ids=resume,
            submitted_at=submitted_at,
            overflow=True,
            cache_group=accepted.cache_group,
        )
        session = self.engine.session(job_id)
        self.held[job_id] = _Held(delivery, job_id, session, sent=len(resume))
        if accepted.cancelled:
            self.engine.cancel(job_id)

    def _band(self, delivery: Delivery) -> str:
        streams = self.queue.streams
        return BANDS[streams.index(delivery.stream)] if delivery.stream in streams else "default"

    def tick(self) -> None:
        if not self.engine.has_work:
            return
        out = self.engine.step()
        if self.metrics is not None:
            self.metrics.observe_tick(self.engine, out)
        for done in out.finished:
            held = self.held.get(done.job_id)
            if held is not None:
                held.end = done

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
        """Send, without waiting: every held job's fenced writes (tick.lua), the heartbeat
        when due, and a read of the entries the engine has room for next. The replies
        are read by `_receive`, after the next tick computed: Redis works meanwhile."""
        assert self.in_flight is None, "a round trip is already in flight"
        held = list(self.held.values())
        read = extra = 0
        floor: list[str] = []
        if not self.draining and (self.engine.has_work or held):
            read = self.engine.room() - len(self.prefetched)
            # interactive jobs that would preempt lower bands running here
            top = self.queue.streams[0]
            extra = self.engine.interactive_room()
            extra -= sum(1 for d in self.prefetched if d.stream == top)
            floor = self._floor_bands()
        reads = read > 0 or extra > 0 or bool(floor)
        if not held and not reads and not self._heartbeat_due():
            return
        pipe = self.redis.pipeline(transaction=False)
        writes = [self._write_of(h) for h in held]
        if writes:
            self.queue.tick(writes, pipe)
        if reads:
            self.queue.pull(max(0, read), pipe, max(0, extra), floor)
        if self._heartbeat_due():
            self.heartbeat(pipe=pipe)
        errors = [
            h.end if h.end is not None and w.end is None else None
            for h, w in zip(held, writes, strict=True)
        ]
        self.in_flight = _RoundTrip(InFlight(self.redis, pipe), held, errors, reads)

    def _floor_bands(self) -> list[str]:
        """The lower bands this worker holds no job of, about once a second (pull.lua
        then takes one of each that has jobs waiting, room or not): a band's share of
        this worker's tokens (worker/bands.py) needs a job of it here to act on."""
        now = time.monotonic()
        if now - self._last_floor < self.options.claim_every_s:
            return []
        self._last_floor = now
        holding = {self._band(h.delivery) for h in self.held.values()}
        holding |= {self._band(d) for d in self.prefetched}
        return [band for band in BANDS[1:] if band not in holding]

    def _receive(self) -> None:
        """Apply the replies of the round trip in flight, if any."""
        sent, self.in_flight = self.in_flight, None
        if sent is None:
            return
        replies = sent.call.replies()
        failures: list[Exception] = []
        at = 0
        if sent.held:
            at = 1
            if isinstance(replies[0], NoScriptError):
                self.queue.load_scripts()  # Redis restarted: the writes go out next iteration
            elif isinstance(replies[0], Exception):
                failures.append(replies[0])  # the writes stay in the sessions: retried
            else:
                self._apply(sent, self.queue.parse_tick(replies[0]))
        if sent.reads:
            got = replies[at]
            at += 1
            if isinstance(got, NoScriptError):
                self.queue.load_scripts()  # nothing was read: the next round trip reads
            elif isinstance(got, Exception):
                failures.append(got)
            else:
                self.prefetched += self.queue.parse_pull(got)
        failures += [r for r in replies[at:] if isinstance(r, Exception)]
        for failure in failures:
            if not self._missing_group(failure):
                raise failure

    def _missing_group(self, exc: Exception) -> bool:
        if isinstance(exc, redis.ResponseError) and str(exc).startswith("NOGROUP"):
            self.queue.ensure_group()
            return True
        return False

    def _write_of(self, held: _Held) -> TickWrite:
        end = None
        if held.end is not None and held.end.event.reason is not FinishReason.ERROR:
            end = (held.end.result, held.end.event)
        return TickWrite(held.delivery, held.job_id, held.unsent(), end)

    def _apply(self, sent: _RoundTrip, replies: list[TickReply]) -> None:
        for job, error, reply in zip(sent.held, sent.errors, replies, strict=True):
            job.sent = reply.next_index
            if reply.verdict is TickVerdict.LOST:
                self.engine.drop(job.job_id)
                del self.held[job.job_id]
                log.warning(
                    "job %s belongs to another worker now (or has finished): dropped it",
                    job.job_id,
                )
            elif reply.verdict is TickVerdict.DONE:
                del self.held[job.job_id]
                if self.metrics is not None and job.end is not None:
                    self.metrics.observe_finished(job.end, job.delivery.tenant)
            elif error is not None and reply.verdict is not TickVerdict.GAP:
                self._retry_or_dead_letter(job, error)  # an engine error: its events are out
            elif reply.verdict is TickVerdict.CANCEL and job.end is None:
                self.engine.cancel(job.job_id)

    def _retry_or_dead_letter(self, held: _Held, done: Finished) -> None:
        error = done.event.error
        message = error.message if error else "engine error"
        del self.held[held.job_id]
        if held.delivery.deliveries >= self.options.max_deliveries:
            self.queue.dead_letter(
                held.delivery, "engine_error", message, finish=done.event, result=done.result
            )
            if self.metrics is not None:
                self.metrics.observe_finished(done, held.delivery.tenant)
            return
        deliveries = self.queue.redeliver(held.delivery)
        if deliveries is None:  # no longer ours
            return
        retry = replace(held.delivery, deliveries=deliveries)
        log.warning(
            "job %s failed (%s); retry %d of %d",
            held.job_id,
            message,
            deliveries,
            self.options.max_deliveries,
        )
        self._admit([retry])

    def _dead_letter(
        self,
        delivery: Delivery,
        reason: str,
        message: str,
        *,
        job_id: str | None = None,
        error: bool = False,
    ) -> None:
        """Dead-letter an entry; when its job id is known (and the entry is the job's
        own, which dead_letter.lua checks), its client gets a terminal event."""
        end = None
        if job_id is not None:
            finish_reason = FinishReason.ERROR if error else FinishReason.REJECTED
            info = ErrorInfo(reason=reason[:64], message=message[:4096])
            end = terminal(job_id, finish_reason, self.options.name, error=info)
        log.warning("dead-lettering entry %s (%s): %s", delivery.entry_id, reason, message)
        self.queue.dead_letter(
            delivery,
            reason,
            message,
            finish=None if end is None else end.event,
            result=None if end is None else end.result,
        )

    # ---- heartbeat ---------------------------------------------------------------

    def _heartbeat_due(self) -> bool:
        return time.monotonic() - self._last_heartbeat >= self.options.heartbeat_s

    def heartbeat(self, *, pipe: Any = None, force: bool = False) -> None:
        if not force and not self._heartbeat_due():
            return
        self._last_heartbeat = time.monotonic()
        info: dict[str, Any] = {
            **self.options.info,
            "stream": self.queue.stream,
            "streams": self.queue.streams,
            "group": GROUP,
            "status": "draining" if self.draining else "running",
            "redis_oom": self.redis_oom,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "budget": {
                "kv_budget_bytes": self.engine.budget.kv_budget_bytes,
                "max_active": self.engine.budget.max_active,
                "max_batch_size": self.engine.budget.max_batch_size,
                "max_prefill_tokens_per_tick": self.engine.budget.max_prefill_tokens_per_tick,
                "max_waiting": self.engine.budget.max_waiting,
            },
            "held_jobs": len(self.held) + len(self.prefetched),
            # what it holds, by tenant and by the band each was read from
            "tenants": dict(Counter(h.delivery.tenant for h in self.held.values())),
            "bands": dict(Counter(self._band(h.delivery) for h in self.held.values())),
            **self.engine.telemetry(),
        }
        self.queue.heartbeat(info, pipe=pipe)


__all__ = ["EXIT_REDIS_ACCESS", "Worker", "WorkerOptions", "default_worker_name"]
