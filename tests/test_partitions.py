"""A partitioned queue (keys.py: `partitions` P, a hash tag per partition): the layout a
fleet on Redis Cluster needs, where a script may touch the keys of one hash slot only.

Proven on one real redis-server with real worker processes: MONITOR records every
command the producer and the worker send, and every script call and every multi-stream
read touches keys of one slot. With P = 1 the names are those of an unpartitioned fleet."""

from __future__ import annotations

import threading
import zlib
from collections import Counter

import pytest
import redis
from redis.crc import key_slot

from tests.helpers.workers import Fleet, WorkerProcess, in_process
from tokenfleet.keys import Keys
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest
from tokenfleet.reasons import FinishReason
from tokenfleet.status import fleet_status
from tokenfleet.tenants import get_limits, set_limits


def slot(key: str | bytes) -> int:
    return int(key_slot(key.encode() if isinstance(key, str) else key))


def test_one_partition_keeps_the_names_of_an_unpartitioned_fleet() -> None:
    k = Keys()
    assert k.job("abc") == "tokenfleet:job:abc"
    assert k.events("abc") == "tokenfleet:job:abc:events"
    assert k.jobs("m", "batch") == "tokenfleet:jobs:m@batch"
    assert k.queue_cap("m") == "tokenfleet:jobs:m:cap"
    assert k.tenant_limits(None) == "tokenfleet:tenant:*:limits"
    assert k.dead_letters() == "tokenfleet:dead"
    assert k.alive("w") == k.worker("w")  # the heartbeat hash itself


def test_a_jobs_keys_and_its_partitions_queue_share_one_slot() -> None:
    k = Keys(partitions=8)
    for job_id in ("a", "job-1", "x" * 128, "Z.9_-"):
        p = k.partition_of(job_id)
        assert p == zlib.crc32(job_id.encode()) % 8  # what a client in any language computes
        keys = [k.job(job_id), k.events(job_id), k.result(job_id), k.cancel(job_id)]
        keys += [k.channel(job_id), k.jobs("m", "interactive", p), k.queue_cap("m", p)]
        keys += [k.pulls("m", p), k.tenant_queued("t", "m", p), k.tenant_running("t", "m", p)]
        keys += [k.tenant_limits("t", p), k.tenant_limits(None, p), k.models(p), k.tenants(p)]
        keys += [k.dead_letters(p), k.alive("w", p)]
        assert len({slot(key) for key in keys}) == 1, job_id
    spread = Counter(k.partition_of(f"job-{i}") for i in range(4000))
    assert sorted(spread) == list(range(8)) and min(spread.values()) > 400  # ~500 each
    assert Keys(tagged=True).job("a") == "tokenfleet:{p0}:job:a"  # a cluster with P = 1
    with pytest.raises(ValueError, match="braces"):
        Keys("tf{x}:", partitions=2)


class Monitor:
    """Every command the server runs while it is open (MONITOR, on a thread)."""

    def __init__(self, client: redis.Redis) -> None:
        self.commands: list[list[str]] = []
        self._client = client
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        with self._client.monitor() as m:
            self._ready.set()
            for record in m.listen():
                if self._stop.is_set():
                    return
                self.commands.append(_words(record["command"]))

    def close(self) -> None:
        self._stop.set()
        self._client.ping()  # one more command wakes the listener
        self._thread.join(10)


def _words(command: str) -> list[str]:
    import shlex

    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def _slots_touched(words: list[str]) -> set[int] | None:
    """The slots one command's keys are in, for the commands a cluster would refuse
    across slots (script calls, multi-stream reads); None for the others."""
    name = words[0].upper() if words else ""
    if name in ("EVALSHA", "EVAL") and len(words) > 2:
        n = int(words[2])
        return {slot(k) for k in words[3 : 3 + n]}
    if name == "XREADGROUP" and "STREAMS" in (w.upper() for w in words):
        at = [w.upper() for w in words].index("STREAMS")
        rest = words[at + 1 :]
        return {slot(k) for k in rest[: len(rest) // 2]}
    return None


def test_a_partitioned_fleet_serves_every_job_with_one_slot_per_script_call(
    fleet: Fleet, r: redis.Redis
) -> None:
    keys = Keys(partitions=4)
    producer = Producer(r, keys=keys)
    producer.set_queue_cap(50)
    set_limits(r, keys, "alpha", max_running=8)
    requests = [
        GenerationRequest(
            job_id=f"part-{i}",
            prompt=f"partition {i}",
            max_new_tokens=12,
            ignore_eos=True,
            tenant="alpha" if i % 2 else "default",
            priority=("interactive", "default", "batch")[i % 3],
        )
        for i in range(24)
    ]
    # no socket timeout: the worker may load in silence for longer than r's allows
    kwargs = r.connection_pool.connection_kwargs
    monitor = Monitor(redis.Redis(host=kwargs["host"], port=kwargs["port"], socket_timeout=3600))
    try:
        handles = [producer.submit(req) for req in requests]
        assert len({keys.partition_of(h.id) for h in handles}) == 4  # every partition used
        fleet.local.start_one("part-w", ["--burst"], env={"TOKENFLEET_PARTITIONS": "4"})
        worker = WorkerProcess("part-w", fleet.local)
        fleet.workers.append(worker)
        expected = in_process(requests)
        for handle in handles:
            events = list(handle.stream(timeout=120))
            result = handle.result(timeout=60)
            assert result.finish_reason == FinishReason.LENGTH
            assert [e.token_id for e in events] == result.token_ids
            assert result.token_ids == expected[handle.id].token_ids
        assert worker.wait(120) == 0, worker.output()
    finally:
        monitor.close()

    checked: Counter[str] = Counter()
    for words in monitor.commands:
        touched = _slots_touched(words)
        if touched is None:
            continue
        checked[words[0].upper()] += 1
        assert len(touched) <= 1, f"a call across slots: {words[:12]}"
    assert checked["EVALSHA"] + checked["EVAL"] >= 24 + 4  # submits, pulls, accepts, ticks
    assert checked["XREADGROUP"] >= 1

    snapshot = fleet_status(r, keys)  # the operator's view adds the partitions up
    assert all(q["depth"] == 0 for q in snapshot["queues"])
    assert snapshot["tenants"]["alpha"]["effective"]["max_running"] == 8
    for p in keys.partitions_all:  # each partition's copy of what operators set
        assert r.get(keys.queue_cap(None, p)) == b"50"
        assert r.hget(keys.tenant_limits("alpha", p), "max_running") == b"8"
    assert get_limits(r, keys, "alpha").max_running == 8
