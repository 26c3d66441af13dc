"""The producer client on `redis.asyncio`: the same surface as `Producer`, awaitable.

What each call sends and decides is `producer.core`, shared with the sync client;
this module carries it out on asyncio."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, TypeVar

import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from tokenfleet.connect import connect_async, initialized, is_cluster_url
from tokenfleet.errors import NotReplicated
from tokenfleet.fleet import read_workers_async
from tokenfleet.keys import DEFAULT_BAND, DEFAULT_PREFIX, Keys
from tokenfleet.producer import ops
from tokenfleet.producer.common import JobStatus, SubmitReply
from tokenfleet.producer.core import HandleCore, ProducerCore
from tokenfleet.producer.durable import submit_waiting_async
from tokenfleet.producer.follow import STREAM_IDLE_TIMEOUT_S
from tokenfleet.protocol import GenerationRequest, JobResult, TokenEvent

T = TypeVar("T")


@dataclass
class _AsyncRun:
    """Carries out one plan on redis.asyncio (see `producer.ops`), as `client._Run` does
    on redis-py. The plan's subscription, while it has one, lives here."""

    producer: AsyncProducer
    pubsub: Any = None

    async def events(self, step: ops.Step[Any]) -> AsyncIterator[TokenEvent]:
        try:
            for op in step:
                if isinstance(op, ops.Emit):
                    yield op.event
                else:
                    await step.settle_async(self.do(op))
        finally:
            step.close()
            await self.close()

    async def do(self, op: ops.Op) -> Any:
        client = self.producer.redis
        match op:
            case ops.Command(args=args):
                return await client.execute_command(*args)
            case ops.Submit(keys=keys, args=args, wait=wait) if wait is not None:
                return await submit_waiting_async(client, keys, args, wait)
            case ops.Submit(keys=keys, args=args):
                return await self.producer._submit_script(keys=keys, args=args)
            case ops.Batch(commands=commands, errors_as_replies=errors_as_replies) if any(
                isinstance(item, ops.Submit)
                and (item.wait or isinstance(client, AsyncRedisCluster))
                for item in commands
            ):
                # a cluster pipeline refuses script calls (redis-py#2914), and a durable
                # submit waits on its own connection: one call each
                replies: list[Any] = []
                for item in commands:
                    try:
                        replies.append(await self.do(item))
                    except (ResponseError, NotReplicated) as exc:
                        if not errors_as_replies:
                            raise
                        replies.append(exc)
                return replies
            case ops.Batch(commands=commands, errors_as_replies=errors_as_replies):
                pipe = client.pipeline(transaction=False)
                for item in commands:
                    if isinstance(item, ops.Command):
                        pipe.execute_command(*item.args)
                    else:
                        await self.producer._submit_script(item.keys, item.args, client=pipe)
                return await pipe.execute(raise_on_error=not errors_as_replies)
            case ops.ReadFleet(keys=keys):
                return await read_workers_async(client, keys)
            case ops.Subscribe(channel=channel):
                await self.close()
                if self.producer.keys.sharded:  # a shard channel: its slot's node
                    await initialized(client)  # redis-py#4296: a fresh client can't yet
                    self.pubsub = client.pubsub(ignore_subscribe_messages=True)
                    return await self.pubsub.ssubscribe(channel)
                self.pubsub = client.pubsub(ignore_subscribe_messages=True)
                return await self.pubsub.subscribe(channel)
            case ops.Listen(timeout=timeout):
                if self.producer.keys.sharded:
                    message = await self.pubsub.get_sharded_message(
                        ignore_subscribe_messages=True, timeout=timeout
                    )
                else:
                    message = await self.pubsub.get_message(timeout=timeout)
                if message is None:
                    await asyncio.sleep(0)  # let other tasks run between polls
                return message
            case ops.Disconnect(seconds=seconds):
                await self.close()
                await asyncio.sleep(seconds)
                if isinstance(client, AsyncRedisCluster):  # a failover may have moved slots
                    with contextlib.suppress(RedisError, RedisClusterException):
                        await client.nodes_manager.initialize()
                return None
        raise AssertionError(f"{op!r} is not an op this transport carries out")

    async def close(self) -> None:
        if self.pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.pubsub.aclose()
            self.pubsub = None


class AsyncProducer(ProducerCore[aredis.Redis]):
    """`Producer` for asyncio services. See `tokenfleet.producer.Producer` for the rules."""

    async def _run(self, plan: ops.Plan[T]) -> T:
        step = ops.Step(plan)
        emitted = [event async for event in _AsyncRun(self).events(step)]
        assert not emitted, f"{emitted!r}: a plan that emits is carried out by events()"
        return step.value

    async def capacity(self, model: str | None = None) -> int | None:
        """Largest job a live worker for `model` holds (None: no live worker); cached ~1 s."""
        return await self._run(self._capacity_plan(model))

    @classmethod
    def from_url(
        cls, url: str, *, prefix: str | None = None, partitions: int = 1, **kwargs: Any
    ) -> AsyncProducer:
        """A producer on the Redis at `url` (any form `tokenfleet.connect` reads,
        `redis+cluster://` included; hash-tagged keys there), with `partitions` queue
        partitions (as every process of the fleet says); it connects on its first call."""
        keys = Keys(prefix or DEFAULT_PREFIX, partitions, tagged=is_cluster_url(url))
        return cls(connect_async(url), keys=keys, **kwargs)

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
        return self._handle(await self._run(self._submit_plan(request, fields, capacity)))

    async def submit_many(
        self, requests: Iterable[GenerationRequest]
    ) -> list[tuple[str, AsyncJobHandle | None, Exception | None]]:
        """Submit in one round trip: (job id, handle or None, error or None) per job; a
        job no live worker could hold is refused (JobRejected) without being sent, as
        `Producer.submit_many` does."""
        submitted = await self._run(self._submit_many_plan(requests, check_fit=True))
        return [
            (job_id, None if reply is None else self._handle(reply), error)
            for job_id, reply, error in submitted
        ]

    def handle(self, job_id: str) -> AsyncJobHandle:
        return AsyncJobHandle(self, job_id)

    def _handle(self, reply: SubmitReply) -> AsyncJobHandle:
        return AsyncJobHandle(
            self, reply.job_id, entry_id=reply.entry_id, duplicate=reply.duplicate
        )

    async def depth(self, model: str | None = None, band: str = DEFAULT_BAND) -> int:
        return await self._run(self._depth_plan(model, band))

    async def aclose(self) -> None:
        await self.redis.aclose()


class AsyncJobHandle(HandleCore["AsyncProducer"]):
    """`JobHandle` for asyncio: `async for event in handle.stream()`, `await handle.result()`."""

    def stream(self, timeout: float | None = STREAM_IDLE_TIMEOUT_S) -> AsyncIterator[TokenEvent]:
        """`JobHandle.stream`: each token once, in order, across Redis restarts; the same
        `timeout` (300 s of silence unless given, None forever), JobLost, JobTimeout."""
        return _AsyncRun(self.producer).events(ops.Step(self._stream_plan(timeout)))

    async def result(self, timeout: float | None = None) -> JobResult:
        """`JobHandle.result`: the final result, waiting across Redis restarts."""
        return await self.producer._run(self._result_plan(timeout))

    async def cancel(self) -> bool:
        return await self.producer._run(self._cancel_plan())

    async def status(self) -> JobStatus:
        return await self.producer._run(self._status_plan())
