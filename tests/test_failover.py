"""Failover loses nothing a client saw (issue 24, part 3), on a real 6-node Redis Cluster
(3 masters, a replica each) with real worker processes.

The scene: 24 streaming jobs, sampled without a seed (so a token generated twice is, with
near certainty, a different token). Mid-stream the replica of the master holding most
jobs is stopped (SIGSTOP) and its link closed: that master's writes pile up
unreplicated. Then the workers and the master are killed (SIGKILL), the replica comes
back and is promoted, the old master rejoins as its replica, and fresh workers resume
every job after what the new primary holds.

Without durable mode the clients saw tokens the new primary never got, and the fresh
workers generate other tokens at those indices: streams and results disagree. With
`--wait-replicas 1` no token reaches a client before a replica acknowledged it, so every
stream equals its result, and every acknowledged job finishes."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from tests.helpers.support import wait_for
from tests.helpers.workers import Fleet, WorkerProcess, collect
from tokenfleet.connect import connect
from tokenfleet.errors import JobTimeout, NotReplicated
from tokenfleet.local import RedisCluster, RedisServer
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.reasons import FinishReason

PARTITIONS = 6
JOBS = 24
TOKENS = 320
DURABLE = ("--wait-replicas", "1", "--wait-timeout-ms", "50")


def _start(fleet: Fleet, name: str, extra: tuple[str, ...], burst: bool) -> WorkerProcess:
    args = [*extra, "--burst"] if burst else list(extra)
    fleet.local.start_one(name, args, env={"TOKENFLEET_PARTITIONS": str(PARTITIONS)})
    worker = WorkerProcess(name, fleet.local)
    fleet.workers.append(worker)
    return worker


def _conflicts(tokens: list[int], result: list[int]) -> int:
    """Indices where what the client saw differs from the stored result."""
    return sum(a != b for a, b in zip(tokens, result, strict=False)) + abs(
        len(tokens) - len(result)
    )


def _failover(cluster: RedisCluster, tmp_path: Path, extra: tuple[str, ...]) -> list[int]:
    """Run the scene (module docstring); the conflicting indices per job."""
    fleet = Fleet(cluster.url, tmp_path)
    producer = Producer.from_url(cluster.url, partitions=PARTITIONS)
    keys = producer.keys
    client = connect(cluster.url)
    try:
        requests = [
            GenerationRequest(
                job_id=f"fo-{i}",
                prompt=f"failover job {i}",
                max_new_tokens=TOKENS,
                ignore_eos=True,
                sampling=SamplingParams(temperature=1.0),
            )
            for i in range(JOBS)
        ]
        handles = [producer.submit(req) for req in requests]
        homes = {h.id: cluster.master_for(keys.job(h.id)) for h in handles}
        victim = Counter(homes.values()).most_common(1)[0][0]
        replica = cluster.replica_of(victim)
        on_victim = [h.id for h in handles if homes[h.id] == victim]

        def emitted(job_id: str) -> int:
            return int(client.hget(keys.job(job_id), "emitted") or 0)

        with ThreadPoolExecutor(max_workers=JOBS) as pool:
            streams = [pool.submit(collect, h, 240) for h in handles]
            first = [_start(fleet, f"fo-a{i}", extra, burst=False) for i in range(2)]
            wait_for(
                lambda: all(emitted(j) >= 8 for j in on_victim),
                180,
                "the victim master's jobs mid-stream",
            )
            # From here the victim's writes are not replicated: the replica is stopped and
            # its link closed (what the kernel had delivered to it before still arrives).
            cluster.pause(replica)
            node = cluster.node_client(victim)
            node.client_kill_filter(_type="replica")
            node.close()
            before = {j: emitted(j) for j in on_victim}
            wait_for(
                lambda: all(emitted(j) >= before[j] + 6 for j in on_victim),
                120,
                "tokens written while the replica is stopped",
            )
            for worker in first:
                worker.kill()
            cluster.kill(victim)
            cluster.resume(replica)
            cluster.wait_ready(60)  # the replica took the victim's slots over
            assert cluster.master_for(keys.job(on_victim[0])) == replica
            # the failed node comes back as the new primary's replica: durable mode
            # announces that primary's tokens once a replica holds them again
            cluster.start_node(victim)
            cluster.wait_ready(60)
            second = [_start(fleet, f"fo-b{i}", extra, burst=True) for i in range(2)]
            yielded = [s.result() for s in streams]
        for worker in second:
            assert worker.wait(180) == 0, worker.output()
        conflicts = []
        for handle, events in zip(handles, yielded, strict=True):
            result = handle.result(timeout=60)  # every acknowledged job finished
            assert result.finish_reason == FinishReason.LENGTH, handle.id
            assert len(result.token_ids) == TOKENS
            conflicts.append(_conflicts([e.token_id for e in events], result.token_ids))
        return conflicts
    finally:
        client.close()
        fleet.stop_all()


@pytest.mark.cluster
def test_durable_mode_a_failover_takes_back_no_token_a_client_saw(
    replicated_cluster: RedisCluster, tmp_path: Path
) -> None:
    conflicts = _failover(replicated_cluster, tmp_path, DURABLE)
    assert conflicts == [0] * JOBS


@pytest.mark.cluster
def test_without_durable_mode_clients_saw_tokens_the_failover_took_back(
    replicated_cluster: RedisCluster, tmp_path: Path
) -> None:
    """The control: the same scene without --wait-replicas shows the gap it closes."""
    conflicts = _failover(replicated_cluster, tmp_path, ())
    assert sum(conflicts) > 0


def test_durable_mode_holds_tokens_back_until_a_replica_holds_them(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    """On one primary: with no replica every token is written (the worker's resume point)
    but none reaches a client, and the job does not end; once a replica attaches, the
    stream flows and equals the result."""
    fleet = Fleet(own_redis.url, tmp_path)
    producer = Producer.from_url(own_redis.url)
    keys = producer.keys
    client = redis.Redis.from_url(own_redis.url)
    replica = RedisServer.launch()
    try:
        request = GenerationRequest(
            job_id="held", prompt="hold", max_new_tokens=24, ignore_eos=True
        )
        handle = producer.submit(request)
        fleet.local.start_one("d-w", [*DURABLE, "--burst"])
        worker = WorkerProcess("d-w", fleet.local)
        fleet.workers.append(worker)
        wait_for(
            lambda: int(client.hget(keys.job("held"), "emitted") or 0) == 24,
            120,
            "every token written",
        )
        assert client.hget(keys.job("held"), "durable") == b"0"
        assert client.get(keys.result("held")) is None  # its end waits too
        seen: list[int] = []
        with pytest.raises(JobTimeout):
            for event in handle.stream(timeout=2):
                seen.append(event.index)
        assert seen == []
        follower = redis.Redis.from_url(replica.url)
        follower.execute_command("REPLICAOF", "127.0.0.1", str(own_redis.port))
        follower.close()
        events = collect(handle, 120)
        result = handle.result(timeout=60)
        assert [e.token_id for e in events] == result.token_ids
        assert len(result.token_ids) == 24
        assert worker.wait(120) == 0, worker.output()
    finally:
        client.close()
        fleet.stop_all()
        replica.stop(kill=True)


def test_a_durable_submit_is_acknowledged_only_once_a_replica_holds_it(
    own_redis: RedisServer,
) -> None:
    """A producer with wait_replicas: with no replica the job is queued on the primary but
    the submit raises NotReplicated (a resubmit of the id queues nothing twice); once a
    replica follows, the same submit returns."""
    durable = Producer.from_url(own_redis.url, wait_replicas=1, wait_timeout_ms=100)
    client = redis.Redis.from_url(own_redis.url)
    replica = RedisServer.launch()
    try:
        request = GenerationRequest(job_id="ack", prompt="x", max_new_tokens=1)
        with pytest.raises(NotReplicated) as refused:
            durable.submit(request)
        assert (refused.value.acked, refused.value.wanted) == (0, 1)
        assert client.hget(durable.keys.job("ack"), "status") == b"queued"
        [outcome] = durable.submit_many([request])
        assert isinstance(outcome.error, NotReplicated)
        follower = redis.Redis.from_url(replica.url)
        follower.execute_command("REPLICAOF", "127.0.0.1", str(own_redis.port))
        wait_for(
            lambda: follower.info("replication").get("master_link_status") == "up",
            30,
            "the replica in sync",
        )
        follower.close()
        handle = durable.submit(request)
        assert handle.duplicate  # the first submit had queued it: still one job
        assert durable.depth() == 1
    finally:
        client.close()
        replica.stop(kill=True)


def test_a_durable_gateway_answers_503_when_no_replica_holds_the_submit(
    own_redis: RedisServer,
) -> None:
    """`--wait-replicas 1` on the gateway with no replica: the request is refused with 503
    `not_replicated` and a Retry-After, and its job, queued on the primary, is cancelled
    (a client's retry is a new request)."""
    import httpx

    from tests.helpers.gateway import ServedGateway
    from tokenfleet.config import GatewayConfig

    gateway = ServedGateway(
        GatewayConfig(redis_url=own_redis.url, wait_replicas=1, fleet_cache_s=0.0)
    )
    client = redis.Redis.from_url(own_redis.url)
    try:
        reply = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "default", "prompt": "hi", "max_tokens": 4},
            timeout=30,
        )
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "not_replicated"
        assert int(reply.headers["Retry-After"]) >= 1
        [job] = [k for k in client.scan_iter("tokenfleet:job:*") if k.count(b":") == 2]
        assert client.exists(job + b":cancel")  # queued on the primary, cancelled
    finally:
        client.close()
        gateway.stop()
