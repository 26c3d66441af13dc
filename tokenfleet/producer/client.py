"""The producer client: submit jobs to the fleet and follow them (sync, redis-py).

What each call sends and decides is `producer.core`; this module carries it out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from tokenfleet.connect import connect, is_cluster_url
from tokenfleet.errors import NotReplicated
from tokenfleet.fleet import read_workers
from tokenfleet.keys import DEFAULT_BAND, DEFAULT_PREFIX, Keys
from tokenfleet.producer import ops
from tokenfleet.producer.common import JobStatus, SubmitReply
from tokenfleet.producer.core import HandleCore, ProducerCore
from tokenfleet.producer.durable import submit_waiting
from tokenfleet.producer.follow import STREAM_IDLE_TIMEOUT_S
from tokenfleet.protocol import GenerationRequest, JobResult, TokenEvent

T = TypeVar("T")


@dataclass
class _Run:
    """Carries out one plan on redis-py (see `producer.ops`). The plan's subscription,
    while it has one, lives here."""

    producer: Producer
    pubsub: Any = None

    def events(self, step: ops.Step[Any]) -> Iterator[TokenEvent]:
        """What the plan emits, as it runs."""
        try:
            for op in step:
                if isinstance(op, ops.Emit):
                    yield op.event
                else:
                    step.settle(self.do, op)
        finally:
            step.close()
            self.close()

    def do(self, op: ops.Op) -> Any:
        client = self.producer.redis
        match op:
            case ops.Command(args=args):
                return client.execute_command(*args)
            case ops.Submit(keys=keys, args=args, wait=wait) if wait is not None:
                return submit_waiting(client, keys, args, wait)
            case ops.Submit(keys=keys, args=args):
                return self.producer._submit_script(keys=keys, args=args)
            case ops.Batch(commands=commands, errors_as_replies=errors_as_replies) if any(
                isinstance(item, ops.Submit) and (item.wait or isinstance(client, RedisCluster))
                for item in commands
            ):
                # a cluster pipeline refuses script calls (redis-py#2914), and a durable
                # submit waits on its own connection: one call each
                replies: list[Any] = []
                for item in commands:
                    try:
                        replies.append(self.do(item))
                    except (redis.ResponseError, NotReplicated) as exc:
                        if not errors_as_replies:
                            raise
                        replies.append(exc)
                return replies
            case ops.Batch(commands=commands, errors_as_replies=errors_as_replies):
                pipe = client.pipeline(transaction=False)
                for item in commands:
                    if isinstance(item, ops.Submit):
                        self.producer._submit_script(keys=item.keys, args=item.args, client=pipe)
                    else:
                        pipe.execute_command(*item.args)
                return pipe.execute(raise_on_error=not errors_as_replies)
            case ops.ReadFleet(keys=keys):
                return read_workers(client, keys)
            case ops.Subscribe(channel=channel):
                self.close()
                self.pubsub = client.pubsub(ignore_subscribe_messages=True)
                if self.producer.keys.sharded:  # a shard channel: its slot's node
                    return self.pubsub.ssubscribe(channel)
                return self.pubsub.subscribe(channel)
            case ops.Listen(timeout=timeout):
                if self.producer.keys.sharded:
                    return self.pubsub.get_sharded_message(
                        ignore_subscribe_messages=True, timeout=timeout
                    )
                return self.pubsub.get_message(timeout=timeout)
            case ops.Disconnect(seconds=seconds):
                self.close()
                time.sleep(seconds)
                if isinstance(client, RedisCluster):  # a failover may have moved slots
                    with contextlib.suppress(redis.RedisError, RedisClusterException):
                        client.nodes_manager.initialize()
                return None
        raise AssertionError(f"{op!r} is not an op this transport carries out")

    def close(self) -> None:
        """Close the subscription, whose connection may already be broken."""
        if self.pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                self.pubsub.close()
            self.pubsub = None


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


class Producer(ProducerCore[redis.Redis]):
    """Submits jobs to a fleet's bounded jobs stream.

    `submit` is one atomic script call: an id accepted before returns its
    existing job, a full stream raises `QueueFull` at once, otherwise the job
    is added. Bad input raises `InvalidRequest` before anything is sent.
    """

    @classmethod
    def from_url(
        cls, url: str, *, prefix: str | None = None, partitions: int = 1, **kwargs: Any
    ) -> Producer:
        """A producer on the Redis at `url` (any form `tokenfleet.connect` reads,
        `redis+cluster://` included; hash-tagged keys there), with `partitions` queue
        partitions (as every process of the fleet says)."""
        keys = Keys(prefix or DEFAULT_PREFIX, partitions, tagged=is_cluster_url(url))
        return cls(connect(url), keys=keys, **kwargs)

    def _run(self, plan: ops.Plan[T]) -> T:
        step = ops.Step(plan)
        emitted = list(_Run(self).events(step))
        assert not emitted, f"{emitted!r}: a plan that emits is carried out by _Run.events"
        return step.value

    def capacity(self, model: str | None = None) -> int | None:
        """Largest job (prompt + max_new_tokens) a live worker for `model` holds; cached ~1 s."""
        return self._run(self._capacity_plan(model))

    def submit(self, request: GenerationRequest | None = None, /, **fields: Any) -> JobHandle:
        """Submit one job. Raises InvalidRequest, QueueFull, or JobRejected when no live
        worker could ever hold it."""
        return self._handle(self._run(self._submit_plan(request, fields)))

    def submit_many(self, requests: Iterable[GenerationRequest]) -> list[SubmitOutcome]:
        """Submit many jobs in one round trip; each gets its own outcome, in order."""
        return [
            SubmitOutcome(job_id, None, error=error)
            if reply is None
            else SubmitOutcome(job_id, self._handle(reply), duplicate=reply.duplicate)
            for job_id, reply, error in self._run(self._submit_many_plan(requests, check_fit=True))
        ]

    def handle(self, job_id: str) -> JobHandle:
        """A handle on a job submitted earlier (by anyone)."""
        return JobHandle(self, job_id)

    def _handle(self, reply: SubmitReply) -> JobHandle:
        return JobHandle(self, reply.job_id, entry_id=reply.entry_id, duplicate=reply.duplicate)

    def set_queue_cap(self, cap: int, model: str | None = None) -> None:
        if cap < 1:
            raise ValueError("queue cap must be at least 1")
        for p in self.keys.partitions_all:  # each partition's copy: submit.lua reads its own
            self.redis.set(self.keys.queue_cap(model, p), cap)

    def queue_cap(self, model: str | None = None) -> int:
        value = self.redis.get(self.keys.queue_cap(model))
        return int(value) if value is not None else self.default_cap

    def depth(self, model: str | None = None, band: str = DEFAULT_BAND) -> int:
        """Accepted, unfinished jobs of one priority band: XLEN of its jobs stream."""
        return self._run(self._depth_plan(model, band))


class JobHandle(HandleCore["Producer"]):
    """Follow one job: its tokens in order, its result, its status; cancel it."""

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
        return _Run(self.producer).events(ops.Step(self._stream_plan(timeout)))

    def result(self, timeout: float | None = None) -> JobResult:
        """The job's final result; raises JobRejected / JobFailed / JobTimeout, JobLost when
        its state vanished from Redis, JobNotFound for an unknown id.

        `timeout` bounds the whole wait (None: forever). Lost connections are retried
        with backoff until it passes (then the last ConnectionError is raised)."""
        return self.producer._run(self._result_plan(timeout))

    def cancel(self) -> bool:
        """Ask the fleet to stop this job (within one tick wherever it runs).

        Returns False when the job is unknown or already finished."""
        return self.producer._run(self._cancel_plan())

    def status(self) -> JobStatus:
        return self.producer._run(self._status_plan())
