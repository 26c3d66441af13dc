"""`tokenfleet.connect`: one Redis client from any URL an entry point is given.

Parsing and plain URLs need no server (fast tier); the cluster tests run on the
session's real Redis Cluster (`redis_cluster`)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster as AsyncClusterClient
from redis.cluster import RedisCluster as ClusterClient

from tests.helpers.support import run_cli
from tokenfleet.connect import (
    connect,
    connect_async,
    connect_async_pooled,
    initialized,
    is_cluster_url,
    parse_cluster_url,
)
from tokenfleet.errors import InvalidRedisUrl, TokenfleetError
from tokenfleet.keys import Keys
from tokenfleet.local import RedisCluster, free_port, wait_until_up
from tokenfleet.producer import AsyncProducer, Producer

# ---- parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "cluster"),
    [
        ("redis+cluster://h:7000", True),
        ("rediss+cluster://h:7000,g:7001", True),
        ("REDIS+CLUSTER://h", True),
        ("redis://h:6379/0", False),
        ("rediss://h:6379/0", False),
        ("unix:///tmp/redis.sock", False),
        ("redis-cluster://h", False),
        ("h:7000", False),
    ],
)
def test_is_cluster_url(url: str, cluster: bool) -> None:
    assert is_cluster_url(url) is cluster


def test_a_cluster_url_names_its_startup_nodes() -> None:
    parsed = parse_cluster_url("redis+cluster://10.0.0.1:7000, 10.0.0.2:7001,node-c/")
    assert parsed.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("node-c", 6379))
    assert not parsed.tls and parsed.options == {}
    assert parse_cluster_url("redis+cluster://[::1]:7000,[fe80::2]").nodes == (
        ("::1", 7000),
        ("fe80::2", 6379),
    )


def test_a_cluster_url_carries_credentials_and_options_for_every_node() -> None:
    url = "redis+cluster://fleet:p%40ss%2Fword@h1:7000,h2:7001/0?socket_timeout=2.5&client_name=x"
    parsed = parse_cluster_url(url)
    assert parsed.options == {
        "username": "fleet",
        "password": "p@ss/word",
        "socket_timeout": 2.5,
        "client_name": "x",
    }
    assert parse_cluster_url("redis+cluster://:only-pw@h").options == {"password": "only-pw"}
    assert "p@ss" not in repr(parsed)  # the password stays out of logs
    # the URL's options win over the caller's keyword arguments, as in redis-py's from_url
    kwargs = parsed.client_kwargs(socket_timeout=10, health_check_interval=5)
    assert kwargs["socket_timeout"] == 2.5 and kwargs["health_check_interval"] == 5
    assert "ssl" not in kwargs
    assert parsed.first_node_url.startswith("redis://fleet:p%40ss%2Fword@h1:7000/0?")


def test_rediss_cluster_selects_tls_with_its_certificate_options() -> None:
    parsed = parse_cluster_url(
        "rediss+cluster://h1:7000,h2:7000?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required"
        "&ssl_check_hostname=false"
    )
    assert parsed.tls
    kwargs = parsed.client_kwargs()
    assert kwargs["ssl"] is True
    assert kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    assert kwargs["ssl_cert_reqs"] == "required"
    assert kwargs["ssl_check_hostname"] is False
    assert parsed.first_node_url.startswith("rediss://h1:7000/0?")


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("redis+cluster://", "no host"),
        ("redis+cluster://user:pw@/0", "no host"),
        ("redis+cluster://h:0", "bad port '0'"),
        ("redis+cluster://h:70000", "bad port '70000'"),
        ("redis+cluster://h:7000,g:port", "bad port 'port' of host 'g'"),
        ("redis+cluster://h:7000,:7001", "no host"),
        ("redis+cluster://[::1:7000", "malformed host"),
        ("redis+cluster://[::1]x:7000", "malformed host"),
        ("redis+cluster://h:7000/1", "only db 0"),
        ("redis+cluster://h:7000?db=2", "only db 0"),
        ("redis+cluster://h:7000?socket_timeout=soon", "socket_timeout"),
    ],
)
def test_a_malformed_cluster_url_is_a_named_error(url: str, names: str) -> None:
    with pytest.raises(InvalidRedisUrl, match=names.replace("[", r"\[")):
        connect(url)
    with pytest.raises(InvalidRedisUrl, match=names.replace("[", r"\[")):
        connect_async(url)


def test_an_unknown_scheme_is_a_named_error_that_hides_the_password() -> None:
    for url in ("redis-cluster://u:secret@h:7000", "http://u:secret@h", "h:6379"):
        with pytest.raises(InvalidRedisUrl) as caught:
            connect(url)
        assert "redis+cluster://" in str(caught.value)  # it lists the schemes it reads
        assert "secret" not in str(caught.value)
    with pytest.raises(InvalidRedisUrl) as bad_port:
        connect("redis+cluster://u:secret@h:x")
    assert "secret" not in str(bad_port.value)
    # named, and still what a caller catching ValueError expects
    assert issubclass(InvalidRedisUrl, TokenfleetError) and issubclass(InvalidRedisUrl, ValueError)


def test_plain_urls_go_to_redis_py_unchanged() -> None:
    # nothing connects before the first command
    client = connect("redis://:pw@127.0.0.1:6390/3", socket_timeout=7)
    assert type(client) is redis.Redis
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["port"], kwargs["db"], kwargs["password"], kwargs["socket_timeout"]) == (
        6390,
        3,
        "pw",
        7,
    )
    client.close()
    tls = connect("rediss://127.0.0.1:6390/0?ssl_cert_reqs=none")
    assert tls.connection_pool.connection_class is redis.SSLConnection
    tls.close()
    sock = connect("unix:///tmp/tokenfleet-test.sock?db=2")
    assert sock.connection_pool.connection_kwargs["path"] == "/tmp/tokenfleet-test.sock"
    sock.close()
    async_client = connect_async("redis://127.0.0.1:6390/4")
    assert type(async_client) is aredis.Redis
    assert async_client.connection_pool.connection_kwargs["db"] == 4


def test_a_cluster_no_node_of_which_answers_is_a_connection_error() -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with pytest.raises(redis.ConnectionError, match=r"Redis Cluster at 127\.0\.0\.1:"):
        connect(url)
    with pytest.raises(redis.ConnectionError):
        wait_until_up(url, timeout=0.2)


# ---- against a real cluster ------------------------------------------------------------


def test_connect_returns_a_cluster_client_that_reaches_every_master(
    redis_cluster: RedisCluster,
) -> None:
    client = connect(redis_cluster.url, socket_timeout=5, health_check_interval=5)  # a worker's
    try:
        assert isinstance(client, ClusterClient)
        spread = {redis_cluster.master_for(f"k{i}"): f"k{i}" for i in range(64)}
        assert len(spread) == 3  # 64 keys reach every master
        for port, key in spread.items():
            assert client.set(key, port)
            assert client.get(key) == str(port).encode()
            node = redis_cluster.node_client(port)
            assert node.get(key) == str(port).encode()  # stored on the master of its slot
            node.close()
    finally:
        client.close()
    # any one node is a startup node enough
    one = connect(f"redis+cluster://127.0.0.1:{redis_cluster.ports[-1]}")
    assert len(one.get_primaries()) == 3
    one.close()
    wait_until_up(redis_cluster.url, timeout=5)


def test_connect_async_returns_a_cluster_client_that_reaches_every_master(
    redis_cluster: RedisCluster,
) -> None:
    spread = {redis_cluster.master_for(f"k{i}"): f"k{i}" for i in range(64)}

    async def main() -> None:
        client = connect_async(redis_cluster.url)
        assert isinstance(client, AsyncClusterClient)
        try:
            for port, key in spread.items():  # the first command connects it
                assert await client.set(key, port)
                assert await client.get(key) == str(port).encode()
        finally:
            await client.aclose()

    asyncio.run(main())
    for port, key in spread.items():
        node = redis_cluster.node_client(port)
        assert node.get(key) == str(port).encode()
        node.close()


def test_sharded_pubsub_works_on_an_initialized_async_cluster_client(
    redis_cluster: RedisCluster,
) -> None:
    async def main() -> bytes:
        client = await initialized(connect_async(redis_cluster.url))
        pubsub = client.pubsub()
        try:
            await pubsub.ssubscribe("tf:{job-1}:live")
            assert await client.spublish("tf:{job-1}:live", "token") == 1
            for _ in range(50):
                message = await pubsub.get_sharded_message(timeout=0.2)
                if message is not None and message["type"] == "smessage":
                    return bytes(message["data"])
            raise AssertionError("no sharded message")
        finally:
            await pubsub.aclose()
            await client.aclose()

    assert asyncio.run(main()) == b"token"


def test_the_pooled_async_cluster_client_and_its_pubsub_pool(
    redis_cluster: RedisCluster,
) -> None:
    """What the gateway opens: a capped cluster client, and a pool on one node whose
    subscribers hear a PUBLISH sent through any node (a cluster broadcasts it)."""

    async def main() -> bytes:
        client, pool = connect_async_pooled(
            redis_cluster.url, max_connections=4, timeout=1, client_name="tf-test"
        )
        assert isinstance(client, AsyncClusterClient)
        assert pool.connection_kwargs["port"] == redis_cluster.ports[0]
        subscriber = aredis.Redis(connection_pool=pool).pubsub()
        try:
            await subscriber.subscribe("tf:telemetry")
            await subscriber.get_message(timeout=1)  # the subscribe confirmation
            for i in range(6):  # keys on every master: the cap is per node
                await client.set(f"pooled-{i}", i)
            await client.publish("tf:telemetry", "beat")
            for _ in range(50):
                message = await subscriber.get_message(timeout=0.2)
                if message is not None and message["type"] == "message":
                    return bytes(message["data"])
            raise AssertionError("no message")
        finally:
            await subscriber.aclose()
            await client.aclose()
            await pool.aclose()

    assert asyncio.run(main()) == b"beat"


def test_producers_build_on_a_cluster_url(redis_cluster: RedisCluster) -> None:
    # (submitting on a cluster: tests/test_cluster_fleet.py)
    producer = Producer.from_url(redis_cluster.url, prefix="tfc")
    assert producer.keys == Keys("tfc", tagged=True)  # a cluster URL hash-tags the keys
    try:
        assert isinstance(producer.redis, ClusterClient)
        producer.set_queue_cap(9)
        assert producer.queue_cap() == 9
    finally:
        producer.redis.close()

    async def main() -> None:
        aproducer = AsyncProducer.from_url(redis_cluster.url, prefix="tfc")
        assert isinstance(aproducer.redis, AsyncClusterClient)
        assert aproducer.keys == Keys("tfc", tagged=True)
        assert int(await aproducer.redis.get(aproducer.keys.queue_cap(None))) == 9
        await aproducer.redis.aclose()

    asyncio.run(main())


def test_the_cli_takes_a_cluster_url(redis_cluster: RedisCluster) -> None:
    done = run_cli("queue-cap", "7", "--redis-url", redis_cluster.url, "--prefix", "tfc")
    assert done.returncode == 0, done.stderr
    assert "cap 7, depth 0" in done.stdout
    client = connect(redis_cluster.url)
    assert client.get(Keys("tfc", tagged=True).queue_cap(None)) == b"7"  # {p0}: tagged
    client.close()
    bad = run_cli("queue-cap", "--redis-url", "redis+cluster://u:secret@h:99999")
    assert bad.returncode == 2
    assert "bad port '99999'" in bad.stderr and "secret" not in bad.stderr


def test_the_gateway_starts_on_a_cluster_url(redis_cluster: RedisCluster) -> None:
    from tests.helpers.gateway import ServedGateway
    from tokenfleet.gateway import GatewayConfig

    gateway = ServedGateway(GatewayConfig(redis_url=redis_cluster.url, batches=False))
    try:
        health = httpx.get(f"{gateway.url}/health", timeout=10)
    finally:
        gateway.stop()
    assert health.status_code == 200, health.text
    body = health.json()
    assert body["redis"] is True  # its PING went through the cluster client
    assert body["pubsub"]["connections"] == body["pubsub"]["of"]  # shards on the pool's node
