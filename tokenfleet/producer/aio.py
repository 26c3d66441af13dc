"""The producer client on `redis.asyncio`: the same surface as `Producer`, awaitable."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable
from types import EllipsisType
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError

from tokenfleet.errors import JobNotFound, QueueFull
from tokenfleet.keys import CANCEL_TTL_S, DEFAULT_QUEUE_CAP, Keys
from tokenfleet.producer.client import JobStatus
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


class AsyncProducer:
    """`Producer` for asyncio services. See `tokenfleet.producer.Producer` for the rules."""

    def __init__(
        self,
        client: aredis.Redis,
        *,
        keys: Keys | None = None,
        default_cap: int = DEFAULT_QUEUE_CAP,
    ) -> None:
        self.redis = client
        self.keys = keys or Keys()
        self.default_cap = default_cap
        self._submit = client.register_script(SUBMIT_LUA)
        self._capacity: dict[str | None, tuple[float, int | None]] = {}

    async def capacity(self, model: str | None = None) -> int | None:
        """Largest job a live worker for `model` holds (None: no live worker); cached ~1 s."""
        now = time.monotonic()
        cached = self._capacity.get(model)
        if cached is None or now - cached[0] > CAPACITY_TTL_S:
            names = await self.redis.zrange(self.keys.workers(), 0, -1)
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.hmget(self.keys.worker(name.decode()), ["model", "max_job_tokens"])
            workers: dict[str, dict[str, Any]] = {}
            for name, (model_field, size) in zip(names, await pipe.execute(), strict=True):
                if model_field is not None and size is not None:
                    workers[name.decode()] = {
                        "model": json.loads(model_field),
                        "max_job_tokens": json.loads(size),
                    }
            cached = (now, fleet_capacity(workers, model))
            self._capacity[model] = cached
        return cached[1]

    @classmethod
    def from_url(cls, url: str, *, prefix: str | None = None, **kwargs: Any) -> AsyncProducer:
        keys = Keys(prefix) if prefix else Keys()
        return cls(aredis.Redis.from_url(url), keys=keys, **kwargs)

    async def submit(
        self,
        request: GenerationRequest | None = None,
        /,
        *,
        capacity: int | EllipsisType | None = ...,
        **fields: Any,
    ) -> AsyncJobHandle:
        """`Producer.submit` on asyncio. `capacity`: the largest job a live worker holds,
        when the caller already knows it (a gateway's shared fleet view; None: no live
        worker advertises one); by default it is read from the fleet, cached ~1 s."""
        req = build_request(request, fields)
        known = await self.capacity(req.model) if capacity is ... else capacity
        check_fleet_fits(req, known)
        script_keys, args = submit_call(self.keys, req, encode_request(req), self.default_cap)
        reply = await self._submit(keys=script_keys, args=args)
        return self._handle(parse_submit_reply(self.keys, req, reply))

    async def submit_many(
        self, requests: Iterable[GenerationRequest]
    ) -> list[tuple[str, AsyncJobHandle | None, Exception | None]]:
        """Submit in one round trip: (job id, handle or None, error or None) per job."""
        reqs = list(requests)
        pipe = self.redis.pipeline(transaction=False)
        for req in reqs:
            script_keys, args = submit_call(self.keys, req, encode_request(req), self.default_cap)
            await self._submit(keys=script_keys, args=args, client=pipe)
        replies = await pipe.execute(raise_on_error=False)
        out: list[tuple[str, AsyncJobHandle | None, Exception | None]] = []
        for req, reply in zip(reqs, replies, strict=True):
            try:
                if isinstance(reply, Exception):
                    raise reply
                out.append(
                    (req.job_id, self._handle(parse_submit_reply(self.keys, req, reply)), None)
                )
            except (QueueFull, RedisError) as exc:
                out.append((req.job_id, None, exc))
        return out

    def handle(self, job_id: str) -> AsyncJobHandle:
        return AsyncJobHandle(self, job_id)

    def _handle(self, reply: SubmitReply) -> AsyncJobHandle:
        return AsyncJobHandle(
            self, reply.job_id, entry_id=reply.entry_id, duplicate=reply.duplicate
        )

    async def depth(self, model: str | None = None) -> int:
        return int(await self.redis.xlen(self.keys.jobs(model)))

    async def aclose(self) -> None:
        await self.redis.aclose()


class AsyncJobHandle:
    """`JobHandle` for asyncio: `async for event in handle.stream()`, `await handle.result()`."""

    def __init__(
        self, producer: AsyncProducer, job_id: str, *, entry_id: str = "", duplicate: bool = False
    ) -> None:
        self.producer = producer
        self.id = job_id
        self.entry_id = entry_id
        self.duplicate = duplicate
        self.finish: FinishEvent | None = None
        self._known = bool(entry_id)  # seen to exist: see JobHandle

    async def stream(
        self, timeout: float | None = STREAM_IDLE_TIMEOUT_S
    ) -> AsyncIterator[TokenEvent]:
        """`JobHandle.stream`: each token once, in order, across Redis restarts; the same
        `timeout` (300 s of silence unless given, None forever), JobLost, JobTimeout."""
        keys = self.producer.keys
        follow = JobFollower(self.id, timeout, known=self._known)
        pubsub: Any = None
        try:
            while True:
                try:
                    if pubsub is None:  # (re)connect: subscribe, then replay
                        pubsub = self.producer.redis.pubsub(ignore_subscribe_messages=True)
                        await pubsub.subscribe(keys.channel(self.id))
                        await self._sync(follow, replay=True, check=True)
                        follow.connected(time.monotonic())
                    events = follow.ready(time.monotonic())
                    if not events:
                        follow.raise_if_over(time.monotonic())
                        message = await pubsub.get_message(timeout=REPLAY_POLL_S)
                        replay, check = follow.after_wait(message, time.monotonic())
                        if replay or check:
                            await self._sync(follow, replay=replay, check=check)
                        continue
                except TRANSIENT_ERRORS as exc:
                    await _close_quietly(pubsub)
                    pubsub = None
                    await asyncio.sleep(follow.disconnected(exc, time.monotonic()))
                    continue
                for event in events:
                    if isinstance(event, FinishEvent):
                        self.finish = event
                        return
                    yield event
        finally:
            self._known = follow.known
            await _close_quietly(pubsub)

    async def _sync(self, follow: JobFollower, *, replay: bool, check: bool) -> None:
        pipe = self.producer.redis.pipeline(transaction=False)
        follow.queue_sync(pipe, self.producer.keys, replay=replay, check=check)
        follow.absorb(await pipe.execute(), replay=replay, check=check, now=time.monotonic())

    async def result(self, timeout: float | None = None) -> JobResult:
        """`JobHandle.result`: the final result, waiting across Redis restarts."""
        keys = self.producer.keys
        client = self.producer.redis
        wait = ResultWait(self.id, timeout, known=self._known)
        pubsub: Any = None
        try:
            while True:
                try:
                    if pubsub is None:
                        pubsub = client.pubsub(ignore_subscribe_messages=True)
                        await pubsub.subscribe(keys.channel(self.id))
                    pipe = client.pipeline(transaction=False)
                    wait.queue_look(pipe, keys)
                    result = wait.absorb(*await pipe.execute())
                    if result is not None:
                        return result
                    message = await pubsub.get_message(timeout=wait.pause(time.monotonic()))
                    if message is None:
                        await asyncio.sleep(0)
                except TRANSIENT_ERRORS as exc:
                    await _close_quietly(pubsub)
                    pubsub = None
                    await asyncio.sleep(wait.disconnected(exc, time.monotonic()))
        finally:
            self._known = wait.known
            await _close_quietly(pubsub)

    async def cancel(self) -> bool:
        keys = self.producer.keys
        state = await self.producer.redis.hget(keys.job(self.id), "status")
        if state is None or state == b"finished":
            return False
        await self.producer.redis.set(keys.cancel(self.id), 1, ex=CANCEL_TTL_S)
        return True

    async def status(self) -> JobStatus:
        raw = await self.producer.redis.hgetall(self.producer.keys.job(self.id))
        if not raw:
            raise JobNotFound(self.id)
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        return JobStatus(self.id, fields.get("status", "unknown"), fields)


async def _close_quietly(pubsub: Any) -> None:
    """Close a subscription whose connection may already be broken."""
    if pubsub is not None:
        with contextlib.suppress(RedisError, OSError):
            await pubsub.aclose()
