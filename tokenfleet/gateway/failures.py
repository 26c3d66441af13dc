"""How the failures of following a job read to the client, whichever path follows it
(one job: `service.Gateway.serve`; several choices: `fanout`)."""

from __future__ import annotations

from redis.exceptions import RedisError

from tokenfleet.errors import JobLost
from tokenfleet.openai.errors import ApiError
from tokenfleet.redis_errors import RedisFault, fault_of

CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never sent


def job_lost(exc: JobLost) -> ApiError:
    return ApiError(503, str(exc), type="server_error", code="job_lost")


def redis_down(exc: RedisError) -> ApiError:
    """A Redis failure as the client should see it: refused credentials or a missing ACL
    permission are the operator's to fix (500, named), not an outage to retry (503)."""
    fault = fault_of(exc)
    if fault is not None and fault.refused:
        return ApiError(
            500,
            f"the gateway's Redis user was refused: {exc}"
            " (see docs/operations.md, 'Least privilege')",
            type="server_error",
            code="redis_forbidden",
        )
    if fault is RedisFault.OOM:
        return ApiError(
            503,
            f"the fleet's Redis is out of memory: {exc}",
            type="server_error",
            code="redis_out_of_memory",
        )
    return ApiError(
        503,
        f"the fleet's Redis is unavailable: {exc}",
        type="server_error",
        code="redis_unavailable",
    )
