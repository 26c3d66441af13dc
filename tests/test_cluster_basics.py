"""The local Redis Cluster launcher (`tokenfleet.local.RedisCluster`) and its fixtures:
the cluster forms, its URL gives a working client, keys spread over the masters by
slot, a replicated cluster has one synced replica per master, and a killed master
fails over to its replica."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

import pytest
from redis.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

from tokenfleet.connect import connect
from tokenfleet.local import CLUSTER_SLOTS, RedisCluster


@pytest.fixture
def client(redis_cluster: RedisCluster) -> Iterator[ClusterClient]:
    c = connect(redis_cluster.url)
    assert isinstance(c, ClusterClient)
    yield c
    c.close()


def keys_per_master(cluster: RedisCluster, per_master: int = 2) -> dict[int, list[str]]:
    """`per_master` keys served by each master, found by trying names in order."""
    found: dict[int, list[str]] = {port: [] for port in cluster.master_ports()}
    i = 0
    while any(len(keys) < per_master for keys in found.values()):
        key = f"key-{i}"
        owner = found[cluster.master_for(key)]
        if len(owner) < per_master:
            owner.append(key)
        i += 1
    return found


def test_the_cluster_starts_with_every_slot_served(redis_cluster: RedisCluster) -> None:
    print(f"3-master cluster ready in {redis_cluster.start_s:.2f}s")
    nodes = redis_cluster.nodes()
    assert [view.port for view in nodes] == sorted(redis_cluster.ports)
    assert len(nodes) == 3 and all(view.master and not view.failed for view in nodes)
    ranges = sorted(r for view in nodes for r in view.slots)
    assert ranges[0][0] == 0 and ranges[-1][1] == CLUSTER_SLOTS - 1
    assert all(a[1] + 1 == b[0] for a, b in pairwise(ranges))
    assert redis_cluster.url == "redis+cluster://" + ",".join(
        f"127.0.0.1:{port}" for port in redis_cluster.ports
    )


def test_the_url_gives_a_working_client(client: ClusterClient) -> None:
    assert client.set("greeting", "hello")
    assert client.get("greeting") == b"hello"
    assert len(client.get_primaries()) == 3


def test_keys_in_different_slots_land_on_different_masters(
    redis_cluster: RedisCluster, client: ClusterClient
) -> None:
    spread = keys_per_master(redis_cluster)
    assert len(spread) == 3
    for port, keys in spread.items():
        for key in keys:
            client.set(key, str(port))
    for port, keys in spread.items():
        node = redis_cluster.node_client(port)
        try:
            # each master holds exactly its own keys: the fixture flushed it first
            assert sorted(node.keys()) == sorted(k.encode() for k in keys)
            assert node.get(keys[0]) == str(port).encode()
        finally:
            node.close()
    # a hash tag puts different keys in one slot, so on one master
    assert key_slot(b"{job-1}:state") == key_slot(b"{job-1}:events")
    assert redis_cluster.master_for("{job-1}:state") == redis_cluster.master_for("{job-1}:x")


def test_every_test_starts_on_empty_masters(
    redis_cluster: RedisCluster, client: ClusterClient
) -> None:
    assert client.dbsize(target_nodes=ClusterClient.PRIMARIES) == 0
    client.set("left-behind", 1)  # the next test's flush removes it


def test_a_six_node_cluster_has_a_synced_replica_per_master(
    replicated_cluster: RedisCluster,
) -> None:
    cluster = replicated_cluster
    print(f"6-node cluster ready in {cluster.start_s:.2f}s")
    nodes = cluster.nodes()
    masters = [view for view in nodes if view.master]
    replicas = [view for view in nodes if not view.master]
    assert len(masters) == 3 and len(replicas) == 3
    assert sorted(view.master_port for view in replicas if view.master_port) == sorted(
        view.port for view in masters
    )
    key = "replicated"
    master = cluster.master_for(key)
    replica = next(view.port for view in replicas if view.master_port == master)
    client = cluster.node_client(master)
    try:
        client.set(key, "v")
        assert client.wait(1, 5000) == 1  # the replica acknowledged the write
    finally:
        client.close()
    node = cluster.node_client(replica)
    try:
        assert node.info("replication")["role"] == "slave"
        node.execute_command("READONLY")
        assert node.get(key) == b"v"
    finally:
        node.close()


@pytest.mark.fault
def test_a_killed_master_fails_over_to_its_replica(replicated_cluster: RedisCluster) -> None:
    cluster = replicated_cluster
    client = connect(cluster.url)
    try:
        key = "survives"
        client.set(key, "v")
        old = cluster.master_for(key)
        replica = next(v.port for v in cluster.nodes() if v.master_port == old)
        node = cluster.node_client(old)
        assert node.wait(1, 5000) == 1
        node.close()

        cluster.kill(old)
        assert old not in cluster.running()
        cluster.wait_ready(timeout=30)  # the replica took the slots over
        assert cluster.master_for(key) == replica
        assert client.get(key) == b"v"  # the client follows the MOVED slots

        cluster.start_node(old)
        cluster.wait_ready(timeout=30)
        back = next(view for view in cluster.nodes() if view.port == old)
        assert not back.master and back.master_port == replica  # rejoined as a replica
    finally:
        client.close()
