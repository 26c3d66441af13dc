"""A worker's fenced writes, driven by hand: one tick.lua call, and a job's end."""

from __future__ import annotations

from tokenfleet.protocol import ErrorInfo, FinishEvent, JobResult, Usage
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.queue import Delivery, TickReply, TickVerdict, TickWrite, WorkerQueue


def tick(queue: WorkerQueue, *writes: TickWrite) -> list[TickReply]:
    """One tick carrying `writes`, in a pipeline of its own: the replies, in order."""
    pipe = queue.redis.pipeline(transaction=False)
    queue.tick(list(writes), pipe)
    (reply,) = pipe.execute()
    return queue.parse_tick(reply)


def outcome(
    job_id: str, reason: FinishReason = FinishReason.LENGTH, error: ErrorInfo | None = None
) -> tuple[JobResult, FinishEvent]:
    """A job's terminal pair (3 prompt tokens, none generated)."""
    usage = Usage(prompt_tokens=3, completion_tokens=0)
    result = JobResult(job_id=job_id, finish_reason=reason, usage=usage, error=error)
    return result, FinishEvent(job_id=job_id, reason=reason, usage=usage, error=error)


def finish(queue: WorkerQueue, *held: Delivery) -> list[TickVerdict]:
    """End each held job in one tick with no new events, its terminal pair
    `outcome(job_id)`: the verdict of each (DONE where this worker ended it)."""
    writes = []
    for d in held:
        assert d.job_id is not None, d
        writes.append(TickWrite(d, d.job_id, [], outcome(d.job_id)))
    return [reply.verdict for reply in tick(queue, *writes)]
