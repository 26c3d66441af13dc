"""The producer client: submit jobs to the fleet and follow them (sync, redis-py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.errors import JobNotFound, JobRejected, QueueFull
from tokenfleet.keys import CANCEL_TTL_S, DEFAULT_QUEUE_CAP, Keys
from tokenfleet.producer.common import (
    CAPACITY_TTL_S,
    REPLAY_POLL_S,
    STREAM_IDLE_TIMEOUT_S,
    SUBMIT_LUA,
    TRANSIENT_ERRORS,
    JobFollower,
    ResultWait,
    SubmitReply,
    build_request,
    check_fleet_fits,
    encode_request,
    fleet_capacity,
    parse_submit_reply,
    submit_call,
)
from tokenfleet.protocol import FinishEvent, GenerationRequest, JobResult, TokenEvent


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


@dataclass(frozen=True)
class SubmitOutcome:
    """One job's outcome in `submit_many`: a handle, or the error that refused it."""

    job_id: str
    handle: JobHandle | None
    error: Exception | None = None
    duplicate: bool = False

    @property
    def accepted(self) -> bool:
        return self.handle is not None


class Producer:
    """Submits jobs to a fleet's bounded jobs stream.

    `submit` is one atomic script call: an id accepted before returns its
    existing job, a full stream raises `QueueFull` at once, otherwise the job
    is added. Bad input raises `InvalidRequest` before anything is sent.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        keys: Keys | None = None,
        default_cap: int = DEFAULT_QUEUE_CAP,
    ) -> None:
        self.redis = client
        self.keys = keys or Keys()
        self.default_cap = default_cap
        self._submit = client.register_script(SUBMIT_LUA)
        self._capacity: dict[str | None, tuple[float, int | None]] = {}

    @classmethod
    def from_url(cls, url: str, *, prefix: str | None = None, **kwargs: Any) -> Producer:
        keys = Keys(prefix) if prefix else Keys()
        return cls(redis.Redis.from_url(url), keys=keys, **kwargs)

    def capacity(self, model: str | None = None) -> int | None:
        """Largest job (prompt + max_new_tokens) a live worker for `model` holds; cached ~1 s."""
        now = time.monotonic()
        cached = self._capacity.get(model)
        if cached is None or now - cached[0] > CAPACITY_TTL_S:
            from tokenfleet.worker.recovery import live_workers

            cached = (now, fleet_capacity(live_workers(self.redis, self.keys), model))
            self._capacity[model] = cached
        return cached[1]

    def submit(self, request: GenerationRequest | None = None, /, **fields: Any) -> JobHandle:
        """Submit one job. Raises InvalidRequest, QueueFull, or JobRejected when no live
        worker could ever hold it."""
        req = build_request(request, fields)
        check_fleet_fits(req, self.capacity(req.model))
        script_keys, args = submit_call(self.keys, req, encode_request(req), self.default_cap)
        reply = parse_submit_reply(self.keys, req, self._submit(keys=script_keys, args=args))
        return self._handle(reply)

    def submit_many(self, requests: Iterable[GenerationRequest]) -> list[SubmitOutcome]:
        """Submit many jobs in one round trip; each gets its own outcome, in order."""
        reqs = list(requests)
        outcomes: list[SubmitOutcome | None] = [None] * len(reqs)
        pipe = self.redis.pipeline(transaction=False)
        sent: list[int] = []
        for i, req in enumerate(reqs):
            try:
                check_fleet_fits(req, self.capacity(req.model))
            except JobRejected as exc:
                outcomes[i] = SubmitOutcome(req.job_id, None, error=exc)
                continue
            script_keys, args = submit_call(self.keys, req, encode_request(req), self.default_cap)
            self._submit(keys=script_keys, args=args, client=pipe)
            sent.append(i)
        replies = pipe.execute(raise_on_error=False) if sent else []
        for i, reply in zip(sent, replies, strict=True):
            req = reqs[i]
            try:
                if isinstance(reply, Exception):
                    raise reply
                parsed = parse_submit_reply(self.keys, req, reply)
                handle = self._handle(parsed)
                outcomes[i] = SubmitOutcome(req.job_id, handle, duplicate=parsed.duplicate)
            except (QueueFull, redis.RedisError) as exc:
                outcomes[i] = SubmitOutcome(req.job_id, None, error=exc)
        return [o for o in outcomes if o is not None]

    def handle(self, job_id: str) -> JobHandle:
        """A handle on a job submitted earlier (by anyone)."""
        return JobHandle(self, job_id)

    def _handle(self, reply: SubmitReply) -> JobHandle:
        return JobHandle(self, reply.job_id, entry_id=reply.entry_id, duplicate=reply.duplicate)

    def set_queue_cap(self, cap: int, model: str | None = None) -> None:
        if cap < 1:
            raise ValueError("queue cap must be at least 1")
        self.redis.set(self.keys.queue_cap(model), cap)

    def queue_cap(self, model: str | None = None) -> int:
        value = self.redis.get(self.keys.queue_cap(model))
        return int(value) if value is not None else self.default_cap

    def depth(self, model: str | None = None) -> int:
        """Accepted, unfinished jobs: XLEN of the jobs stream."""
        return int(self.redis.xlen(self.keys.jobs(model)))


class JobHandle:
    """Follow one job: its tokens in order, its result, its status; cancel it."""

    def __init__(
        self, producer: Producer, job_id: str, *, entry_id: str = "", duplicate: bool = False
    ) -> None:
        self.producer = producer
        self.id = job_id
        self.entry_id = entry_id
        self.duplicate = duplicate
        self.finish: FinishEvent | None = None
        # Seen to exist (it was submitted here, or a read found it): if its state then
        # vanishes, following it raises JobLost rather than JobNotFound.
        self._known = bool(entry_id)

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"

    @property
    def _redis(self) -> redis.Redis:
        return self.producer.redis

    def stream(self, timeout: float | None = STREAM_IDLE_TIMEOUT_S) -> Iterator[TokenEvent]:
        """Yield the job's token events, each once, in index order; end after its finish.

        Subscribes to the live channel first, then replays the job's event stream, so
        nothing published before the call is missed. The finish event is kept on
        `self.finish`. A lost connection (a Redis restart) is retried with backoff:
        subscribe again, replay from the last entry read, go on at the next index.

        `timeout` bounds the silence between two events (JobTimeout; 300 s unless
        given, None waits forever) and how long Redis may stay unreachable (then its
        ConnectionError is raised). Raises JobLost when the job's state vanished from
        Redis (JobNotFound for an id never seen): see `JobFollower`.
        """
        keys = self.producer.keys
        follow = JobFollower(self.id, timeout, known=self._known)
        pubsub: Any = None
        try:
            while True:
                try:
                    if pubsub is None:  # (re)connect: subscribe, then replay
                        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(keys.channel(self.id))
                        self._sync(follow, replay=True, check=True)
                        follow.connected(time.monotonic())
                    events = follow.ready(time.monotonic())
                    if not events:
                        follow.raise_if_over(time.monotonic())
                        message = pubsub.get_message(timeout=REPLAY_POLL_S)
                        replay, check = follow.after_wait(message, time.monotonic())
                        if replay or check:
                            self._sync(follow, replay=replay, check=check)
                        continue
                except TRANSIENT_ERRORS as exc:
                    _close_quietly(pubsub)
                    pubsub = None
                    time.sleep(follow.disconnected(exc, time.monotonic()))
                    continue
                for event in events:
                    if isinstance(event, FinishEvent):
                        self.finish = event
                        return
                    yield event
        finally:
            self._known = follow.known
            _close_quietly(pubsub)

    def _sync(self, follow: JobFollower, *, replay: bool, check: bool) -> None:
        """One round trip: the replay stream from the last entry read, and/or whether the
        job's hash or result still exists."""
        pipe = self._redis.pipeline(transaction=False)
        follow.queue_sync(pipe, self.producer.keys, replay=replay, check=check)
        follow.absorb(pipe.execute(), replay=replay, check=check, now=time.monotonic())

    def result(self, timeout: float | None = None) -> JobResult:
        """The job's final result; raises JobRejected / JobFailed / JobTimeout, JobLost when
        its state vanished from Redis, JobNotFound for an unknown id.

        `timeout` bounds the whole wait (None: forever). Lost connections are retried
        with backoff until it passes (then the last ConnectionError is raised)."""
        keys = self.producer.keys
        wait = ResultWait(self.id, timeout, known=self._known)
        pubsub: Any = None
        try:
            while True:
                try:
                    if pubsub is None:
                        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(keys.channel(self.id))
                    pipe = self._redis.pipeline(transaction=False)
                    wait.queue_look(pipe, keys)
                    result = wait.absorb(*pipe.execute())
                    if result is not None:
                        return result
                    # Any event on the channel is a cue to look again; silence re-checks anyway.
                    pubsub.get_message(timeout=wait.pause(time.monotonic()))
                except TRANSIENT_ERRORS as exc:
                    _close_quietly(pubsub)
                    pubsub = None
                    time.sleep(wait.disconnected(exc, time.monotonic()))
        finally:
            self._known = wait.known
            _close_quietly(pubsub)

    def cancel(self) -> bool:
        """Ask the fleet to stop this job (within one tick wherever it runs).

        Returns False when the job is unknown or already finished."""
        keys = self.producer.keys
        state = self._redis.hget(keys.job(self.id), "status")
        if state is None or state == b"finished":
            return False
        self._redis.set(keys.cancel(self.id), 1, ex=CANCEL_TTL_S)
        return True

    def status(self) -> JobStatus:
        raw = self._redis.hgetall(self.producer.keys.job(self.id))
        if not raw:
            raise JobNotFound(self.id)
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        return JobStatus(self.id, fields.get("status", "unknown"), fields)


def _close_quietly(pubsub: Any) -> None:
    """Close a subscription whose connection may already be broken."""
    if pubsub is not None:
        with contextlib.suppress(redis.RedisError, OSError):
            pubsub.close()
