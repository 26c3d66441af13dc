"""The producer client on `redis.asyncio`: the same surface as `Producer`, awaitable."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError

from tokenfleet.errors import JobNotFound, JobTimeout, QueueFull
from tokenfleet.keys import CANCEL_TTL_S, DEFAULT_QUEUE_CAP, Keys
from tokenfleet.producer.client import REPLAY_POLL_S, JobStatus, raise_for_finish
from tokenfleet.producer.common import (
    CAPACITY_TTL_S,
    SUBMIT_LUA,
    EventAssembler,
    SubmitReply,
    build_request,
    check_fleet_fits,
    encode_request,
    fleet_capacity,
    parse_submit_reply,
    submit_call,
)
from tokenfleet.protocol import FinishEvent, GenerationRequest, JobResult, TokenEvent, decode_result


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
        self, request: GenerationRequest | None = None, /, **fields: Any
    ) -> AsyncJobHandle:
        req = build_request(request, fields)
        check_fleet_fits(req, await self.capacity(req.model))
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

    async def stream(self, timeout: float | None = None) -> AsyncIterator[TokenEvent]:
        keys = self.producer.keys
        asm = EventAssembler()
        pubsub = self.producer.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(keys.channel(self.id))
        try:
            await self._replay(asm)
            last_progress = time.monotonic()
            while True:
                for event in asm.ready():
                    last_progress = time.monotonic()
                    if isinstance(event, FinishEvent):
                        self.finish = event
                        return
                    yield event
                message = await pubsub.get_message(timeout=REPLAY_POLL_S)
                if message is not None and message["type"] == "message":
                    asm.feed_raw(message["data"])
                    if asm.gap:
                        await self._replay(asm)
                else:
                    await self._replay(asm)
                if timeout is not None and time.monotonic() - last_progress > timeout:
                    raise JobTimeout(self.id, timeout)
        finally:
            await pubsub.aclose()

    async def _replay(self, asm: EventAssembler) -> None:
        start = "-" if asm.last_stream_id == "-" else f"({asm.last_stream_id}"
        entries = await self.producer.redis.xrange(self.producer.keys.events(self.id), start, "+")
        for entry_id, fields in entries:
            asm.last_stream_id = entry_id.decode()
            asm.feed_raw(fields[b"m"])

    async def result(self, timeout: float | None = None) -> JobResult:
        keys = self.producer.keys
        client = self.producer.redis
        deadline = None if timeout is None else time.monotonic() + timeout
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(keys.channel(self.id))
        try:
            while True:
                stored = await client.get(keys.result(self.id))
                if stored is not None:
                    return raise_for_finish(decode_result(stored))
                if not await client.exists(keys.job(self.id)):
                    raise JobNotFound(self.id)
                wait = REPLAY_POLL_S
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise JobTimeout(self.id, timeout or 0.0)
                message = await pubsub.get_message(timeout=wait)
                if message is None:
                    await asyncio.sleep(0)
        finally:
            await pubsub.aclose()

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
