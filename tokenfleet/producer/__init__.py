"""Client side of the fleet: submit jobs, stream their tokens, wait for results, cancel."""

from tokenfleet.producer.aio import AsyncJobHandle, AsyncProducer
from tokenfleet.producer.client import JobHandle, JobStatus, Producer, SubmitOutcome

__all__ = [
    "AsyncJobHandle",
    "AsyncProducer",
    "JobHandle",
    "JobStatus",
    "Producer",
    "SubmitOutcome",
]
