"""Tenant limits and usage (tokenfleet.tenants), `tokenfleet tenants`, and the gateway's
fleet-wide gauges, against a real redis-server. The sets and hashes are written here
directly, as the scripts would: nothing depends on workers or on submit.lua."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aredis

from tests.helpers.gateway import ServedGateway
from tests.helpers.reads import tenant_usage
from tests.helpers.support import KEYS, run_cli
from tokenfleet.gateway import GatewayConfig
from tokenfleet.gateway.metrics import GatewayMetrics
from tokenfleet.local import free_port
from tokenfleet.tenants import (
    TenantLimits,
    TenantUsage,
    get_limits,
    read_tenants,
    set_limits,
)


def queue(r: redis.Redis, tenant: str, model: str, *jobs: str, running: bool = False) -> None:
    """What the scripts write: the job ids in the tenant's queued (or running) set of the
    model, and the tenant in the set of tenant names."""
    key = KEYS.tenant_running(tenant, model) if running else KEYS.tenant_queued(tenant, model)
    r.zadd(key, dict.fromkeys(jobs, 1.0))
    r.sadd(KEYS.tenants(), tenant)


# --- limits ---------------------------------------------------------------------------


def test_limits_are_set_per_field_and_fall_back_to_the_defaults_per_field(
    r: redis.Redis,
) -> None:
    assert get_limits(r, KEYS, "acme") == TenantLimits(None, None)  # nothing set anywhere

    assert set_limits(r, KEYS, "acme", queued_share=0.5) == TenantLimits(0.5, None)
    assert r.hgetall(KEYS.tenant_limits("acme")) == {b"queued_share": b"0.5"}
    assert r.smembers(KEYS.tenants()) == {b"acme"}  # listed before its first job

    assert set_limits(r, KEYS, None, max_running=4, queued_share=0.25) == TenantLimits(0.25, 4)
    assert r.hgetall("tokenfleet:tenant:*:limits") == {
        b"queued_share": b"0.25",
        b"max_running": b"4",
    }
    assert r.smembers(KEYS.tenants()) == {b"acme"}  # '*' is no tenant
    assert get_limits(r, KEYS, "acme") == TenantLimits(0.5, 4)  # own share, default running
    assert get_limits(r, KEYS, "other") == TenantLimits(0.25, 4)  # no hash of its own
    assert get_limits(r, KEYS, None) == TenantLimits(0.25, 4)

    # a field not given stays as it is
    assert set_limits(r, KEYS, "acme", max_running=1) == TenantLimits(0.5, 1)
    assert get_limits(r, KEYS, "acme") == TenantLimits(0.5, 1)

    # clear: the tenant's hash goes, with a field: only that field is left
    assert set_limits(r, KEYS, "acme", clear=True, max_running=2) == TenantLimits(None, 2)
    assert r.hgetall(KEYS.tenant_limits("acme")) == {b"max_running": b"2"}
    assert get_limits(r, KEYS, "acme") == TenantLimits(0.25, 2)
    assert set_limits(r, KEYS, "acme", clear=True) == TenantLimits(None, None)
    assert not r.exists(KEYS.tenant_limits("acme"))
    assert get_limits(r, KEYS, "acme") == TenantLimits(0.25, 4)
    set_limits(r, KEYS, None, clear=True)
    assert not r.exists(KEYS.tenant_limits(None))
    assert get_limits(r, KEYS, "acme") == TenantLimits(None, None)


def test_values_the_scripts_cannot_read_as_numbers_count_as_unset(r: redis.Redis) -> None:
    r.hset(KEYS.tenant_limits("acme"), mapping={"queued_share": "lots", "max_running": "2.5"})
    r.hset(KEYS.tenant_limits(None), mapping={"queued_share": "0.1", "max_running": "x"})
    # the share falls back to '*'; the script waits while running >= 2.5, i.e. at 3
    assert get_limits(r, KEYS, "acme") == TenantLimits(0.1, 3)
    assert get_limits(r, KEYS, "other") == TenantLimits(0.1, None)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"queued_share": 0.0}, "queued_share must be a number in (0, 1]"),
        ({"queued_share": -0.5}, "queued_share must be a number in (0, 1]"),
        ({"queued_share": 1.5}, "queued_share must be a number in (0, 1]"),
        ({"queued_share": math.nan}, "queued_share must be a number in (0, 1]"),
        ({"queued_share": math.inf}, "queued_share must be a number in (0, 1]"),
        ({"queued_share": True}, "queued_share must be a number in (0, 1]"),
        ({"max_running": 0}, "max_running must be an integer ≥ 1"),
        ({"max_running": -3}, "max_running must be an integer ≥ 1"),
        ({"max_running": 1.5}, "max_running must be an integer ≥ 1"),
        ({"max_running": True}, "max_running must be an integer ≥ 1"),
        ({"max_running": 2, "queued_share": 2.0}, "queued_share must be"),
        ({}, "nothing to set"),
    ],
)
def test_out_of_range_limits_are_refused_and_nothing_is_written(
    r: redis.Redis, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        set_limits(r, KEYS, "acme", **fields)
    assert r.keys("*") == []


@pytest.mark.parametrize("name", ["", "a b", "a:b", "*x", "x" * 65])
def test_an_invalid_tenant_name_is_refused(r: redis.Redis, name: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant"):
        set_limits(r, KEYS, name, max_running=1)
    assert r.keys("*") == []


def test_the_queued_limit_is_the_share_of_the_cap_rounded_down_and_at_least_one() -> None:
    assert TenantLimits(0.5).queued_limit(1000) == 500
    assert TenantLimits(0.3).queued_limit(10) == 3
    assert TenantLimits(0.001).queued_limit(10) == 1
    assert TenantLimits(1.0).queued_limit(7) == 7
    assert TenantLimits(None, 3).queued_limit(1000) is None


# --- usage ----------------------------------------------------------------------------


def test_usage_counts_each_tenants_queued_and_running_jobs_per_model(r: redis.Redis) -> None:
    assert tenant_usage(r, KEYS) == {}
    queue(r, "acme", "default", "a1", "a2", "a3")
    queue(r, "acme", "default", "a4", running=True)
    queue(r, "acme", "other", "a5")
    queue(r, "beta", "default", "b1", "b2", running=True)
    queue(r, "default", "other", "d1")
    r.sadd(KEYS.tenants(), "not a name")  # not what submit.lua writes: skipped

    assert tenant_usage(r, KEYS) == {
        "acme": TenantUsage(queued=3, running=1),
        "beta": TenantUsage(queued=0, running=2),
        "default": TenantUsage(queued=0, running=0),
    }
    assert tenant_usage(r, KEYS, "other") == {
        "acme": TenantUsage(queued=1, running=0),
        "beta": TenantUsage(),
        "default": TenantUsage(queued=1, running=0),
    }
    tenants = read_tenants(r, KEYS, ["default", "other", "never"]).tenants
    assert {name: view.usage["never"] for name, view in tenants.items()} == dict.fromkeys(
        ("acme", "beta", "default"), TenantUsage()
    )
    assert tenants["acme"].usage["default"] == TenantUsage(3, 1)

    # the same job id counted twice is counted once (sorted sets)
    queue(r, "acme", "default", "a1")
    assert tenant_usage(r, KEYS)["acme"] == TenantUsage(queued=3, running=1)


def test_the_report_is_notable_only_beyond_the_default_tenant_without_limits(
    r: redis.Redis,
) -> None:
    assert not read_tenants(r, KEYS, ["default"]).notable
    queue(r, "default", "default", "d1")
    report = read_tenants(r, KEYS, ["default"])
    assert not report.notable
    assert report.tenants["default"].usage == {"default": TenantUsage(queued=1)}

    set_limits(r, KEYS, None, max_running=2)
    report = read_tenants(r, KEYS, ["default"])
    assert report.notable
    assert report.defaults == TenantLimits(None, 2)
    assert report.tenants["default"].own == TenantLimits()
    assert report.tenants["default"].limits == TenantLimits(None, 2)

    set_limits(r, KEYS, None, clear=True)
    queue(r, "acme", "default", "a1")
    assert read_tenants(r, KEYS, ["default"]).notable


# --- the command line -----------------------------------------------------------------


def test_tenants_set_and_list_from_the_command_line(r: redis.Redis, redis_url: str) -> None:
    url = ["--redis-url", redis_url]
    done = run_cli("tenants", "set", "acme", "--queued-share", "0.5", *url)
    assert done.returncode == 0, done.stderr
    assert "tokenfleet:tenant:acme:limits: queued_share 0.5, max_running -" in done.stdout
    done = run_cli("tenants", "set", "*", "--max-running", "3", *url)
    assert done.returncode == 0, done.stderr
    assert "tokenfleet:tenant:*:limits: queued_share -, max_running 3" in done.stdout
    done = run_cli("tenants", "set", "acme", "--max-running", "1", *url)
    assert "queued_share 0.5, max_running 1" in done.stdout, done.stdout
    assert get_limits(r, KEYS, "acme") == TenantLimits(0.5, 1)

    r.set(KEYS.queue_cap("default"), 10)
    queue(r, "acme", "default", "a1", "a2")
    queue(r, "acme", "default", "a3", running=True)
    queue(r, "beta", "other", "b1", running=True)
    r.sadd(KEYS.models(), "default", "other")

    listed = run_cli("tenants", "--json", *url)
    assert listed.returncode == 0, listed.stderr
    snapshot = json.loads(listed.stdout)
    assert snapshot["tenant_defaults"] == {
        "queued_share": None,
        "max_running": 3,
        "cache_group": None,
    }
    acme, beta = snapshot["tenants"]["acme"], snapshot["tenants"]["beta"]
    assert acme["limits"] == {"queued_share": 0.5, "max_running": 1, "cache_group": None}
    assert acme["effective"] == {"queued_share": 0.5, "max_running": 1, "cache_group": None}
    assert acme["models"] == {
        "default": {"queued": 2, "running": 1, "queued_limit": 5},  # 0.5 x cap 10
        "other": {"queued": 0, "running": 0, "queued_limit": 500},  # 0.5 x 1000
    }
    assert beta["limits"] == {"queued_share": None, "max_running": None, "cache_group": None}
    assert beta["effective"] == {"queued_share": None, "max_running": 3, "cache_group": None}
    assert beta["models"]["other"] == {"queued": 0, "running": 1, "queued_limit": None}

    table = run_cli("tenants", *url)
    assert table.returncode == 0, table.stderr
    assert "defaults (*): queued share -, max running 3" in table.stdout
    rows = {tuple(line.split("│")[1:3]) for line in table.stdout.splitlines() if "│" in line}
    names = {(tenant.strip(), model.strip()) for tenant, model in rows}
    assert {("acme", "default"), ("beta", "other")} <= names
    assert ("acme", "other") not in names  # nothing of it there: no row
    beta_row = next(line for line in table.stdout.splitlines() if "beta" in line)
    assert "3 (*)" in beta_row  # its max running comes from the defaults

    cleared = run_cli("tenants", "set", "acme", "--clear", *url)
    assert cleared.returncode == 0, cleared.stderr
    assert "queued_share -, max_running 3 (from *)" in cleared.stdout
    assert not r.exists(KEYS.tenant_limits("acme"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["acme", "--queued-share", "1.5"], "queued_share must be a number in (0, 1]"),
        (["acme", "--max-running", "0"], "max_running must be an integer ≥ 1"),
        (["acme"], "nothing to set"),
        (["a:b", "--max-running", "1"], "invalid tenant 'a:b'"),
    ],
)
def test_tenants_set_refuses_bad_limits_with_exit_code_2(
    r: redis.Redis, redis_url: str, args: list[str], message: str
) -> None:
    done = run_cli("tenants", "set", *args, "--redis-url", redis_url)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: {message}" in done.stderr
    assert r.keys("*") == []


def test_tenants_lists_nothing_on_a_fresh_fleet(redis_url: str) -> None:
    done = run_cli("tenants", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    assert "no tenant has submitted a job or been given limits yet" in done.stdout
    assert json.loads(run_cli("tenants", "--json", "--redis-url", redis_url).stdout) == {
        "tenant_defaults": {"queued_share": None, "max_running": None, "cache_group": None},
        "tenants": {},
    }


# --- the gateway's gauges -------------------------------------------------------------


def gauges(text: str) -> dict[str, float]:
    """The fleet-wide samples of a Prometheus text page: 'name{labels}' -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(("tokenfleet_queue_depth{", "tokenfleet_tenant_")):
            sample, value = line.rsplit(" ", 1)
            out[sample] = float(value)
    return out


def fill_fleet(r: redis.Redis) -> None:
    r.sadd(KEYS.models(), "default", "other")
    for _ in range(2):
        r.xadd(KEYS.jobs("default", "batch"), {"job_id": "x"})
    r.xadd(KEYS.jobs("other", "interactive"), {"job_id": "y"})
    queue(r, "acme", "default", "a1", "a2")
    queue(r, "acme", "default", "a3", running=True)


def test_the_gauges_are_read_from_redis_at_each_refresh(r: redis.Redis, redis_url: str) -> None:
    fill_fleet(r)
    metrics = GatewayMetrics()

    async def refresh(url: str) -> bool:
        client = aredis.Redis.from_url(url, socket_connect_timeout=1)
        try:
            return await metrics.refresh_fleet(client, KEYS)
        finally:
            await client.aclose()

    assert asyncio.run(refresh(redis_url))
    seen = gauges(metrics.render().decode())
    assert seen['tokenfleet_queue_depth{band="batch",model="default"}'] == 2
    assert seen['tokenfleet_queue_depth{band="interactive",model="other"}'] == 1
    assert seen['tokenfleet_queue_depth{band="default",model="default"}'] == 0  # no stream yet
    assert len([s for s in seen if s.startswith("tokenfleet_queue_depth")]) == 6  # 2 x 3 bands
    assert seen['tokenfleet_tenant_queued{model="default",tenant="acme"}'] == 2
    assert seen['tokenfleet_tenant_running{model="default",tenant="acme"}'] == 1
    assert seen['tokenfleet_tenant_queued{model="other",tenant="acme"}'] == 0

    r.delete(KEYS.jobs("default", "batch"))
    assert asyncio.run(refresh(redis_url))
    seen = gauges(metrics.render().decode())
    assert seen['tokenfleet_queue_depth{band="batch",model="default"}'] == 0

    # Redis unreachable: the scrape goes on without them (not stale values), counted
    assert not asyncio.run(refresh(f"redis://127.0.0.1:{free_port()}/0"))
    page = metrics.render().decode()
    assert gauges(page) == {}
    assert "tokenfleet_gateway_fleet_read_errors_total 1.0" in page


def test_the_gateway_serves_the_gauges_on_metrics(r: redis.Redis, redis_url: str) -> None:
    fill_fleet(r)
    gateway = ServedGateway(GatewayConfig(redis_url=redis_url, batches=False))
    try:
        page = httpx.get(f"{gateway.url}/metrics", timeout=30)
        r.xadd(KEYS.jobs("other", "interactive"), {"job_id": "z"})
        again = httpx.get(f"{gateway.url}/metrics", timeout=30)
    finally:
        gateway.stop()
    assert page.status_code == 200
    seen = gauges(page.text)
    assert seen['tokenfleet_queue_depth{band="batch",model="default"}'] == 2
    assert seen['tokenfleet_tenant_running{model="default",tenant="acme"}'] == 1
    assert "tokenfleet_gateway_requests_total" in page.text  # its own metrics still there
    assert gauges(again.text)['tokenfleet_queue_depth{band="interactive",model="other"}'] == 2
