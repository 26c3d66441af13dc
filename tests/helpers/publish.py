"""Writing a job's events to Redis without the worker's fence: the replay stream plus
the live channel, as a client sees them.

Workers never use this (they write through tick.lua, owner-checked); tests and
benchmarks use it to play a job's events to a client. An event is appended to
the job's replay stream first, then announced on its channel.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.keys import EVENTS_MAXLEN, EVENTS_TTL_S, RESULT_TTL_S, Keys
from tokenfleet.protocol import FinishEvent, JobResult, TokenEvent, encode


def queue_event(pipe: Any, keys: Keys, event: TokenEvent | FinishEvent) -> None:
    """Append `event` to its job's replay stream and publish it (on `pipe`, not executed)."""
    data = encode(event)
    stream = keys.events(event.job_id)
    # Trimming is safe here: it bounds a replay log that holds at most MAX_NEW_TOKENS + 1.
    pipe.xadd(stream, {"m": data}, maxlen=EVENTS_MAXLEN, approximate=True)
    if not isinstance(event, TokenEvent) or event.index == 0:
        # The TTL is set by the first event and set again by the finish, as tick.lua does:
        # refreshing it on every token would cost a third of a tick's commands.
        pipe.expire(stream, EVENTS_TTL_S)
    pipe.publish(keys.channel(event.job_id), data)


def queue_result(pipe: Any, keys: Keys, result: JobResult) -> None:
    """Store the final result with its TTL and mark the job finished (on `pipe`)."""
    pipe.set(keys.result(result.job_id), encode(result), ex=RESULT_TTL_S)
    pipe.hset(
        keys.job(result.job_id),
        mapping={"status": "finished", "finish_reason": str(result.finish_reason)},
    )
