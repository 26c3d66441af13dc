"""Every producer call, written once as a plan (see `producer.ops`). `Producer` and
`AsyncProducer` inherit `ProducerCore`, their handles `HandleCore`; the subclasses
only carry the plans out, on redis-py or on redis.asyncio."""

from __future__ import annotations

import time
from collections.abc import Iterable
from types import EllipsisType
from typing import Any, Generic, NamedTuple, TypeVar

import redis
import redis.asyncio as aredis

from tokenfleet.errors import JobRejected, NotReplicated, QueueFull
from tokenfleet.fleet import FleetCache, FleetView
from tokenfleet.keys import CANCEL_TTL_S, DEFAULT_QUEUE_CAP, Keys
from tokenfleet.lua import SUBMIT_LUA
from tokenfleet.producer.common import (
    CAPACITY_TTL_S,
    JobStatus,
    SubmitReply,
    build_request,
    check_fleet_fits,
    encode_request,
    parse_status,
    parse_submit_reply,
    submit_call,
)
from tokenfleet.producer.follow import JobFollower, ResultWait, follow_stream, wait_result
from tokenfleet.producer.ops import Batch, Command, Plan, ReadFleet, Submit
from tokenfleet.protocol import FinishEvent, GenerationRequest, JobResult


class Submitted(NamedTuple):
    """One job's outcome in a batch submit: the script's reply, or the error that refused it."""

    job_id: str
    reply: SubmitReply | None
    error: Exception | None


C = TypeVar("C", redis.Redis, aredis.Redis)  # the client: sync or asyncio


class ProducerCore(Generic[C]):
    """A producer's client, keys and default queue cap, the fleet's capacity as last read
    (trusted CAPACITY_TTL_S), and its calls as plans."""

    def __init__(
        self,
        client: C,
        *,
        keys: Keys | None = None,
        default_cap: int = DEFAULT_QUEUE_CAP,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.redis = client
        self.keys = keys or Keys()
        self.default_cap = default_cap
        # durable submits (failover): each submit waits for this many replicas, or
        # raises NotReplicated (tokenfleet/producer/durable.py); 0: off
        self.wait = (wait_replicas, wait_timeout_ms) if wait_replicas > 0 else None
        self._submit_script = client.register_script(SUBMIT_LUA)
        self._fleet = FleetCache(CAPACITY_TTL_S)

    def _capacity_plan(self, model: str | None) -> Plan[int | None]:
        now = time.monotonic()
        view = self._fleet.get(now)
        if view is None:
            view = self._fleet.put(now, FleetView((yield ReadFleet(self.keys))))
        return view.capacity(model)

    def _submit_op(self, request: GenerationRequest) -> Submit:
        call = submit_call(self.keys, request, encode_request(request), self.default_cap)
        return Submit(call.keys(), call.args(), self.wait)

    def _submit_plan(
        self,
        request: GenerationRequest | None,
        fields: dict[str, Any],
        capacity: int | EllipsisType | None = ...,
    ) -> Plan[SubmitReply]:
        """Validate, refuse what no live worker could hold (`capacity`: ... reads it from
        the fleet), then one submit.lua call."""
        req = build_request(request, fields)
        known = (yield from self._capacity_plan(req.model)) if capacity is ... else capacity
        check_fleet_fits(req, known)
        return parse_submit_reply(self.keys, req, (yield self._submit_op(req)))

    def _submit_many_plan(
        self, requests: Iterable[GenerationRequest], *, check_fit: bool
    ) -> Plan[list[Submitted]]:
        """One pipelined round trip of submit.lua calls; an outcome per job, in order.
        With `check_fit`, a job no live worker could hold is refused without being sent."""
        reqs = list(requests)
        outcomes: dict[int, Submitted] = {}
        sent: list[int] = []
        for i, req in enumerate(reqs):
            if check_fit:
                try:
                    check_fleet_fits(req, (yield from self._capacity_plan(req.model)))
                except JobRejected as exc:
                    outcomes[i] = Submitted(req.job_id, None, exc)
                    continue
            sent.append(i)
        calls = tuple(self._submit_op(reqs[i]) for i in sent)
        replies = (yield Batch(calls, errors_as_replies=True)) if calls else []
        for i, reply in zip(sent, replies, strict=True):
            outcomes[i] = self._submitted(reqs[i], reply)
        return [outcomes[i] for i in range(len(reqs))]

    def _submitted(self, request: GenerationRequest, reply: Any) -> Submitted:
        try:
            if isinstance(reply, Exception):
                raise reply
            return Submitted(request.job_id, parse_submit_reply(self.keys, request, reply), None)
        except (QueueFull, NotReplicated, redis.RedisError) as exc:
            return Submitted(request.job_id, None, exc)

    def _depth_plan(self, model: str | None, band: str) -> Plan[int]:
        """Accepted, unfinished jobs of one band: XLEN of its jobs stream (the sum over
        the queue's partitions)."""
        total = 0
        for p in self.keys.partitions_all:
            total += int((yield Command("XLEN", self.keys.jobs(model, band, p))))
        return total


P = TypeVar("P", bound=ProducerCore[Any])


class HandleCore(Generic[P]):
    """One job as a handle knows it, and its calls as plans. `_known`: the job was seen
    to exist (submitted here, or a read found it), so if its state then vanishes,
    following it raises JobLost rather than JobNotFound."""

    def __init__(
        self, producer: P, job_id: str, *, entry_id: str = "", duplicate: bool = False
    ) -> None:
        self.producer = producer
        self.id = job_id
        self.entry_id = entry_id
        self.duplicate = duplicate
        self.finish: FinishEvent | None = None
        self._known = bool(entry_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def _stream_plan(self, timeout: float | None) -> Plan[None]:
        follow = JobFollower(self.id, timeout, known=self._known)
        try:
            self.finish = yield from follow_stream(follow, self.producer.keys)
        finally:
            self._known = follow.known

    def _result_plan(self, timeout: float | None) -> Plan[JobResult]:
        wait = ResultWait(self.id, timeout, known=self._known)
        try:
            return (yield from wait_result(wait, self.producer.keys))
        finally:
            self._known = wait.known

    def _cancel_plan(self) -> Plan[bool]:
        keys = self.producer.keys
        state = yield Command("HGET", keys.job(self.id), "status")
        if state is None or state == b"finished":
            return False
        yield Command("SET", keys.cancel(self.id), 1, "EX", CANCEL_TTL_S)
        return True

    def _status_plan(self) -> Plan[JobStatus]:
        return parse_status(self.id, (yield Command("HGETALL", self.producer.keys.job(self.id))))
