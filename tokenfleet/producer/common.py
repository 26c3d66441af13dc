"""What the sync and async producers share, without I/O: request building, the submit
script's arguments and replies, the fleet-capacity check, the in-order event assembler,
and the job status and result as read back. Following a job is `producer.follow`; the
calls themselves are plans in `producer.core`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tokenfleet.errors import (
    InvalidRequest,
    JobFailed,
    JobNotFound,
    JobRejected,
    QueueFull,
    TenantQueueFull,
)
from tokenfleet.keys import DEFAULT_MODEL, Keys
from tokenfleet.lua.calls import SubmitCall, timestamp
from tokenfleet.protocol import (
    MAX_PAYLOAD_BYTES,
    FinishEvent,
    GenerationRequest,
    JobResult,
    TokenEvent,
    decode_events,
    encode,
)
from tokenfleet.reasons import FinishReason


def build_request(request: GenerationRequest | None, fields: dict[str, Any]) -> GenerationRequest:
    """The request to send, validated; bad input raises `InvalidRequest` naming the field."""
    if request is not None:
        if fields:
            raise InvalidRequest("pass either a GenerationRequest or keyword fields, not both")
        return request
    try:
        return GenerationRequest(**fields)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        ]
        raise InvalidRequest("invalid request: " + "; ".join(problems)) from None


def encode_request(request: GenerationRequest) -> bytes:
    payload = encode(request)
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidRequest(
            f"request encodes to {len(payload)} bytes, limit MAX_PAYLOAD_BYTES={MAX_PAYLOAD_BYTES}"
        )
    return payload


def submit_call(
    keys: Keys, request: GenerationRequest, payload: bytes, default_cap: int
) -> SubmitCall:
    """The submit.lua call that accepts `request` (its slots: the script's header), all
    in the job's partition."""
    p = keys.partition_of(request.job_id)
    return SubmitCall(
        stream=keys.jobs(request.model, request.priority, p),
        cap=keys.queue_cap(request.model, p),
        hash=keys.job(request.job_id),
        models=keys.models(p),
        queued=keys.tenant_queued(request.tenant, request.model, p),
        limits=keys.tenant_limits(request.tenant, p),
        default_limits=keys.tenant_limits(None, p),
        tenants=keys.tenants(p),
        job_id=request.job_id,
        payload=payload,
        default_cap=default_cap,
        now=timestamp(),
        model=request.model or DEFAULT_MODEL,
        tenant=request.tenant,
        band=request.priority,
    )


@dataclass(frozen=True)
class SubmitReply:
    """submit.lua's reply, parsed. `duplicate` means the id was already accepted."""

    job_id: str
    entry_id: str
    duplicate: bool


def parse_submit_reply(keys: Keys, request: GenerationRequest, reply: list[Any]) -> SubmitReply:
    """Turn the script's reply into a `SubmitReply`, or raise `QueueFull` (the band is
    full) or `TenantQueueFull` (the job's tenant is at its queued limit)."""
    answer = SubmitCall.parse(reply)
    stream = keys.jobs(request.model, request.priority, keys.partition_of(request.job_id))
    if answer.verdict == "full":
        raise QueueFull(depth=answer.held, cap=answer.limit, stream=stream)
    if answer.verdict == "tenant_full":
        raise TenantQueueFull(request.tenant, answer.held, answer.limit, stream)
    return SubmitReply(request.job_id, answer.entry_id, duplicate=answer.verdict == "dup")


CAPACITY_TTL_S = 1.0  # how long a producer trusts what it read of the fleet's capacity


def check_fleet_fits(request: GenerationRequest, capacity: int | None) -> None:
    """Refuse a job no live worker could ever hold (`JobRejected`, rejected_kv_budget).

    The producer has no tokenizer, so a text prompt counts as zero tokens here
    (workers still refuse it if it is too long): only what is certain is judged."""
    if capacity is None:
        return
    known = len(request.prompt_ids or ()) + request.max_new_tokens
    if known > capacity:
        raise JobRejected(
            request.job_id,
            "rejected_kv_budget",
            f"needs at least {known:,} tokens of KV (prompt + max_new_tokens) but the largest "
            f"job any live worker for model {request.model or DEFAULT_MODEL!r} can hold is "
            f"{capacity:,} tokens",
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class EventAssembler:
    """Turns events arriving from replay and pub/sub, duplicated or out of order,
    into each token exactly once, in index order, then the finish event.

    Feed it every decoded event; `ready()` hands back what may be delivered now.
    `complete` is true once the finish event and every token before it were delivered.
    `gap` is true when something was missed (a later index or the finish event
    arrived before an earlier token): the caller should re-read the replay stream.
    """

    next_index: int = 0
    pending: dict[int, TokenEvent] = field(default_factory=dict)
    finish: FinishEvent | None = None
    finish_delivered: bool = False
    last_stream_id: str = "-"  # last replay-stream entry read, for incremental XRANGE
    # A durable fleet's bound (the job hash's `durable`, docs/protocol.md): indices at or
    # past it may still be taken back by a failover, so they wait; None: no bound
    durable: int | None = None

    def feed(self, event: TokenEvent | FinishEvent) -> None:
        if isinstance(event, FinishEvent):
            self.finish = event
        elif event.index >= self.next_index:
            self.pending.setdefault(event.index, event)

    def feed_raw(self, data: bytes, live: bool = False) -> None:
        """One replay entry's or live message's events (one, or several coalesced). What
        comes live was published once durable: it moves the bound past itself."""
        for event in decode_events(data):
            self.feed(event)
            if live and self.durable is not None and isinstance(event, TokenEvent):
                self.durable = max(self.durable, event.index + 1)

    def bound(self, durable: Any) -> None:
        """The job hash's `durable` field as read after the replay stream (None or absent:
        no bound yet, or a fleet without one); the bound only grows."""
        if durable is None:
            return
        value = int(durable)
        self.durable = value if self.durable is None else max(self.durable, value)

    def replay_start(self) -> str:
        """XRANGE's start on the replay stream: everything, or what follows the last
        entry read (exclusive)."""
        return "-" if self.last_stream_id == "-" else f"({self.last_stream_id}"

    def feed_entries(self, entries: list[Any]) -> bool:
        """Feed an XRANGE reply of the replay stream (from `replay_start()`), remembering
        the last entry read; True when it held any entry."""
        for entry_id, fields in entries:
            events = decode_events(fields[b"m"])
            if self.durable is not None and any(
                isinstance(e, TokenEvent) and e.index >= self.durable for e in events
            ):
                # Past what a replica holds: a failover may yet replace these tokens, so
                # they are not kept, and the entry is read again once `durable` moves.
                for event in events:
                    if isinstance(event, TokenEvent) and event.index < self.durable:
                        self.feed(event)
                break
            self.last_stream_id = _text(entry_id)
            for event in events:
                self.feed(event)
        return bool(entries)

    def ready(self) -> list[TokenEvent | FinishEvent]:
        out: list[TokenEvent | FinishEvent] = []
        limit = self.durable
        while self.next_index in self.pending and (limit is None or self.next_index < limit):
            out.append(self.pending.pop(self.next_index))
            self.next_index += 1
        if (
            self.finish is not None
            and not self.finish_delivered
            and self.finish.usage.completion_tokens <= self.next_index
        ):
            self.finish_delivered = True
            out.append(self.finish)
        return out

    @property
    def gap(self) -> bool:
        reach = self.next_index  # the first index `ready()` cannot hand out yet
        while reach in self.pending:
            reach += 1
        if len(self.pending) > reach - self.next_index:  # a token beyond a hole
            return True
        return (
            self.finish is not None
            and not self.finish_delivered
            and self.finish.usage.completion_tokens > reach
        )

    @property
    def complete(self) -> bool:
        return self.finish_delivered


def raise_for_finish(result: JobResult) -> JobResult:
    """Rejected and failed jobs raise their named errors; other results pass through."""
    if result.finish_reason in (FinishReason.REJECTED, FinishReason.ERROR):
        reason = result.error.reason if result.error else str(result.finish_reason)
        message = result.error.message if result.error else ""
        error_type = JobRejected if result.finish_reason == FinishReason.REJECTED else JobFailed
        raise error_type(result.job_id, reason, message)
    return result


@dataclass(frozen=True)
class JobStatus:
    """A job's state hash, read back. `status` is queued | running | finished."""

    job_id: str
    status: str
    fields: dict[str, str]

    @property
    def finish_reason(self) -> str | None:
        return self.fields.get("finish_reason")

    @property
    def worker(self) -> str | None:
        return self.fields.get("worker")


def parse_status(job_id: str, raw: dict[bytes, bytes]) -> JobStatus:
    """HGETALL of the job hash as a `JobStatus`; JobNotFound when it does not exist."""
    if not raw:
        raise JobNotFound(job_id)
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    return JobStatus(job_id, fields.get("status", "unknown"), fields)
