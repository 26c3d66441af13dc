"""Client side of the fleet: submit jobs, stream their tokens, wait for results, cancel.

Every call is written once, sans I/O, in `core` (its plans), `common` (requests and
replies) and `follow` (following a job across Redis restarts); `client` carries the
plans out on redis-py and `aio` on redis.asyncio (see `ops`)."""

from tokenfleet.producer.aio import AsyncJobHandle, AsyncProducer
from tokenfleet.producer.client import JobHandle, Producer, SubmitOutcome
from tokenfleet.producer.common import JobStatus

__all__ = [
    "AsyncJobHandle",
    "AsyncProducer",
    "JobHandle",
    "JobStatus",
    "Producer",
    "SubmitOutcome",
]
