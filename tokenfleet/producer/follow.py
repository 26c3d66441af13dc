"""Following a job across Redis restarts: the rules (`JobFollower` for `stream()`,
`ResultWait` for `result()`, `reconnect_pause` for the backoff) and the two loops that
apply them (`follow_stream`, `wait_result`), written once as plans (see `producer.ops`)
that the sync and async handles carry out. See docs/protocol.md, "Following a job".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenfleet.backoff import Backoff
from tokenfleet.errors import JobLost, JobNotFound, JobTimeout
from tokenfleet.keys import Keys
from tokenfleet.producer.common import EventAssembler, raise_for_finish
from tokenfleet.producer.ops import Batch, Command, Disconnect, Emit, Listen, Plan, Subscribe
from tokenfleet.protocol import FinishEvent, JobResult, TokenEvent, decode_result
from tokenfleet.redis_errors import RedisFault, fault_of

STREAM_IDLE_TIMEOUT_S = 300.0  # stream()'s default: the silence allowed between two events
# A handle follows one job on a subscription of its own, so polling is cheap, and pub/sub
# may drop a message with nothing after it to show the gap (the finish): with no live
# message for this long, stream() re-reads the replay stream and result() looks again.
# (The gateway's streams share a few subscriptions: gateway/jobs.py polls far less.)
OWN_SUBSCRIPTION_POLL_S = 0.5
STATE_CHECK_S = 1.0  # while streaming, check the job's state still exists at least this often
RECONNECT_FIRST_S = 0.05  # the first pause after a lost connection; it doubles per failure
RECONNECT_MAX_S = 1.0  # ... up to this
LIVE_MESSAGE_TYPES = ("message", "smessage")  # a channel's, a shard channel's (a cluster)


def reconnect_backoff(*, limit_s: float | None = None, deadline: float | None = None) -> Backoff:
    """A follower's backoff: RECONNECT_FIRST_S doubling to RECONNECT_MAX_S, jittered; one
    outage may last `limit_s`, or until the monotonic `deadline` (None: no bound)."""
    return Backoff(RECONNECT_FIRST_S, RECONNECT_MAX_S, limit_s=limit_s, deadline=deadline)


def reconnect_pause(backoff: Backoff, exc: Exception, job_id: str, now: float) -> float:
    """The pause before reconnecting after `exc`. Re-raises `exc` unless it is a lost
    connection (a restart, a dropped socket, a timeout: `RedisFault.CONNECTION`; refused
    credentials stay wrong however often we retry), or once the outage is over its bound."""
    if fault_of(exc) is not RedisFault.CONNECTION:
        raise exc
    pause = backoff.failed(now)
    if backoff.over(now):
        exc.add_note(
            f"tokenfleet: gave up following job {job_id} after "
            f"{backoff.lasted(now):.1f}s without Redis"
        )
        raise exc
    return pause


def missing_job_error(job_id: str, known: bool) -> JobLost | JobNotFound:
    """What a follower raises when neither the job hash nor the result exists.

    JobLost for a job known to have existed (the handle submitted it, or an earlier
    read saw its hash, result or events): its state was lost (Redis restarted without
    persistence) and it can never finish, whatever a worker still holds, because its
    jobs-stream entry is gone too. JobNotFound for an id never seen."""
    if known:
        return JobLost(job_id, "neither its state hash nor its result exists any more")
    return JobNotFound(job_id)


NOT_FOUND_GRACE_S = 10.0  # how long stream() waits for an unknown job id to appear


@dataclass
class JobFollower:
    """`stream()`'s rules, without the I/O.

    On every (re)connect the loop (`follow_stream`) subscribes to the live channel, then
    makes one sync round trip (`sync`, `absorb` its replies) with a replay and a state
    check, then calls `connected`. After that: hand out `ready()`; when nothing is
    ready, `raise_if_over()`, wait up to OWN_SUBSCRIPTION_POLL_S for a live message,
    hand it to `after_wait` and sync again when it says to (a replay when no message
    came or one was missed, a state check when one is due).
    On a lost connection: drop the subscription, sleep `disconnected()` seconds, and
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
    reconnect: Backoff = field(init=False)  # one outage may last `timeout`
    last_event: float = field(default_factory=time.monotonic)
    last_check: float = -math.inf
    state_missing: bool = False  # the last check found neither job hash nor result
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.reconnect = reconnect_backoff(limit_s=self.timeout)

    def check_due(self, now: float) -> bool:
        return now - self.last_check >= STATE_CHECK_S

    def sync(self, keys: Keys, *, replay: bool, check: bool) -> Batch:
        """One sync round trip, its replies in the order `absorb` reads them."""
        commands: list[Command] = []
        if replay:
            commands.append(
                Command("XRANGE", keys.events(self.job_id), self.asm.replay_start(), "+")
            )
            # after the XRANGE: the script that wrote an event set this field with it
            commands.append(Command("HGET", keys.job(self.job_id), "durable"))
        if check:
            commands.append(Command("EXISTS", keys.job(self.job_id), keys.result(self.job_id)))
        return Batch(tuple(commands))

    def absorb(self, replies: list[Any], *, replay: bool, check: bool, now: float) -> None:
        """One sync round trip's replies, in order: XRANGE of the replay stream from
        the last entry read and the job's `durable` bound (when `replay`), EXISTS job
        hash + result (when `check`)."""
        if replay:
            self.asm.bound(replies[1])
        if replay and self.asm.feed_entries(replies[0]):
            self.known = True
            self.state_missing = False  # events prove it exists (checked again soon)
        if check:
            found = int(replies[-1])
            self.last_check = now
            self.state_missing = found == 0
            self.known = self.known or found > 0

    def feed_live(self, data: bytes) -> None:
        self.asm.feed_raw(data, live=True)
        self.known = True
        self.state_missing = False

    def after_wait(self, message: dict[str, Any] | None, now: float) -> tuple[bool, bool]:
        """Take what one wait on the live channel brought (None: OWN_SUBSCRIPTION_POLL_S
        passed in silence) and say what the next sync does, (replay, check): replay when nothing
        live came or a gap shows something was missed, check when one is due."""
        if message is not None and message["type"] in LIVE_MESSAGE_TYPES:
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
        return reconnect_pause(self.reconnect, exc, self.job_id, now)


@dataclass
class ResultWait:
    """`result()`'s rules, without the I/O.

    Each look is one round trip: GET the result, EXISTS the job hash (`look`, `absorb`).
    Between looks the loop (`wait_result`) waits `pause()` seconds at a time for a
    message on the live channel holding the finish event (only a cue to look again);
    tokens are not looked after, a silence is. On a lost connection: drop the
    subscription, sleep `disconnected()` seconds, subscribe again. `timeout` bounds the
    whole wait (JobTimeout), outages included: one still going when it passes raises
    its error.
    """

    job_id: str
    timeout: float | None
    known: bool = False
    reconnect: Backoff = field(init=False)  # its deadline is the whole wait's

    def __post_init__(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self.reconnect = reconnect_backoff(deadline=deadline)

    def look(self, keys: Keys) -> Batch:
        """One look's round trip: GET the result, EXISTS the job hash (`absorb`'s replies)."""
        return Batch(
            (Command("GET", keys.result(self.job_id)), Command("EXISTS", keys.job(self.job_id)))
        )

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
            return OWN_SUBSCRIPTION_POLL_S
        if now >= deadline:
            raise JobTimeout(self.job_id, self.timeout or 0.0)
        return min(OWN_SUBSCRIPTION_POLL_S, deadline - now)

    def disconnected(self, exc: Exception, now: float) -> float:
        """Seconds to pause before reconnecting; raises `exc` when giving up."""
        return reconnect_pause(self.reconnect, exc, self.job_id, now)


def follow_stream(follow: JobFollower, keys: Keys) -> Plan[FinishEvent]:
    """`stream()`: emit each token once, in order, across reconnects (`JobFollower`'s
    rules); return the finish event."""
    subscribed = False
    while True:
        try:
            if not subscribed:  # (re)connect: subscribe, then replay
                yield Subscribe(keys.channel(follow.job_id))
                subscribed = True
                replies = yield follow.sync(keys, replay=True, check=True)
                follow.absorb(replies, replay=True, check=True, now=time.monotonic())
                follow.connected(time.monotonic())
            events = follow.ready(time.monotonic())
            if not events:
                follow.raise_if_over(time.monotonic())
                message = yield Listen(OWN_SUBSCRIPTION_POLL_S)
                replay, check = follow.after_wait(message, time.monotonic())
                if replay or check:
                    replies = yield follow.sync(keys, replay=replay, check=check)
                    follow.absorb(replies, replay=replay, check=check, now=time.monotonic())
                continue
        except redis.RedisError as exc:  # what is not a lost connection is raised
            subscribed = False
            yield Disconnect(follow.disconnected(exc, time.monotonic()))
            continue
        for event in events:
            if isinstance(event, FinishEvent):
                return event
            yield Emit(event)


def wait_result(wait: ResultWait, keys: Keys) -> Plan[JobResult]:
    """`result()`: look until the result is stored (`ResultWait`'s rules)."""
    subscribed = False
    while True:
        try:
            if not subscribed:
                yield Subscribe(keys.channel(wait.job_id))
                subscribed = True
            result = wait.absorb(*(yield wait.look(keys)))
            if result is not None:
                return result
            # A message holding a finish event is the cue to look again, and so is a
            # silence (a message can be lost); a token is not: a look per token cost Redis
            # more than streaming the tokens (docs/benchmarks.md, coordination cost).
            while not _may_end((yield Listen(wait.pause(time.monotonic())))):
                pass
        except redis.RedisError as exc:  # what is not a lost connection is raised
            subscribed = False
            yield Disconnect(wait.disconnected(exc, time.monotonic()))


_FINISH_TYPE = b"\xa6finish"  # msgpack of the string "finish": a finish event's type


def _may_end(message: dict[str, Any] | None) -> bool:
    """Whether a wait on the job's channel should look for the result now: after a
    silence (None), or a message that may hold its finish event (a token whose text is
    "finish" looks once more, harmlessly); not after a token or a subscribe reply."""
    if message is None:
        return True
    data = message.get("data")
    return (
        message.get("type") in LIVE_MESSAGE_TYPES
        and isinstance(data, bytes)
        and _FINISH_TYPE in data
    )
