"""What a Redis error means, said once for the worker, the producer and the gateway.

`fault_of` names the fault; each caller decides what to do with it:

    CREDENTIALS    refused credentials: a wrong password or user (WRONGPASS, NOAUTH), a
                   TLS certificate the OCSP check refused
    PERMISSION     a missing ACL permission: NOPERM, or a script's call refused
    CONNECTION     the connection was lost, refused or timed out, or Redis is still
                   loading its data (redis-py makes LOADING a ConnectionError)
    OOM            Redis is out of memory (maxmemory with noeviction refuses writes)
    MISSING_GROUP  a jobs stream or its consumer group does not exist (NOGROUP, "no
                   such key"): Redis restarted empty, or no worker has created it yet
    None           anything else: a bug, to surface

Refused credentials and permissions never pass by themselves, so nobody retries them:
retrying would only hide them. What the callers do with the rest:

    worker loop    waits out CONNECTION and OOM, keeping every job it holds
                   (`classify_redis_error`), creates the group again on MISSING_GROUP,
                   stops with `RedisAccessError` naming what is missing on the refusals
    producer       reconnects on CONNECTION alone (`producer/follow.py`); everything
                   else reaches the caller
    gateway        refusals are a 500 `redis_forbidden`, OOM a 503
                   `redis_out_of_memory`, anything else a 503 `redis_unavailable`
                   (`gateway.service.redis_down`)
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

import redis
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    TryAgainError,
)

from tokenfleet.errors import TokenfleetError


class RedisFault(StrEnum):
    CREDENTIALS = "credentials"
    PERMISSION = "permission"
    CONNECTION = "connection"
    OOM = "oom"
    MISSING_GROUP = "missing_group"

    @property
    def refused(self) -> bool:
        """Redis refused who we are or what we asked: an operator's fix, never retried."""
        return self in (RedisFault.CREDENTIALS, RedisFault.PERMISSION)


# Errors Redis answers as text that may reach us unparsed (a pipeline's or a script's).
_CREDENTIALS_REFUSED = ("WRONGPASS", "NOAUTH")
_SCRIPT_DENIED = "can't run this command"  # "... or subcommand": a script's call, by ACL
_MISSING_GROUP = ("NOGROUP", "no such key")
# a Redis Cluster between two shapes: a failover or a resharding under way (redis-py
# raises ClusterDownError, TryAgainError, MasterDownError... with the server's message;
# its own retries over, the message may be the bare reason)
_CLUSTER_IN_FLUX = ("CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "MOVED ", "ASK ")


def fault_of(exc: BaseException) -> RedisFault | None:
    """What `exc` (a Redis error, or any other exception) means; None: nothing known."""
    if not isinstance(exc, redis.RedisError):
        return None
    message = str(exc)
    if isinstance(exc, AuthenticationError | AuthorizationError) or message.startswith(
        _CREDENTIALS_REFUSED
    ):
        return RedisFault.CREDENTIALS  # before CONNECTION: redis-py makes these ConnectionErrors
    if isinstance(exc, NoPermissionError) or _SCRIPT_DENIED in message:
        return RedisFault.PERMISSION
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return RedisFault.CONNECTION
    if isinstance(exc, ClusterError | TryAgainError | AskError) or message.startswith(
        _CLUSTER_IN_FLUX
    ):
        return RedisFault.CONNECTION  # a cluster failing over or moving slots: it passes
    if isinstance(exc, OutOfMemoryError) or message.startswith("OOM"):
        return RedisFault.OOM
    if isinstance(exc, redis.ResponseError) and message.startswith(_MISSING_GROUP):
        return RedisFault.MISSING_GROUP
    return None


def is_missing_group(exc: BaseException) -> bool:
    """The jobs stream or its consumer group does not exist (e.g. Redis restarted empty)."""
    return fault_of(exc) is RedisFault.MISSING_GROUP


# ---- the worker -------------------------------------------------------------------------

Transient = Literal["connection", "oom"]


class RedisAccessError(TokenfleetError):
    """Redis refused this worker's credentials or one of the commands it needs."""


def classify_redis_error(exc: redis.RedisError) -> Transient | None:
    """The worker's rule: 'connection' or 'oom' for errors to wait out, None for any
    other error (a bug: let it surface); raises `RedisAccessError` for refused
    credentials or permissions."""
    fault = fault_of(exc)
    if fault is RedisFault.CREDENTIALS:
        raise RedisAccessError(
            f"redis refused the worker's credentials ({exc}): check the user and password"
            " in --redis-url / REDIS_URL"
        ) from exc
    if fault is RedisFault.PERMISSION:
        raise RedisAccessError(
            f"the worker's redis user lacks a permission it needs: {exc}"
            " (see docs/operations.md, 'Least privilege')"
        ) from exc
    if fault is RedisFault.CONNECTION:
        return "connection"
    if fault is RedisFault.OOM:
        return "oom"
    return None
