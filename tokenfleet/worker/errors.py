"""How the worker loop tells Redis errors apart: wait them out, or stop with a reason.

A lost connection, a Redis still loading its data and a Redis out of memory
(maxmemory with noeviction refuses writes) all pass: the loop backs off and keeps
every job it holds. Refused credentials and missing ACL permissions never pass by
themselves, so retrying would only hide them: the worker stops with a message
that names what is missing.
"""

from __future__ import annotations

from typing import Literal

import redis
from redis.exceptions import NoPermissionError, OutOfMemoryError

from tokenfleet.errors import TokenfleetError

Transient = Literal["connection", "oom"]


class RedisAccessError(TokenfleetError):
    """Redis refused this worker's credentials or one of the commands it needs."""


_SCRIPT_DENIED = "can't run this command or subcommand"


def classify_redis_error(exc: redis.RedisError) -> Transient | None:
    """'connection' or 'oom' for errors to wait out, None for any other error (a bug:
    let it surface); raises `RedisAccessError` for refused credentials or permissions."""
    message = str(exc)
    if isinstance(exc, redis.AuthenticationError) or message.startswith(("WRONGPASS", "NOAUTH")):
        raise RedisAccessError(
            f"redis refused the worker's credentials ({message}): check the user and password"
            " in --redis-url / REDIS_URL"
        ) from exc
    if isinstance(exc, NoPermissionError) or _SCRIPT_DENIED in message:
        raise RedisAccessError(
            f"the worker's redis user lacks a permission it needs: {message}"
            " (see docs/operations.md, 'Least privilege')"
        ) from exc
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return "connection"
    if isinstance(exc, OutOfMemoryError) or message.startswith("OOM"):
        return "oom"
    return None
