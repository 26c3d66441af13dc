"""Entries in: what the worker does with each jobs-stream entry it read or claimed.

An entry becomes a job this worker answers for (`Held`, its session in the engine) only
when it decodes, names the job its payload is for, and accept.lua says it is the job's
own entry and this worker's to serve. Anything else goes to the dead letters, with a
terminal event for the job's client when the job is known and the entry is its own
(dead_letter.lua checks): a bad entry never touches another job and never stops the
worker. A job whose engine run failed is retried in process up to `max_deliveries`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from tokenfleet.errors import ProtocolError
from tokenfleet.protocol import ErrorInfo, GenerationRequest, decode_request
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.queue import Accepted, TickWrite, Verdict, WorkerQueue
from tokenfleet.worker.recovery import Delivery
from tokenfleet.worker.session import Finished, Outbox, terminal

log = logging.getLogger("tokenfleet.worker")


@dataclass
class Held:
    """A job this worker has read and answers for until its terminal write succeeded:
    the entry it came as and what is to be published for it (the engine's outbox)."""

    delivery: Delivery
    job_id: str
    outbox: Outbox

    @property
    def dirty(self) -> bool:
        return self.outbox.dirty

    def write(self, durable: bool = False) -> TickWrite:
        """Its part of the next tick: the events Redis lacks and, once the engine decided
        its outcome (an engine error excepted: that one is retried), the terminal pair.
        In durable mode also what a replica holds (`durable`) and the acknowledged events
        to announce, and the end only once every event is acknowledged."""
        box = self.outbox
        end = box.end
        if end is not None and end.event.reason is FinishReason.ERROR:
            end = None
        if durable and not box.settled():
            end = None
        pair = None if end is None else (end.result, end.event)
        if not durable:
            return TickWrite(self.delivery, self.job_id, box.unsent(), pair)
        return TickWrite(
            self.delivery, self.job_id, box.unsent(), pair, box.safe, box.to_announce()
        )


class Intake:
    """Turns deliveries into held jobs (`admit`) or dead letters, and retries engine
    failures (`retry_or_dead_letter`)."""

    def __init__(
        self,
        engine: Engine,
        queue: WorkerQueue,
        held: dict[str, Held],
        *,
        max_deliveries: int,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.held = held  # the worker's: job id -> Held
        self.max_deliveries = max_deliveries
        self.metrics = metrics

    def admit(self, deliveries: list[Delivery]) -> bool:
        """Decode, check and hand entries to the engine. True when there were entries and
        every one was put back (their tenants run max_running jobs)."""
        decoded: list[tuple[Delivery, GenerationRequest]] = []
        for delivery in deliveries:
            request = self._decode(delivery)
            if request is not None:
                decoded.append((delivery, request))
        if not decoded:
            return False
        deferred = 0
        for (delivery, request), accepted in zip(
            decoded, self.queue.accept([d for d, _ in decoded]), strict=True
        ):
            if accepted.verdict is Verdict.DEFERRED:
                deferred += 1  # back at its band's tail (accept.lua)
            else:
                self._verdict(delivery, request, accepted)
        return deferred == len(decoded)

    def _verdict(self, delivery: Delivery, request: GenerationRequest, accepted: Accepted) -> None:
        verdict, job_id = accepted.verdict, request.job_id
        if verdict is Verdict.OK:
            if job_id in self.held:
                return  # held here already (its entry read again after a reconnect)
            if delivery.deliveries <= self.max_deliveries:
                self._submit(delivery, request, accepted)
                return
            message = f"delivered {delivery.deliveries} times (limit {self.max_deliveries})"
            self.dead_letter(delivery, "too_many_deliveries", message, job_id=job_id, error=True)
        elif verdict is Verdict.LOST:
            log.warning("entry %s belongs to another worker now: skipped", delivery.entry_id)
        elif verdict is Verdict.UNSUBMITTED:
            message = f"job {job_id} was never submitted (or its state expired)"
            self.dead_letter(delivery, "rejected_unsubmitted", message)
        elif verdict is Verdict.FINISHED:
            self.dead_letter(delivery, "rejected_duplicate", f"job {job_id} has finished already")
        else:
            message = f"job {job_id} was submitted as another entry"
            self.dead_letter(delivery, "rejected_duplicate", message)

    def _decode(self, delivery: Delivery) -> GenerationRequest | None:
        if delivery.payload is None:
            message = "the entry has no payload (deleted?)"
            self.dead_letter(delivery, "missing_payload", message, job_id=delivery.job_id)
            return None
        try:
            request = decode_request(delivery.payload)
        except ProtocolError as exc:
            job_id = exc.job_id or delivery.job_id
            self.dead_letter(delivery, exc.reason, exc.message, job_id=job_id)
            return None
        if delivery.job_id != request.job_id:
            message = (
                f"entry job_id {delivery.job_id!r} differs from the payload's {request.job_id!r}"
            )
            self.dead_letter(delivery, "job_id_mismatch", message, job_id=delivery.job_id)
            return None
        return request

    def _submit(self, delivery: Delivery, request: GenerationRequest, accepted: Accepted) -> None:
        job_id = request.job_id
        # A claimed job, or one another worker gave back, resumes after its published
        # tokens: the job hash's count of them (accept.lua) says whether there are any.
        resume = self.queue.emitted_events(job_id) if accepted.emitted > 0 else []
        submitted_at = accepted.submitted_at
        if submitted_at is None:  # a state hash without it: the entry id's time
            submitted_at = int(delivery.entry_id.split("-")[0]) / 1000.0
        self.engine.submit(
            request,
            resume_ids=[event.token_id for event in resume],
            resume_logprobs=[event.logprobs for event in resume],
            submitted_at=submitted_at,
            overflow=True,
            cache_group=accepted.cache_group,
            band=delivery.band,  # the band it waited in is the band it runs in
        )
        outbox = self.engine.outbox(job_id)
        assert outbox is not None, "the engine keeps an outbox per job submitted"
        self.held[job_id] = Held(delivery, job_id, outbox)
        if accepted.cancelled:
            self.engine.cancel(job_id)

    def retry_or_dead_letter(self, held: Held, done: Finished) -> None:
        """An engine error ended the job (its events are out): run it again here, or
        dead-letter it once it was delivered `max_deliveries` times."""
        error = done.event.error
        message = error.message if error else "engine error"
        del self.held[held.job_id]
        if held.delivery.deliveries >= self.max_deliveries:
            self.queue.dead_letter(
                held.delivery, "engine_error", message, finish=done.event, result=done.result
            )
            if self.metrics is not None:
                self.metrics.observe_finished(done, held.delivery.tenant)
            return
        deliveries = self.queue.redeliver(held.delivery)
        if deliveries is None:  # no longer ours
            return
        log.warning(
            "job %s failed (%s); retry %d of %d",
            held.job_id,
            message,
            deliveries,
            self.max_deliveries,
        )
        self.admit([replace(held.delivery, deliveries=deliveries)])

    def dead_letter(
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
            end = terminal(job_id, finish_reason, self.queue.worker, error=info)
        log.warning("dead-lettering entry %s (%s): %s", delivery.entry_id, reason, message)
        self.queue.dead_letter(
            delivery,
            reason,
            message,
            finish=None if end is None else end.event,
            result=None if end is None else end.result,
        )


__all__ = ["Held", "Intake"]
