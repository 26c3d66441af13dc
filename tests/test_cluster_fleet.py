"""A fleet on a real Redis Cluster (3 masters started by the tests): producers, real worker
processes and clients on a `redis+cluster://` URL, the queue split into partitions whose
keys hash-tag to slots on every master. Submit / stream / result, the cap of each
partition exact, and a kill -9 mid-stream resumed token-exact by another worker."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.support import wait_for
from tests.helpers.workers import Fleet, WorkerProcess, collect, in_process
from tokenfleet.connect import connect
from tokenfleet.errors import QueueFull
from tokenfleet.keys import Keys
from tokenfleet.local import RedisCluster
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest
from tokenfleet.reasons import FinishReason

pytestmark = pytest.mark.cluster

PARTITIONS = 6


def _start(fleet: Fleet, name: str, *extra: str, burst: bool = True) -> WorkerProcess:
    args = ["--burst", *extra] if burst else list(extra)
    fleet.local.start_one(name, args, env={"TOKENFLEET_PARTITIONS": str(PARTITIONS)})
    worker = WorkerProcess(name, fleet.local)
    fleet.workers.append(worker)
    return worker


def _jobs(prefix: str, count: int, tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            job_id=f"{prefix}-{i}",
            prompt=f"cluster job {i}",
            max_new_tokens=tokens,
            ignore_eos=True,
            priority=("interactive", "default", "batch")[i % 3],
        )
        for i in range(count)
    ]


@pytest.fixture
def cluster_fleet(redis_cluster: RedisCluster, tmp_path: Path) -> Fleet:
    fleet = Fleet(redis_cluster.url, tmp_path)
    yield fleet  # type: ignore[misc]
    fleet.stop_all()


def test_jobs_spread_over_every_master_and_stream_equal_their_results(
    redis_cluster: RedisCluster, cluster_fleet: Fleet
) -> None:
    producer = Producer.from_url(redis_cluster.url, partitions=PARTITIONS)
    keys = producer.keys
    assert keys.is_tagged
    requests = _jobs("cl", 18, 16)
    handles = [producer.submit(req) for req in requests]
    masters = Counter(redis_cluster.master_for(keys.job(h.id)) for h in handles)
    assert len(masters) == 3, masters  # the partitions' slots are on every master
    # a plain subscriber of every job channel on every master: it hears nothing, as job
    # channels are shard channels (SPUBLISH reaches only its slot's node's subscribers)
    plain = [redis_cluster.node_client(port).pubsub() for port in redis_cluster.master_ports()]
    for sub in plain:
        sub.psubscribe("*:live")
    with ThreadPoolExecutor(max_workers=6) as pool:
        streams = [pool.submit(collect, h, 120) for h in handles]
        worker = _start(cluster_fleet, "cl-w")
        yielded = [s.result() for s in streams]
    assert worker.wait(120) == 0, worker.output()
    heard = [m for sub in plain for m in iter(lambda s=sub: s.get_message(timeout=0.05), None)]
    assert [m for m in heard if m["type"] == "pmessage"] == []
    spublished = sum(
        int(
            redis_cluster.node_client(port)
            .info("commandstats")
            .get("cmdstat_spublish", {})
            .get("calls", 0)
        )
        for port in redis_cluster.master_ports()
    )
    assert spublished >= len(handles)  # every job's events went out on its shard channel
    expected = in_process(requests)
    for handle, events in zip(handles, yielded, strict=True):
        result = handle.result(timeout=30)
        assert result.finish_reason == FinishReason.LENGTH
        assert [e.token_id for e in events] == result.token_ids
        assert result.token_ids == expected[handle.id].token_ids
    assert producer.depth() == 0


def test_each_partitions_cap_is_exact(redis_cluster: RedisCluster) -> None:
    producer = Producer.from_url(redis_cluster.url, partitions=PARTITIONS)
    producer.set_queue_cap(2)
    accepted: Counter[int] = Counter()
    refused: Counter[int] = Counter()
    for i in range(60):
        job = GenerationRequest(job_id=f"cap-{i}", prompt="x", max_new_tokens=1)
        part = producer.keys.partition_of(job.job_id)
        try:
            producer.submit(job)
            accepted[part] += 1
        except QueueFull as exc:
            assert exc.cap == 2 and exc.depth == 2
            refused[part] += 1
    assert accepted == Counter(dict.fromkeys(range(PARTITIONS), 2))  # each holds its cap
    assert sum(refused.values()) == 60 - 2 * PARTITIONS
    assert producer.depth() == 2 * PARTITIONS


def test_kill9_mid_stream_on_a_cluster_resumes_token_exact(
    redis_cluster: RedisCluster, cluster_fleet: Fleet
) -> None:
    producer = Producer.from_url(redis_cluster.url, partitions=PARTITIONS)
    keys: Keys = producer.keys
    client = connect(redis_cluster.url)
    requests = _jobs("cl-kill", 6, 240)
    handles = [producer.submit(req) for req in requests]
    with ThreadPoolExecutor(max_workers=6) as pool:
        streams = [pool.submit(collect, h, 120) for h in handles]
        first = _start(cluster_fleet, "cl-a", burst=False)

        def mid_stream() -> bool:
            emitted = [client.hget(keys.job(h.id), "emitted") for h in handles]
            return all(e is not None and 8 <= int(e) <= 160 for e in emitted)

        wait_for(mid_stream, 120, "every job mid-stream on the first worker")
        first.kill()
        second = _start(cluster_fleet, "cl-b")
        yielded = [s.result() for s in streams]
    assert second.wait(120) == 0, second.output()
    expected = in_process(requests)
    for handle, events in zip(handles, yielded, strict=True):
        result = handle.result(timeout=30)
        assert result.worker == "cl-b"
        assert [e.token_id for e in events] == result.token_ids
        assert result.token_ids == expected[handle.id].token_ids
    client.close()


def test_the_gateway_streams_from_a_fleet_on_a_cluster(
    redis_cluster: RedisCluster, cluster_fleet: Fleet
) -> None:
    from tests.helpers.gateway import ServedGateway
    from tokenfleet.config import GatewayConfig

    worker = _start(cluster_fleet, "cl-gw", burst=False)
    cluster_fleet.wait_alive(worker)
    gateway = ServedGateway(
        GatewayConfig(redis_url=redis_cluster.url, partitions=PARTITIONS, fleet_cache_s=0.0)
    )
    try:
        client = gateway.client()
        args = dict(model="default", prompt="a fleet on a cluster", max_tokens=12, temperature=0)
        whole = client.completions.create(**args, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
        chunks = client.completions.create(**args, stream=True, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert whole.choices[0].finish_reason == "length"
        assert streamed == whole.choices[0].text
        assert whole.usage is not None and whole.usage.completion_tokens == 12
    finally:
        gateway.stop()
