"""Shared fixtures: a real redis-server per test session (flushed per test), servers of a
test's own, a real Redis Cluster (one per session, flushed per test; a replicated one of
a test's own), fakeredis, worker processes; and the fast tier's marker.

Every redis-server here is the package's launcher, `tokenfleet.local.RedisServer` (a
cluster: `tokenfleet.local.RedisCluster`). A missing redis-server (or redis-cli, for a
cluster) fails the run with a clear message: tests about streams, consumer groups, Lua
and pub/sub must run against the real thing. Helpers live in the `tests.helpers`
package (see its docstring).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from tests.helpers.workers import Fleet
from tokenfleet.errors import RedisServerNotFound
from tokenfleet.local import RedisCluster, RedisServer

# The fast tier (`make test-fast` = `pytest -m fast`): modules of pure-core tests (plain
# data, the model and engine in process, fakeredis) that start no redis-server and no
# worker process. Listed by module, not guessed from fixtures: several modules start
# their own servers and processes (test_acl, test_operator), so a module joins the tier
# only by being named here, and a new one runs in the full suite until it is. A test in a
# listed module that asks for a real Redis still stays out.
FAST_MODULES = frozenset(
    {
        "test_admission.py",
        "test_attention_shared.py",
        "test_backoff.py",
        "test_batch_buffers.py",
        "test_batch_pacing.py",
        "test_chat.py",
        "test_compose.py",
        "test_connect.py",
        "test_engine.py",
        "test_gguf_quants.py",
        "test_gguf_spm.py",
        "test_keys.py",
        "test_imports.py",
        "test_hub.py",
        "test_kv.py",
        "test_lua_scripts.py",
        "test_model_reference.py",
        "test_prefix_cache.py",
        "test_protocol.py",
        "test_redis_errors.py",
        "test_runner_seam.py",
        "test_sampling.py",
        "test_scheduler.py",
        "test_sim_runner.py",
        "test_structured.py",
        "test_telemetry.py",
        "test_threads.py",
        "test_tokenizer.py",
    }
)
REAL_REDIS_FIXTURES = frozenset(
    {"redis_server", "own_redis", "aof_redis", "redis_cluster", "replicated_cluster"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.path.name in FAST_MODULES and not fixtures & REAL_REDIS_FIXTURES:
            item.add_marker(pytest.mark.fast)


Launched = TypeVar("Launched", RedisServer, RedisCluster)


def _started(server: Launched) -> Launched:
    try:
        server.start()
    except RedisServerNotFound as exc:
        pytest.fail(f"{exc}: these tests need a real Redis", pytrace=False)
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _started(RedisServer(dir=tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session's real Redis, flushed before each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


def _private_redis(tmp_path: Path, appendonly: bool) -> Iterator[RedisServer]:
    folder = tmp_path / "private-redis"
    folder.mkdir()
    server = _started(RedisServer(dir=folder, appendonly=appendonly))
    yield server
    server.stop(kill=True)


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, with appendonly on (it survives a restart)."""
    yield from _private_redis(tmp_path, appendonly=True)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, without persistence (restart, reconfigure,
    kill it freely: no other test shares it)."""
    yield from _private_redis(tmp_path, appendonly=False)


@pytest.fixture(scope="session")
def _session_cluster() -> Iterator[RedisCluster]:
    cluster = _started(RedisCluster(masters=3))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(_session_cluster: RedisCluster) -> RedisCluster:
    """The session's 3-master Redis Cluster (`.url` is its `redis+cluster://` URL), every
    master flushed before each test. Don't kill its nodes: use `replicated_cluster`."""
    cluster = _session_cluster
    assert cluster.ready(), f"the session's cluster is not healthy: {cluster.nodes()}"
    for port in cluster.master_ports():
        client = cluster.node_client(port)
        client.flushall()
        client.close()
    return cluster


@pytest.fixture
def replicated_cluster() -> Iterator[RedisCluster]:
    """A Redis Cluster of this test's own: 3 masters with a replica each (6 nodes). Kill
    and restart its nodes freely (failover tests)."""
    cluster = _started(RedisCluster(masters=3, replicas_per_master=1))
    yield cluster
    cluster.stop(kill=True)


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def fake_r() -> Iterator[redis.Redis]:
    """fakeredis with Lua, for fast logic tests where Redis semantics don't matter."""
    import fakeredis

    client = fakeredis.FakeRedis()
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _torch_threads() -> None:
    # Keep tests predictable on small CI machines.
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture
def fleet(redis_url: str, tmp_path: Path) -> Iterator[Fleet]:
    """Real `tokenfleet worker` processes on the session's Redis, killed after the test."""
    fleet = Fleet(redis_url, tmp_path)
    yield fleet
    fleet.stop_all()
