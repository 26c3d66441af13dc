"""More of a fleet on a real Redis Cluster (3 masters started by the tests, the queue in 6
partitions over them): a paused (SIGSTOP) worker whose jobs another worker took over
writes nothing after it wakes; the Batch API (the gateway's driver, and `tokenfleet batch
run`) runs every line with its jobs spread over the partitions; priority bands with one
slot: interactive jobs start before batch ones, within each partition and across them
(a pull of one partition takes no band below one last seen waiting in another).

Every check goes through the public client API (`Producer.from_url(...)`, the OpenAI
client, the CLI) and Redis state, not through how the job channels are published."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ResponseError

from tests.helpers.gateway import ServedGateway, jsonl
from tests.helpers.support import ROOT, wait_for
from tests.helpers.workers import Fleet, WorkerProcess, collect
from tokenfleet.batch.format import batch_id_for_file, job_id_for
from tokenfleet.config import GatewayConfig
from tokenfleet.connect import Client, connect
from tokenfleet.keys import GROUP, Keys
from tokenfleet.local import LocalWorkers, RedisCluster
from tokenfleet.producer import Producer
from tokenfleet.protocol import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    decode_events,
)

pytestmark = pytest.mark.cluster

PARTITIONS = 6
PARTITIONS_ENV = {"TOKENFLEET_PARTITIONS": str(PARTITIONS)}


def _start(fleet: Fleet, name: str, *extra: str, burst: bool = False) -> WorkerProcess:
    """A tiny-random worker of `fleet` on the cluster's partitioned queue."""
    fleet.local.start_one(name, ["--burst", *extra] if burst else list(extra), env=PARTITIONS_ENV)
    worker = WorkerProcess(name, fleet.local)
    fleet.workers.append(worker)
    return worker


@pytest.fixture
def cluster_fleet(redis_cluster: RedisCluster, tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(redis_cluster.url, tmp_path)
    yield fleet
    fleet.stop_all()


@pytest.fixture
def client(redis_cluster: RedisCluster) -> Iterator[Client]:
    c = connect(redis_cluster.url)
    yield c
    c.close()


def _producer(cluster: RedisCluster) -> Producer:
    return Producer.from_url(cluster.url, partitions=PARTITIONS)


# ---- a paused worker's fenced writes ----------------------------------------------------


def pending_to(c: Client, keys: Keys, consumer: str) -> list[str]:
    """Entries pending to `consumer`, in every band stream of every partition."""
    found: list[str] = []
    for part in keys.partitions_all:
        for band in keys.bands(None, part):
            try:
                pending = c.xpending_range(band.stream, GROUP, "-", "+", 1000, consumer)
            except ResponseError:  # a band nobody made a group on yet: nothing pending
                continue
            found += [p["message_id"].decode() for p in pending]
    return found


def replay(c: Client, keys: Keys, job_id: str) -> list[TokenEvent | FinishEvent]:
    """The job's replay stream, decoded."""
    return [e for _id, f in c.xrange(keys.events(job_id)) for e in decode_events(f[b"m"])]


def test_a_paused_workers_writes_are_refused_after_its_jobs_moved_on(
    redis_cluster: RedisCluster, cluster_fleet: Fleet, client: Client
) -> None:
    producer = _producer(redis_cluster)
    keys = producer.keys
    paused = _start(cluster_fleet, "cl-paused", "--max-active", "16")
    cluster_fleet.wait_alive(paused)
    requests = [  # unseeded temperature 1: two workers would never write the same tokens
        GenerationRequest(
            job_id=f"cl-pause-{i}",
            prompt=f"story number {i} begins",
            max_new_tokens=300,
            ignore_eos=True,
            sampling=SamplingParams(temperature=1.0),
        )
        for i in range(8)
    ]
    handles = [producer.submit(req) for req in requests]
    ids = [h.id for h in handles]
    assert len({redis_cluster.master_for(keys.job(i)) for i in ids}) > 1  # several masters
    with ThreadPoolExecutor(max_workers=len(handles)) as pool:
        streams = [pool.submit(collect, h, 180) for h in handles]

        def flowing() -> bool:
            emitted = [client.hget(keys.job(i), "emitted") for i in ids]
            return all(e is not None and 4 <= int(e) <= 200 for e in emitted)

        wait_for(lambda: len(pending_to(client, keys, paused.name)) == 8, 60, "it holds all 8")
        wait_for(flowing, 90, "every job mid-stream on the worker to pause")
        paused.signal(signal.SIGSTOP)
        try:
            rescuer = _start(cluster_fleet, "cl-rescuer")
            wait_for(
                lambda: all(client.exists(keys.result(i)) for i in ids),
                180,
                "every job finished by the rescuer",
            )
            assert pending_to(client, keys, paused.name) == []
        finally:
            woke_at = time.time()
            paused.signal(signal.SIGCONT)
        yielded = [s.result() for s in streams]

    def dropped() -> bool:  # a heartbeat after waking, holding nothing
        assert paused.proc.poll() is None, paused.output()
        score = client.zscore(keys.workers(), paused.name)
        info = cluster_fleet.info(paused)
        return score is not None and score > woke_at and info.get("held_jobs") == 0

    wait_for(dropped, 90, "the woken worker to drop the jobs it lost")
    for handle, events in zip(handles, yielded, strict=True):
        result = handle.result(timeout=30)
        assert result.worker == rescuer.name
        raw = replay(client, keys, handle.id)
        finishes = [n for n, e in enumerate(raw) if isinstance(e, FinishEvent)]
        assert finishes == [len(raw) - 1], f"{handle.id}: finish events at {finishes}"
        tokens = [e for e in raw if isinstance(e, TokenEvent)]
        assert [e.index for e in tokens] == list(range(300)), f"{handle.id}: an index twice"
        assert [e.token_id for e in tokens] == result.token_ids
        assert [e.token_id for e in events] == result.token_ids  # the client saw the same
        assert "".join(e.text for e in events) == result.text
    assert "belongs to another worker now" in paused.output()
    for part in keys.partitions_all:
        assert [client.xlen(b.stream) for b in keys.bands(None, part)] == [0, 0, 0]
        assert client.xlen(keys.dead_letters(part)) == 0


# ---- the Batch API ----------------------------------------------------------------------


def chat_line(custom_id: str, text: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_a_batch_runs_every_line_on_a_cluster(
    redis_cluster: RedisCluster, cluster_fleet: Fleet, client: Client
) -> None:
    worker = _start(cluster_fleet, "cl-batch-w", "--max-active", "8")
    cluster_fleet.wait_alive(worker)
    producer = _producer(redis_cluster)
    keys = producer.keys
    gateway = ServedGateway(
        GatewayConfig(redis_url=redis_cluster.url, partitions=PARTITIONS, fleet_cache_s=0.0)
    )
    try:
        openai_client = gateway.client()
        requests = [chat_line(f"q{i}", f"question number {i}", 3 + i) for i in range(8)]
        upload = openai_client.files.create(file=("in.jsonl", jsonl(requests)), purpose="batch")
        batch = openai_client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        line_jobs = [job_id_for(batch.id, i) for i in range(len(requests))]
        assert len({keys.partition_of(j) for j in line_jobs}) > 1
        seen: list[Any] = []

        def ended() -> bool:
            seen.append(openai_client.batches.retrieve(batch.id))
            return seen[-1].status in ("completed", "failed", "cancelled", "expired")

        wait_for(ended, 120, f"batch {batch.id} to end")
        done = seen[-1]
        assert done.status == "completed", done.errors
        counts = done.request_counts
        assert counts is not None and (counts.total, counts.completed, counts.failed) == (8, 8, 0)
        assert done.output_file_id and not done.error_file_id
        out = [
            json.loads(x)
            for x in openai_client.files.content(done.output_file_id).text.splitlines()
        ]
        assert [line["custom_id"] for line in out] == [f"q{i}" for i in range(8)]
        for i, line in enumerate(out):
            assert line["error"] is None and line["response"]["status_code"] == 200
            body = line["response"]["body"]
            assert body["usage"]["completion_tokens"] == 3 + i
            # the line's job ran in its partition; its answer is the fleet's greedy one
            result = producer.handle(line_jobs[i]).result(timeout=5)
            assert body["choices"][0]["message"]["content"] == result.text
            asked = dict(requests[i]["body"])
            direct = openai_client.chat.completions.create(
                **{k: v for k, v in asked.items() if k != "ignore_eos"},
                extra_body={"ignore_eos": True},
            )
            assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        # the batch left the open batches and its results hash, on whichever node they are
        assert client.smembers(keys.open_batches()) == set()
        assert not client.exists(keys.batch_results(batch.id))
        assert openai_client.files.delete(upload.id).deleted
        assert batch.id in [b.id for b in openai_client.batches.list(limit=10).data]
    finally:
        gateway.stop()


def test_tokenfleet_batch_run_on_a_cluster_writes_every_line_once(
    redis_cluster: RedisCluster, cluster_fleet: Fleet, tmp_path: Path
) -> None:
    worker = _start(cluster_fleet, "cl-batch-cli-w", "--max-active", "8")
    source, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    asked = [2 + i for i in range(10)]
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "default", "prompt": f"item {i}", "max_tokens": n, "temperature": 0},
        }
        for i, n in enumerate(asked)
    ]
    source.write_bytes(jsonl(lines))
    cluster_fleet.wait_alive(worker)
    args = [sys.executable, "-m", "tokenfleet.cli", "batch", "run", str(source), "-o", str(out)]
    args += ["--max-in-flight", "4", "--quiet", "--redis-url", redis_cluster.url]
    env = {**os.environ, **PARTITIONS_ENV, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr.decode()
    assert b"10 done, 0 failed of 10" in run.stdout
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(str(x["custom_id"]) for x in written) == sorted(f"r{i}" for i in range(10))
    producer = _producer(redis_cluster)
    batch_id = batch_id_for_file(source.read_bytes())
    assert len({producer.keys.partition_of(job_id_for(batch_id, i)) for i in range(10)}) > 1
    for line in written:
        index = int(str(line["custom_id"])[1:])
        body = line["response"]["body"]
        result = producer.handle(job_id_for(batch_id, index)).result(timeout=5)
        assert body["usage"]["completion_tokens"] == asked[index] == len(result.token_ids)
        assert body["choices"][0]["text"] == result.text


# ---- priorities ---------------------------------------------------------------------------


def _ids_by_partition(keys: Keys, prefix: str, per_partition: list[int]) -> list[str]:
    """Job ids `PREFIX-N`, `per_partition[p]` of them in partition p (in id order)."""
    need = list(per_partition)
    ids: list[str] = []
    n = 0
    while any(need):
        job_id = f"{prefix}-{n}"
        part = keys.partition_of(job_id)
        if need[part]:
            need[part] -= 1
            ids.append(job_id)
        n += 1
    return ids


def _first_tokens(c: Client, producer: Producer, ids: list[str]) -> dict[str, float]:
    """Each job's first token, in unix seconds: its submit time + its time to first token."""
    out = {}
    for job_id in ids:
        ttft = producer.handle(job_id).result(timeout=60).timings.ttft_s
        submitted = c.hget(producer.keys.job(job_id), "submitted_at")
        assert ttft is not None and submitted is not None, job_id
        out[job_id] = float(submitted) + ttft
    return out


@pytest.fixture(scope="module")
def one_slot_run(
    _session_cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, float], list[str], list[str], Keys]]:
    """Batch jobs (2 a partition) and interactive ones (p + 1 in partition p) queued,
    then one sim-runner worker with one slot serves them all: each job's first token."""
    cluster = _session_cluster
    for port in cluster.master_ports():
        node = cluster.node_client(port)
        node.flushall()
        node.close()
    producer = _producer(cluster)
    keys = producer.keys
    batch = _ids_by_partition(keys, "bulk", [2] * PARTITIONS)
    interactive = _ids_by_partition(keys, "chat", [p + 1 for p in range(PARTITIONS)])
    for ids, band in ((batch, "batch"), (interactive, "interactive")):  # the batch ones first
        for job_id in ids:
            producer.submit(
                GenerationRequest(
                    job_id=job_id,
                    prompt_ids=[1, 2, 3],
                    max_new_tokens=6,
                    ignore_eos=True,
                    priority=band,  # type: ignore[arg-type]
                )
            )
    workers = LocalWorkers(
        cluster.url,
        worker_args=["--runner", "sim", "--sim-tok-s", "2000", "--verbose"],
        log_dir=tmp_path_factory.mktemp("one-slot"),
        env={**PARTITIONS_ENV, "OMP_NUM_THREADS": "1"},
    )
    try:
        workers.start_one("cl-one-slot", ["--burst", "--max-active", "1", "--max-batch", "1"])
        assert workers.wait("cl-one-slot", 120) == 0, workers.log("cl-one-slot")
        c = connect(cluster.url)
        first = _first_tokens(c, producer, batch + interactive)
        c.close()
    finally:
        workers.kill_all()
    yield first, interactive, batch, keys


def test_with_one_slot_each_partitions_interactive_jobs_start_before_its_batch_jobs(
    one_slot_run: tuple[dict[str, float], list[str], list[str], Keys],
) -> None:
    first, interactive, batch, keys = one_slot_run
    assert len(first) == len(interactive) + len(batch)  # every job ran (no starvation)
    for part in keys.partitions_all:
        mine_i = [first[j] for j in interactive if keys.partition_of(j) == part]
        mine_b = [first[j] for j in batch if keys.partition_of(j) == part]
        assert mine_i and mine_b
        assert max(mine_i) < min(mine_b), f"partition {part}: a batch job went first"


def test_with_one_slot_interactive_jobs_of_every_partition_start_before_any_batch_job(
    one_slot_run: tuple[dict[str, float], list[str], list[str], Keys],
) -> None:
    first, interactive, batch, _keys = one_slot_run
    late = [j for j in interactive if first[j] > min(first[b] for b in batch)]
    assert late == [], f"{len(late)} interactive jobs started after a batch job"
