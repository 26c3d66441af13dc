"""What a Redis error means (tokenfleet.redis_errors) and what each caller does with it:
the worker's rule, the producer's reconnects, the gateway's status codes. The errors are
built as redis-py raises them; test_acl.py and test_worker_faults.py meet the real ones."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)

from tokenfleet.backoff import Backoff
from tokenfleet.gateway.service import redis_down
from tokenfleet.producer.follow import reconnect_pause
from tokenfleet.redis_errors import (
    RedisAccessError,
    RedisFault,
    classify_redis_error,
    fault_of,
    is_missing_group,
)

CREDENTIALS, PERMISSION, CONNECTION, OOM, MISSING = (
    RedisFault.CREDENTIALS,
    RedisFault.PERMISSION,
    RedisFault.CONNECTION,
    RedisFault.OOM,
    RedisFault.MISSING_GROUP,
)
SCRIPT_DENIED = (
    "Error running script (call to f_1): @user_script:3: The user executing the script"
    " can't run this command or subcommand script: 1, on @user_script:3."
)
MAXMEMORY = "command not allowed when used memory > 'maxmemory'."
CASES: list[tuple[Exception, RedisFault | None]] = [
    (AuthenticationError("invalid username-password pair"), CREDENTIALS),
    (redis.ConnectionError("WRONGPASS invalid username-password pair"), CREDENTIALS),
    (ResponseError("NOAUTH Authentication required."), CREDENTIALS),
    (AuthorizationError("you are not authorized to view this ocsp certificate"), CREDENTIALS),
    (NoPermissionError("this user has no permissions to run the 'xadd' command"), PERMISSION),
    (ResponseError(SCRIPT_DENIED), PERMISSION),
    (redis.ConnectionError("Connection refused"), CONNECTION),
    (redis.TimeoutError("Timeout reading from socket"), CONNECTION),
    (BusyLoadingError("Redis is loading the dataset in memory"), CONNECTION),
    (OutOfMemoryError(MAXMEMORY), OOM),
    (ResponseError(f"OOM {MAXMEMORY}"), OOM),
    (ResponseError("NOGROUP No such key 'tf:jobs:default' or consumer group 'workers'"), MISSING),
    (ResponseError("no such key"), MISSING),
    (ReadOnlyError("You can't write against a read only replica."), None),
    (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), None),
    (ValueError("NOGROUP, but not from Redis"), None),
]
IDS = [f"{type(exc).__name__}: {exc}"[:60] for exc, _ in CASES]
REDIS_CASES = [case for case in CASES if isinstance(case[0], redis.RedisError)]
REDIS_IDS = [f"{type(exc).__name__}: {exc}"[:60] for exc, _ in REDIS_CASES]


@pytest.mark.parametrize(("exc", "fault"), CASES, ids=IDS)
def test_each_error_has_one_meaning(exc: Exception, fault: RedisFault | None) -> None:
    assert fault_of(exc) is fault
    assert is_missing_group(exc) == (fault is RedisFault.MISSING_GROUP)


@pytest.mark.parametrize(("exc", "fault"), REDIS_CASES, ids=REDIS_IDS)
def test_the_worker_waits_out_connection_and_oom_and_stops_on_refusals(
    exc: Exception, fault: RedisFault | None
) -> None:
    if fault is not None and fault.refused:
        with pytest.raises(RedisAccessError) as caught:
            classify_redis_error(exc)
        named = "credentials" if fault is RedisFault.CREDENTIALS else "lacks a permission"
        assert named in str(caught.value) and caught.value.__cause__ is exc
    else:
        waits = {RedisFault.CONNECTION: "connection", RedisFault.OOM: "oom"}
        assert classify_redis_error(exc) == (waits.get(fault) if fault else None)


@pytest.mark.parametrize(("exc", "fault"), REDIS_CASES, ids=REDIS_IDS)
def test_the_gateway_names_refusals_and_out_of_memory(
    exc: Exception, fault: RedisFault | None
) -> None:
    error = redis_down(exc)
    if fault is not None and fault.refused:
        assert (error.status, error.detail.code) == (500, "redis_forbidden")
    elif fault is RedisFault.OOM:
        assert (error.status, error.detail.code) == (503, "redis_out_of_memory")
    else:
        assert (error.status, error.detail.code) == (503, "redis_unavailable")


@pytest.mark.parametrize(("exc", "fault"), REDIS_CASES, ids=REDIS_IDS)
def test_the_producer_reconnects_only_after_a_lost_connection(
    exc: Exception, fault: RedisFault | None
) -> None:
    backoff = Backoff(first_s=0.05, max_s=1.0, jitter=0.0)
    if fault is RedisFault.CONNECTION:
        assert reconnect_pause(backoff, exc, "j", now=0.0) == 0.05
    else:
        with pytest.raises(type(exc)) as caught:
            reconnect_pause(backoff, exc, "j", now=0.0)
        assert caught.value is exc and backoff.since is None


def test_the_producer_gives_up_once_the_outage_is_over_its_bound() -> None:
    backoff = Backoff(first_s=0.05, max_s=1.0, jitter=0.0, limit_s=2.0)
    lost = redis.ConnectionError("Connection refused")
    assert reconnect_pause(backoff, lost, "j", now=10.0) == 0.05
    with pytest.raises(redis.ConnectionError) as caught:
        reconnect_pause(backoff, lost, "j", now=12.0)
    assert caught.value.__notes__ == [
        "tokenfleet: gave up following job j after 2.0s without Redis"
    ]
