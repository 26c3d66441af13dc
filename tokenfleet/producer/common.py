"""What the sync and async producers share: request building, the submit script's
arguments and replies, the in-order event assembler, and the rules for following a
job across Redis restarts (`JobFollower`, `ResultWait`). No I/O here."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis
from pydantic import ValidationError
from redis.exceptions import AuthenticationError, AuthorizationError

from tokenfleet.errors import (
    InvalidRequest,
    JobFailed,
    JobLost,
    JobNotFound,
    JobRejected,
    JobTimeout,
    QueueFull,
)
from tokenfleet.keys import DEFAULT_MODEL, JOB_STATE_TTL_S, Keys
from tokenfleet.protocol import (
    MAX_PAYLOAD_BYTES,
    FinishEvent,
    GenerationRequest,
    JobResult,
    TokenEvent,
    decode_event,
    decode_result,
    encode,
)
from tokenfleet.reasons import FinishReason

SUBMIT_LUA = resources.files("tokenfleet").joinpath("lua/submit.lua").read_text()


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
) -> tuple[list[str], list[str | bytes | int | float]]:
    """KEYS and ARGV for submit.lua (documented in the script itself)."""
    model = request.model or DEFAULT_MODEL
    script_keys = [
        keys.jobs(request.model),
        keys.queue_cap(request.model),
        keys.job(request.job_id),
        keys.models(),
    ]
    args: list[str | bytes | int | float] = [
        request.job_id,
        payload,
        default_cap,
        f"{time.time():.6f}",
        JOB_STATE_TTL_S,
        model,
    ]
    return script_keys, args


@dataclass(frozen=True)
class SubmitReply:
    """submit.lua's reply, parsed. `duplicate` means the id was already accepted."""

    job_id: str
    entry_id: str
    duplicate: bool


def parse_submit_reply(keys: Keys, request: GenerationRequest, reply: list[Any]) -> SubmitReply:
    """Turn the script's reply into a `SubmitReply`, or raise `QueueFull`."""
    kind = _text(reply[0])
    if kind == "full":
        raise QueueFull(depth=int(reply[1]), cap=int(reply[2]), stream=keys.jobs(request.model))
    if kind == "dup":
        return SubmitReply(request.job_id, _text(reply[1]), duplicate=True)
    assert kind == "ok", f"unexpected submit reply {reply!r}"
    return SubmitReply(request.job_id, _text(reply[1]), duplicate=False)


CAPACITY_TTL_S = 1.0  # how long a producer trusts what it read of the fleet's capacity


def fleet_capacity(workers: dict[str, dict[str, Any]], model: str | None) -> int | None:
    """The largest prompt + max_new_tokens any live worker serving `model` could hold,
    or None when no live worker serves it (then jobs queue as usual)."""
    name = model or DEFAULT_MODEL
    sizes = [
        int(info["max_job_tokens"])
        for info in workers.values()
        if info.get("model", DEFAULT_MODEL) == name and isinstance(info.get("max_job_tokens"), int)
    ]
    return max(sizes) if sizes else None


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

    def feed(self, event: TokenEvent | FinishEvent) -> None:
        if isinstance(event, FinishEvent):
            self.finish = event
        elif event.index >= self.next_index:
            self.pending.setdefault(event.index, event)

    def feed_raw(self, data: bytes) -> None:
        self.feed(decode_event(data))

    def replay_start(self) -> str:
        """XRANGE's start on the replay stream: everything, or what follows the last
        entry read (exclusive)."""
        return "-" if self.last_stream_id == "-" else f"({self.last_stream_id}"

    def feed_entries(self, entries: list[Any]) -> bool:
        """Feed an XRANGE reply of the replay stream (from `replay_start()`), remembering
        the last entry read; True when it held any entry."""
        for entry_id, fields in entries:
            self.last_stream_id = _text(entry_id)
            self.feed_raw(fields[b"m"])
        return bool(entries)

    def ready(self) -> list[TokenEvent | FinishEvent]:
        out: list[TokenEvent | FinishEvent] = []
        while self.next_index in self.pending:
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


# ---- following a job across Redis restarts ------------------------------------------------
#
# The sync and async handles run the same loop; what the loop decides lives here, so
# both only do the I/O. See docs/protocol.md, "Following a job".

STREAM_IDLE_TIMEOUT_S = 300.0  # stream()'s default: the silence allowed between two events
REPLAY_POLL_S = 0.5  # with no pub/sub traffic, re-read the replay stream this often
STATE_CHECK_S = 1.0  # while streaming, check the job's state still exists at least this often
RECONNECT_FIRST_S = 0.05  # the first pause after a lost connection; it doubles per failure
RECONNECT_MAX_S = 1.0  # ... up to this

# What a lost connection raises. redis-py makes a refused password or ACL a
# ConnectionError too; those stay wrong however often we retry, so they raise at once.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
PERMANENT_ERRORS: tuple[type[Exception], ...] = (AuthenticationError, AuthorizationError)


def is_transient(exc: BaseException) -> bool:
    """A Redis error worth reconnecting for (a restart, a dropped socket, a timeout)."""
    return isinstance(exc, TRANSIENT_ERRORS) and not isinstance(exc, PERMANENT_ERRORS)


def missing_job_error(job_id: str, known: bool) -> JobLost | JobNotFound:
    """What a follower raises when neither the job hash nor the result exists.

    JobLost for a job known to have existed (the handle submitted it, or an earlier
    read saw its hash, result or events): its state was lost (Redis restarted without
    persistence) and it can never finish, whatever a worker still holds, because its
    jobs-stream entry is gone too. JobNotFound for an id never seen."""
    if known:
        return JobLost(job_id, "neither its state hash nor its result exists any more")
    return JobNotFound(job_id)


@dataclass
class Reconnect:
    """Capped exponential backoff over one outage, and when to give it up.

    Pauses start at RECONNECT_FIRST_S and double up to RECONNECT_MAX_S, each cut by a
    random part of up to half (clients cut off together don't all return in the same
    millisecond). An outage ends at the first round trip that succeeds (`succeeded`).
    It is given up, re-raising the last error, once it has lasted `limit_s` seconds or
    the monotonic `deadline` has passed; None is no bound."""

    limit_s: float | None = None
    deadline: float | None = None
    since: float | None = None  # when the current outage began (monotonic); None: connected
    delay: float = RECONNECT_FIRST_S

    def failed(self, exc: Exception, job_id: str, now: float) -> float:
        """The pause before the next attempt; re-raises `exc` when it must not be retried."""
        if not is_transient(exc):
            raise exc
        if self.since is None:
            self.since = now
        give_up = math.inf if self.deadline is None else self.deadline
        if self.limit_s is not None:
            give_up = min(give_up, self.since + self.limit_s)
        if now >= give_up:
            exc.add_note(
                f"tokenfleet: gave up following job {job_id} after "
                f"{now - self.since:.1f}s without Redis"
            )
            raise exc
        pause = self.delay * (1 - random.random() / 2)
        self.delay = min(self.delay * 2, RECONNECT_MAX_S)
        return min(pause, give_up - now)

    def succeeded(self) -> None:
        self.since = None
        self.delay = RECONNECT_FIRST_S


NOT_FOUND_GRACE_S = 10.0  # how long stream() waits for an unknown job id to appear


@dataclass
class JobFollower:
    """`stream()`'s rules, without the I/O.

    On every (re)connect the loop subscribes to the live channel, then makes one
    sync round trip (`queue_sync` on a pipeline, `absorb` its replies) with a replay
    and a state check, then calls `connected`. After that: hand out `ready()`; when
    nothing is ready, `raise_if_over()`, wait up to REPLAY_POLL_S for a live message,
    hand it to `after_wait` and sync again when it says to (a replay when no message
    came or one was missed, a state check when one is due).
    On a transient error: drop the subscription, sleep `disconnected()` seconds, and
    start over at subscribe; the assembler keeps the last replay entry read and the
    next index, so the caller sees every token once.

    `timeout` bounds the silence between two events (JobTimeout) and how long one
    outage may last before its error is raised; None waits (and retries) forever.
    Once Redis is back, the silence clock restarts: an outage is not the job's silence.
    """

    job_id: str
    timeout: float | None
    known: bool = False  # the job was seen to exist: a missing state then means JobLost
    asm: EventAssembler = field(default_factory=EventAssembler)
    reconnect: Reconnect = field(init=False)  # one outage may last `timeout`
    last_event: float = field(default_factory=time.monotonic)
    last_check: float = -math.inf
    state_missing: bool = False  # the last check found neither job hash nor result
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.reconnect = Reconnect(limit_s=self.timeout)

    def check_due(self, now: float) -> bool:
        return now - self.last_check >= STATE_CHECK_S

    def queue_sync(self, pipe: Any, keys: Keys, *, replay: bool, check: bool) -> None:
        """Queue one sync's commands on a (sync or async) pipeline, in the order `absorb`
        reads their replies."""
        if replay:
            pipe.xrange(keys.events(self.job_id), self.asm.replay_start(), "+")
        if check:
            pipe.exists(keys.job(self.job_id), keys.result(self.job_id))

    def absorb(self, replies: list[Any], *, replay: bool, check: bool, now: float) -> None:
        """One sync round trip's replies, in order: XRANGE of the replay stream from
        the last entry read (when `replay`), EXISTS job hash + result (when `check`)."""
        if replay and self.asm.feed_entries(replies[0]):
            self.known = True
            self.state_missing = False  # events prove it exists (checked again soon)
        if check:
            found = int(replies[-1])
            self.last_check = now
            self.state_missing = found == 0
            self.known = self.known or found > 0

    def feed_live(self, data: bytes) -> None:
        self.asm.feed_raw(data)
        self.known = True
        self.state_missing = False

    def after_wait(self, message: dict[str, Any] | None, now: float) -> tuple[bool, bool]:
        """Take what one wait on the live channel brought (None: REPLAY_POLL_S passed in
        silence) and say what the next sync does, (replay, check): replay when nothing
        live came or a gap shows something was missed, check when one is due."""
        if message is not None and message["type"] == "message":
            self.feed_live(message["data"])
            replay = self.asm.gap
        else:
            replay = True
        return replay, self.check_due(now)

    def ready(self, now: float) -> list[TokenEvent | FinishEvent]:
        events = self.asm.ready()
        if events:
            self.last_event = now
        return events

    def raise_if_over(self, now: float) -> None:
        """With nothing ready to hand out: JobLost when the last check found a job seen
        before gone, JobNotFound when a job never seen is still unknown after
        NOT_FOUND_GRACE_S (a client may subscribe just before it submits), JobTimeout
        when the silence lasted `timeout`."""
        if self.state_missing and (self.known or now - self.started > NOT_FOUND_GRACE_S):
            raise missing_job_error(self.job_id, self.known)
        if self.timeout is not None and now - self.last_event > self.timeout:
            raise JobTimeout(self.job_id, self.timeout)

    def connected(self, now: float) -> None:
        """A (re)connect's first sync succeeded."""
        if self.reconnect.since is not None:
            self.last_event = now
        self.reconnect.succeeded()

    def disconnected(self, exc: Exception, now: float) -> float:
        """Seconds to pause before reconnecting; raises `exc` when giving up."""
        return self.reconnect.failed(exc, self.job_id, now)


@dataclass
class ResultWait:
    """`result()`'s rules, without the I/O.

    Each look is one round trip: GET the result, EXISTS the job hash (`absorb`). Between
    looks the loop waits `pause()` seconds for any message on the live channel (only a
    cue to look again). On a transient error: drop the subscription, sleep
    `disconnected()` seconds, subscribe again. `timeout` bounds the whole wait
    (JobTimeout), outages included: one still going when it passes raises its error.
    """

    job_id: str
    timeout: float | None
    known: bool = False
    reconnect: Reconnect = field(init=False)  # its deadline is the whole wait's

    def __post_init__(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self.reconnect = Reconnect(deadline=deadline)

    def queue_look(self, pipe: Any, keys: Keys) -> None:
        """Queue one look's commands on a (sync or async) pipeline: GET the result,
        EXISTS the job hash, the replies `absorb` takes."""
        pipe.get(keys.result(self.job_id))
        pipe.exists(keys.job(self.job_id))

    def absorb(self, stored: bytes | None, job_exists: int) -> JobResult | None:
        """The stored result (rejected and failed ones raise), or None while there is none;
        JobLost / JobNotFound when neither the result nor the job hash exists."""
        self.reconnect.succeeded()
        if stored is not None:
            return raise_for_finish(decode_result(stored))
        if not job_exists:
            raise missing_job_error(self.job_id, self.known)
        self.known = True
        return None

    def pause(self, now: float) -> float:
        """How long to wait for a cue before looking again; JobTimeout once past the deadline."""
        deadline = self.reconnect.deadline
        if deadline is None:
            return REPLAY_POLL_S
        if now >= deadline:
            raise JobTimeout(self.job_id, self.timeout or 0.0)
        return min(REPLAY_POLL_S, deadline - now)

    def disconnected(self, exc: Exception, now: float) -> float:
        """Seconds to pause before reconnecting; raises `exc` when giving up."""
        return self.reconnect.failed(exc, self.job_id, now)
