"""The worker's Redis loop: pull → admit → tick → publish → finish.

One process, one engine, one jobs stream. Each iteration:

1. pull     read only as many entries as the engine has room for (claiming the
            entries of dead workers first), decode them, admit them; block
            briefly only when nothing is running.
2. tick     apply cancellations, run one engine step (one forward pass).
3. publish  every token event of the tick, plus the heartbeat when due, in ONE
            pipelined round trip.
4. finish   each ended job: result + finish event + ack/delete in one script
            that first checks this worker still owns the entry.

Nothing is dropped when Redis goes away: what a tick produced stays in the
outbox, the engine is not stepped again until the outbox is flushed, a job stays
held until its terminal write succeeded, and the loop reconnects with backoff.
redis-py's own command retries are switched off on the worker's client: a
retried XREADGROUP whose first reply was lost would leave entries pending to
this worker that it never saw. Instead every lost connection makes the loop
re-read its own pending list (and re-send the events of running jobs) once it
is back.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenfleet.errors import ProtocolError
from tokenfleet.keys import GROUP, Keys
from tokenfleet.protocol import ErrorInfo, FinishEvent, JobResult, TokenEvent, decode_request
from tokenfleet.reasons import AdmissionReason, FinishReason
from tokenfleet.worker.engine import Engine, Finished
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.publish import queue_event
from tokenfleet.worker.queue import WorkerQueue
from tokenfleet.worker.recovery import Delivery

log = logging.getLogger("tokenfleet.worker")
T = TypeVar("T")


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
    reconnect_max_s: float = 5.0
    info: dict[str, Any] = field(default_factory=dict)  # identity fields for the heartbeat


@dataclass
class _Held:
    """A job this worker has read and is responsible for until it acks it."""

    delivery: Delivery
    job_id: str


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
        self.held: dict[str, _Held] = {}  # job id -> its entry, for every job in the engine
        self.deferred: list[tuple[_Held, Any]] = []  # read but not yet admitted (node full)
        self.outbox_tokens: list[TokenEvent] = []
        self.outbox_finished: list[Finished] = []
        self.draining = False
        self.stop_now = False
        self._drain_deadline = 0.0
        self._last_heartbeat = 0.0
        self._last_claim = 0.0
        self._resync = False  # after a reconnect: re-read own pending list, re-send events
        self._cancel_seen: set[str] | None = None  # cancel flags read with the last publish
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
        self._with_reconnect(self._start)
        while not self.stop_now:
            self._with_reconnect(self.iteration)
            if self._with_reconnect(self._should_exit):  # burst mode asks Redis too
                break
        self._with_reconnect(self._leave)
        return 0

    def _start(self) -> None:
        self.queue.ensure_group()
        self.heartbeat(force=True)

    def _leave(self) -> None:
        """Hand back what was not finished: drop the heartbeat so others claim it now."""
        if self.held or self.deferred:
            log.info("handing back %d unfinished job(s)", len(self.held) + len(self.deferred))
        self.queue.leave()

    def _should_exit(self) -> bool:
        busy = self.engine.has_work or self.outbox_tokens or self.outbox_finished
        if self.draining:
            # Deferred entries were read but never started: they go back to the fleet
            # with the rest (`_leave`) rather than hold the drain until its deadline.
            return not busy or time.monotonic() >= self._drain_deadline
        if self.options.burst and not (busy or self.deferred):
            return int(self.redis.xlen(self.queue.stream)) == 0
        return False

    def _with_reconnect(self, action: Callable[[], T]) -> T | None:
        """Run `action` and return its value; on a lost connection, back off and retry
        until Redis answers (None if told to stop meanwhile).

        Any lost connection may have lost a reply (a read, a claim) or, on a Redis
        without persistence, writes: the next iteration resyncs first."""
        delay = 0.05
        lost_at: float | None = None
        while not self.stop_now:
            try:
                value = action()
                if lost_at is not None:
                    log.warning("reconnected to redis after %.1fs", time.monotonic() - lost_at)
                return value
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._resync = True
                if lost_at is None:
                    lost_at = time.monotonic()
                log.warning("redis unavailable (%s); retrying in %.2fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.options.reconnect_max_s)
                try:
                    self.redis.ping()
                    self.queue.ensure_group()
                except (redis.ConnectionError, redis.TimeoutError):
                    continue
        return None

    # ---- one iteration -----------------------------------------------------------

    def iteration(self) -> None:
        if self._resync:
            self._resync_after_reconnect()
        if self._flush():  # what an earlier tick produced goes out before anything new
            self.pull()
            out_tokens, out_finished = self.tick()
            self.outbox_tokens.extend(out_tokens)
            self.outbox_finished.extend(out_finished)
            self._flush()

    def _resync_after_reconnect(self) -> None:
        """Recover what a lost connection may have hidden: entries read but never seen,
        and token events written but not persisted (clients drop repeated indices)."""
        held_entries = {h.delivery.entry_id for h in self.held.values()}
        held_entries |= {h.delivery.entry_id for h, _ in self.deferred}
        for delivery in self.queue.own_pending(1000):
            if delivery.entry_id not in held_entries:
                self._accept(delivery)
        for job_id in self.held:
            self.outbox_tokens.extend(self.engine.replay_events(job_id))
        self._resync = False

    def pull(self) -> None:
        if self.draining:
            return
        self._admit_deferred()
        room = self.engine.room() - len(self.deferred)
        if room <= 0:
            return
        now = time.monotonic()
        deliveries: list[Delivery] = []
        if now - self._last_claim >= self.options.claim_every_s:
            self._last_claim = now
            deliveries += self.queue.claim_orphans(room)
            if deliveries:
                log.info("claimed %d orphaned job(s) of dead workers", len(deliveries))
        idle = not self.engine.has_work and not deliveries
        block = self.options.idle_block_ms if idle else None
        fresh = self.queue.read(room - len(deliveries), block)
        if block is not None and 0 < len(fresh) < room - len(deliveries):
            # A blocked read wakes on the first new entry; take the rest of a burst
            # now rather than start a tick with one job while the others wait.
            fresh += self.queue.read(room - len(deliveries) - len(fresh), None)
        deliveries += fresh
        started: list[str] = []
        for delivery in deliveries:
            job_id = self._accept(delivery)
            if job_id is not None:
                started.append(job_id)
        if started:
            self.queue.mark_running(started)

    def _accept(self, delivery: Delivery) -> str | None:
        """Decode and admit one entry; anything unservable goes to the dead letters."""
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
        if delivery.deliveries > self.options.max_deliveries:
            message = f"delivered {delivery.deliveries} times (limit {self.options.max_deliveries})"
            self._dead_letter(
                delivery, "too_many_deliveries", message, job_id=request.job_id, error=True
            )
            return None
        held = _Held(delivery, request.job_id)
        current = self.held.get(request.job_id)
        if current is not None and current.delivery.entry_id == delivery.entry_id:
            return None  # the same entry again (a read replayed after a Redis restart)
        if current is not None:  # a second entry for a job running here
            message = f"job {request.job_id} is already running on this worker"
            self._dead_letter(delivery, "rejected_duplicate", message)  # no terminal event
            return None
        self._submit(held, request)
        return request.job_id

    def _submit(self, held: _Held, request: Any) -> None:
        resume = self.queue.emitted_tokens(held.job_id) if held.delivery.deliveries > 1 else None
        submitted_at = int(held.delivery.entry_id.split("-")[0]) / 1000.0
        decision = self.engine.submit(
            request, resume_ids=resume, submitted_at=submitted_at, hold_if_full=True
        )
        if decision.reason is AdmissionReason.REJECTED_QUEUE_FULL:
            self.deferred.append((held, request))
            return
        self.held[held.job_id] = held
        if self.queue.cancelled([held.job_id]):
            self.engine.cancel(held.job_id)

    def _admit_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for held, request in deferred:
            if held.job_id in self.held or any(h.job_id == held.job_id for h, _ in self.deferred):
                continue
            self._submit(held, request)

    def tick(self) -> tuple[list[TokenEvent], list[Finished]]:
        if self._cancel_seen is not None:  # read with the last publish
            cancelled, self._cancel_seen = self._cancel_seen, None
        else:
            cancelled = self.queue.cancelled(list(self.held)) if self.held else set()
        for job_id in cancelled:
            self.engine.cancel(job_id)
        if not self.engine.has_work:
            return [], []
        out = self.engine.step()
        if self.metrics is not None:
            self.metrics.observe_tick(self.engine, out)
        return out.tokens, out.finished

    def _flush(self) -> bool:
        """Publish the outbox: token events + heartbeat in one round trip, then finishes.

        Returns True when the outbox is empty afterwards."""
        if self.outbox_tokens or self._heartbeat_due():
            pipe = self.redis.pipeline(transaction=False)
            for event in self.outbox_tokens:
                queue_event(pipe, self.keys, event)
            if self._heartbeat_due():
                self.heartbeat(pipe=pipe)
            # The next tick's cancel check rides along: one round trip fewer per tick.
            watched = list(self.held)
            if watched:
                pipe.mget([self.keys.cancel(job_id) for job_id in watched])
            replies = pipe.execute()
            if watched:
                flags = replies[-1]
                self._cancel_seen = {j for j, f in zip(watched, flags, strict=True) if f}
            self.outbox_tokens = []
        while self.outbox_finished:
            self._finish(self.outbox_finished[0])
            self.outbox_finished.pop(0)
        return True

    def _finish(self, done: Finished) -> None:
        """The job's terminal write. The job stays held until it succeeded: a lost
        connection retries it (`_flush` keeps `done` in the outbox), and a write that
        went through before the connection broke reads back as "not ours" (0)."""
        held = self.held.get(done.job_id)
        if held is None:
            return
        if done.event.reason is FinishReason.ERROR:
            self._retry_or_dead_letter(held, done)
            return
        if self.queue.finish(held.delivery.entry_id, done.job_id, done.result, done.event):
            if self.metrics is not None:
                self.metrics.observe_finished(done)
        else:
            log.warning(
                "job %s was taken over by another worker (or finished before a lost reply);"
                " not finishing it here",
                done.job_id,
            )
        del self.held[done.job_id]

    def _retry_or_dead_letter(self, held: _Held, done: Finished) -> None:
        error = done.event.error
        message = error.message if error else "engine error"
        if held.delivery.deliveries >= self.options.max_deliveries:
            self.queue.dead_letter(
                held.delivery, "engine_error", message, finish=done.event, result=done.result
            )
            if self.metrics is not None:
                self.metrics.observe_finished(done)
            del self.held[held.job_id]
            return
        deliveries = self.queue.redeliver(held.delivery.entry_id)
        del self.held[held.job_id]
        if deliveries is None:  # no longer ours
            return
        retry = Delivery(held.delivery.entry_id, held.job_id, held.delivery.payload, deliveries)
        log.warning(
            "job %s failed (%s); retry %d of %d",
            held.job_id,
            message,
            deliveries,
            self.options.max_deliveries,
        )
        self._accept(retry)

    def _dead_letter(
        self,
        delivery: Delivery,
        reason: str,
        message: str,
        *,
        job_id: str | None = None,
        error: bool = False,
    ) -> None:
        """Dead-letter an entry; when its job id is known, its client gets a terminal event."""
        finish = result = None
        if job_id is not None:
            finish_reason = FinishReason.ERROR if error else FinishReason.REJECTED
            info = ErrorInfo(reason=reason[:64], message=message[:4096])
            finish = FinishEvent(
                job_id=job_id, reason=finish_reason, error=info, worker=self.options.name
            )
            result = JobResult(
                job_id=job_id, finish_reason=finish_reason, error=info, worker=self.options.name
            )
        log.warning("dead-lettering entry %s (%s): %s", delivery.entry_id, reason, message)
        self.queue.dead_letter(delivery, reason, message, finish=finish, result=result)

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
            "group": GROUP,
            "status": "draining" if self.draining else "running",
            "started_at": self.started_at,
            "pid": os.getpid(),
            "budget": {
                "kv_budget_bytes": self.engine.budget.kv_budget_bytes,
                "max_active": self.engine.budget.max_active,
                "max_batch_size": self.engine.budget.max_batch_size,
                "max_prefill_tokens_per_tick": self.engine.budget.max_prefill_tokens_per_tick,
                "max_waiting": self.engine.budget.max_waiting,
            },
            "held_jobs": len(self.held) + len(self.deferred),
            **self.engine.telemetry(),
        }
        self.queue.heartbeat(info, pipe=pipe)
