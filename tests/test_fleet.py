"""The fleet view (tokenfleet.fleet) against a real redis-server: heartbeats written by
the worker's own writer read back typed; malformed hashes read back with their
problems named instead of raising; capacity and served models from what was read."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aredis

from tests.helpers.reads import queue_stats
from tests.helpers.support import KEYS
from tokenfleet.fleet import (
    FleetCache,
    FleetView,
    band_stats,
    decode_worker,
    live_workers,
    read_workers,
    read_workers_async,
)
from tokenfleet.keys import DEFAULT_MODEL, GROUP, Keys
from tokenfleet.worker.queue import WorkerQueue
from tokenfleet.worker.telemetry import EngineStats


def heartbeat(r: redis.Redis, name: str, **info: object) -> None:
    """What `Worker.heartbeat` sends: identity, status, budget and engine telemetry,
    through `WorkerQueue.heartbeat`."""
    stats = EngineStats(max_batch_size=8)
    stats.record_tick(0.01, decode_batch=2, prefill_tokens=5, decode_tokens=2)
    telemetry = stats.snapshot(
        active=2, waiting=1, kv_used_bytes=1024, kv_budget_bytes=4096, scratch_used=0,
        scratch_budget=1,
    )  # fmt: skip
    fields = {
        "model": "default",
        "checkpoint": "tiny-random",
        "stream": KEYS.jobs(),
        "group": GROUP,
        "status": "running",
        "redis_oom": False,
        "started_at": 1_700_000_000.5,
        "pid": 4242,
        "budget": {"max_active": 8, "max_batch_size": 8},
        "held_jobs": 0,
        **telemetry,
        "max_job_tokens": 2048,
        **info,
    }
    WorkerQueue(r, KEYS, name).heartbeat(fields)


def test_a_heartbeat_reads_back_typed_with_every_field(r: redis.Redis) -> None:
    before = time.time()
    heartbeat(r, "w1")
    (info,) = read_workers(r, KEYS).values()
    assert info.name == "w1" and info.problems == ()
    assert (info.model, info.status, info.checkpoint) == ("default", "running", "tiny-random")
    assert (info.pid, info.started_at, info.max_job_tokens) == (4242, 1_700_000_000.5, 2048)
    assert info.last_seen is not None and before - 1 <= info.last_seen <= time.time() + 1
    assert info.fields["budget"] == {"max_active": 8, "max_batch_size": 8}
    assert info.fields["active"] == 2 and info.fields["worker"] == "w1"
    assert live_workers(r, KEYS) == {"w1": info.fields}


def test_a_malformed_hash_names_its_problems_instead_of_raising(r: redis.Redis) -> None:
    heartbeat(r, "ok")
    key = KEYS.worker("bad")
    r.hset(
        key,
        mapping={
            "model": b"\xff\xfe not json",  # neither JSON nor UTF-8
            "max_job_tokens": '"lots"',
            "pid": "true",
            "started_at": '"yesterday"',
            "status": "7",
        },
    )
    r.set(KEYS.worker("not-a-hash"), "a string")
    r.zadd(KEYS.workers(), {"bad": time.time(), "not-a-hash": time.time()})

    workers = read_workers(r, KEYS)
    assert set(workers) == {"ok", "bad", "not-a-hash"}
    bad = workers["bad"]
    assert bad.model == "\ufffd\ufffd not json"  # read back as text, served as that name
    assert (bad.max_job_tokens, bad.pid, bad.started_at, bad.status) == (None, None, None, None)
    named = {p.split(":")[0] for p in bad.problems}
    assert named == {"model", "max_job_tokens", "pid", "started_at", "status"}
    assert "expected an integer, got 'lots'" in " ".join(bad.problems)
    wrong = workers["not-a-hash"]
    assert wrong.fields == {} and wrong.model == DEFAULT_MODEL
    assert "WRONGTYPE" in wrong.problems[0]
    # What can be read still counts: the healthy worker's capacity is the fleet's.
    assert FleetView(workers).capacity(None) == 2048


def test_expired_heartbeats_are_pruned_by_sync_reads_only(r: redis.Redis, redis_url: str) -> None:
    heartbeat(r, "alive")
    r.zadd(KEYS.workers(), {"ghost": 1.0})  # its hash expired long ago

    async def read() -> set[str]:
        client = aredis.Redis.from_url(redis_url)
        try:
            return set(await read_workers_async(client, KEYS))
        finally:
            await client.aclose()

    assert asyncio.run(read()) == {"alive"}
    assert r.zscore(KEYS.workers(), "ghost") == 1.0  # the async reader may not ZREM
    assert set(read_workers(r, KEYS)) == {"alive"}
    assert r.zscore(KEYS.workers(), "ghost") is None
    assert read_workers(r, Keys("empty:")) == {}


def test_served_models_and_capacity_come_from_the_live_workers(r: redis.Redis) -> None:
    heartbeat(r, "small", max_job_tokens=512, started_at=100.0, checkpoint="a")
    heartbeat(r, "large", max_job_tokens=4096, started_at=50.0, checkpoint="b")
    heartbeat(r, "other", model="big", max_job_tokens=100_000)
    heartbeat(r, "silent", model="quiet", max_job_tokens=None)
    view = FleetView(read_workers(r, KEYS))
    assert list(view.models) == ["big", "default", "quiet"]
    default = view.models["default"]
    assert (default.max_job_tokens, default.checkpoints, default.created) == (4096, ["a", "b"], 50)
    assert view.capacity(None) == view.capacity("default") == 4096
    assert view.capacity("big") == 100_000
    assert view.capacity("quiet") is None and view.capacity("nobody") is None


def test_a_cached_view_is_trusted_for_its_ttl_only() -> None:
    cache = FleetCache(ttl_s=1.0)
    assert cache.get(10.0) is None
    view = cache.put(10.0, FleetView({"w": decode_worker("w", {b"model": b'"m"'})}))
    assert cache.get(10.5) is view
    assert cache.get(11.0) is None


def test_queue_stats_read_each_band_and_a_missing_stream_is_empty(r: redis.Redis) -> None:
    empty = {"depth": 0, "lag": None, "pending": 0, "consumers": 0}
    for _ in range(2):
        r.xadd(KEYS.jobs("m", "batch"), {"job_id": "x"})
    r.xgroup_create(KEYS.jobs("m", "batch"), GROUP, id="0")
    r.xreadgroup(GROUP, "w", {KEYS.jobs("m", "batch"): ">"}, count=1)
    r.xadd(KEYS.jobs("m", "interactive"), {"job_id": "y"})  # no group yet
    assert queue_stats(r, KEYS, "m", "batch") == {
        "depth": 2,
        "lag": 1,
        "pending": 1,
        "consumers": 1,
    }
    assert queue_stats(r, KEYS, "m", "interactive") == {**empty, "depth": 1}
    assert queue_stats(r, KEYS, "m") == empty  # the default band: no stream at all
    stats = band_stats(r, KEYS, ["m", "none"])
    assert list(stats) == ["m", "none"]
    assert list(stats["m"]) == ["interactive", "default", "batch"]  # highest first
    assert stats["m"]["batch"]["pending"] == 1
    assert stats["none"] == dict.fromkeys(("interactive", "default", "batch"), empty)

    r.set(KEYS.jobs("bad"), "not a stream")  # any other error is raised, not hidden
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        queue_stats(r, KEYS, "bad")
