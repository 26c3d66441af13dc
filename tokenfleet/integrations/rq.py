"""Run a fleet generation as an RQ job.

A service that already uses RQ enqueues `generate` on its own queue; the RQ
worker that picks it up submits the request to the fleet (with `Producer`,
through the fleet's Redis), waits for the result and returns it, as a
JSON-safe dict (`JobResult.model_dump(mode="json")`), as the RQ job's result::

    from redis import Redis
    from rq import Queue
    from tokenfleet.integrations.rq import generate

    q = Queue(connection=Redis())
    job = q.enqueue(generate, {"prompt": "Hello", "max_new_tokens": 32}, job_timeout=360)
    ...
    job.return_value()["text"]

The fleet's Redis is `redis_url`, else `$TOKENFLEET_REDIS_URL` / `$REDIS_URL`,
else the Redis the RQ job itself came from, else redis://127.0.0.1:6379/0.
Errors keep their names, so RQ marks the job failed with a clear message in
its exc_info: `InvalidRequest` (bad fields, nothing sent), `QueueFull` (the
fleet's cap is reached: back off), `JobRejected` (the fleet refused it, e.g.
prompt + max_new_tokens beyond the model's context), `JobFailed` (the engine
failed on it), `JobTimeout` (no result within `timeout` seconds).

Limits:

* RQ serialises job arguments and results with pickle by default: whoever can
  enqueue on the RQ queue can run code on the RQ worker. Only trusted
  producers may enqueue. tokenfleet's own wire stays msgpack/JSON; nothing
  here pickles anything.
* An RQ job waits on its fleet job, so one RQ worker process holds one
  generation at a time. For concurrency run several RQ workers, or use
  `Producer` directly (one process can have thousands of jobs in flight).
* RQ's `job_timeout` (default 180 s) kills a job that runs longer; enqueue
  with a `job_timeout` above `timeout`.
* Without a `job_id` in `request_fields`, the fleet job id is `rq-<RQ job
  id>`, so an RQ retry of the same job waits for the same generation instead
  of starting another (the fleet keeps results 24 h).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from tokenfleet.config import Settings
from tokenfleet.connect import connect
from tokenfleet.keys import Keys, valid_job_id
from tokenfleet.producer import Producer


def _current_rq_job() -> Any:
    """The RQ job running this call, or None (outside RQ, or RQ not installed)."""
    try:
        from rq import get_current_job
    except ImportError:
        return None
    return get_current_job()


def generate(
    request_fields: Mapping[str, Any],
    *,
    redis_url: str | None = None,
    prefix: str | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Submit one generation to the fleet, wait for it, return its `JobResult` as a dict.

    `request_fields` are `GenerationRequest` fields (`prompt`, `max_new_tokens`,
    `sampling` as a dict, ...). Raises InvalidRequest, QueueFull, JobRejected,
    JobFailed or JobTimeout (tokenfleet.errors)."""
    settings = Settings()
    rq_job = _current_rq_job()
    fields = dict(request_fields)
    if "job_id" not in fields and rq_job is not None:
        fleet_id = f"rq-{rq_job.id}"
        if valid_job_id(fleet_id):  # RQ allows custom ids tokenfleet does not (':')
            fields["job_id"] = fleet_id

    own_client = True
    if redis_url is None and "redis_url" not in settings.model_fields_set and rq_job is not None:
        client: redis.Redis = rq_job.connection  # the Redis this RQ job came from
        own_client = False
    else:
        client = connect(redis_url or settings.redis_url)
    try:
        producer = Producer(
            client, keys=Keys(prefix or settings.prefix), default_cap=settings.queue_cap
        )
        result = producer.submit(**fields).result(timeout=timeout)
        return result.model_dump(mode="json")
    finally:
        if own_client:
            client.close()
