"""Faults against real worker processes and a real redis-server: kill -9 under load,
SIGTERM drains, cancels, deadlines, garbage in the jobs stream, a Redis restart, a
poison job, and replies lost in transit. Every wait is on a condition; nothing asserts
on wall-clock time. Printed (run with -s): the kill -9 and garbage numbers."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from tests.helpers.proxies import LostReplyProxy
from tests.helpers.support import KEYS, wait_for
from tests.helpers.workers import Fleet, WorkerProcess, collect, in_process
from tokenfleet.errors import JobFailed, JobNotFound
from tokenfleet.keys import GROUP
from tokenfleet.local import RedisServer
from tokenfleet.lua import PULL_LUA
from tokenfleet.model import load_model
from tokenfleet.producer import JobHandle, Producer
from tokenfleet.protocol import (
    MAX_PAYLOAD_BYTES,
    FinishEvent,
    GenerationRequest,
    JobResult,
    TokenEvent,
    decode_events,
    encode,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig
from tokenfleet.worker.loop import Worker, WorkerOptions
from tokenfleet.worker.recovery import Delivery

pytestmark = pytest.mark.fault

STREAM = KEYS.jobs()


# ---- helpers -----------------------------------------------------------------------


def text_prompt(rng: random.Random, low: int = 1, high: int = 120) -> str:
    return "".join(rng.choice(string.ascii_letters + " .,") for _ in range(rng.randint(low, high)))


def greedy_jobs(prefix: str, count: int, seed: int, low: int = 4, high: int = 40) -> list[Any]:
    rng = random.Random(seed)
    return [
        GenerationRequest(
            job_id=f"{prefix}-{i:03d}",
            prompt=text_prompt(rng),
            max_new_tokens=rng.randint(low, high),
            ignore_eos=True,
        )
        for i in range(count)
    ]


def replay(r: redis.Redis, job_id: str) -> list[TokenEvent | FinishEvent]:
    """The job's raw replay stream, decoded, in stream order."""
    return [e for _id, f in r.xrange(KEYS.events(job_id)) for e in decode_events(f[b"m"])]


def check_replay(r: redis.Redis, job_id: str, *, exactly_once: bool = True) -> FinishEvent:
    """One finish event, last; token indices 0..n-1 (n = its completion tokens).

    `exactly_once`: each index appears once, in order. Otherwise a worker may have
    re-sent events (after a reconnect): every index must still be there, and every
    copy of an index must carry the same token."""
    events = replay(r, job_id)
    finishes = [e for e in events if isinstance(e, FinishEvent)]
    assert len(finishes) == 1, f"{job_id}: {len(finishes)} finish events"
    assert isinstance(events[-1], FinishEvent), f"{job_id}: events after the finish"
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    n = finishes[0].usage.completion_tokens
    if exactly_once:
        assert [e.index for e in tokens] == list(range(n)), job_id
    else:
        by_index: dict[int, int] = {}
        for e in tokens:
            assert by_index.setdefault(e.index, e.token_id) == e.token_id, (job_id, e.index)
        assert sorted(by_index) == list(range(n)), job_id
    return finishes[0]


def queue_empty(r: redis.Redis) -> bool:
    return r.xlen(STREAM) == 0 and r.xpending(STREAM, GROUP)["pending"] == 0


def pending_entries(r: redis.Redis, consumer: str) -> list[str]:
    try:
        rows = r.xpending_range(STREAM, GROUP, "-", "+", 1000, consumername=consumer)
    except redis.ResponseError as exc:
        if str(exc).startswith("NOGROUP"):  # no worker has created the group yet
            return []
        raise
    return [row["message_id"].decode() for row in rows]


def token_count(r: redis.Redis, job_ids: list[str]) -> dict[str, int]:
    pipe = r.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.xlen(KEYS.events(job_id))
    return dict(zip(job_ids, pipe.execute(), strict=True))


def dead_letters(r: redis.Redis) -> dict[str, dict[str, bytes]]:
    """Dead-letter records by the jobs-stream entry they came from."""
    records = r.xrange(KEYS.dead_letters())
    by_entry = {fields[b"entry"].decode(): fields for _id, fields in records}
    assert len(by_entry) == len(records), "an entry was dead-lettered twice"
    return by_entry


def stop(worker: WorkerProcess) -> None:
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.output()


# ---- 1. kill -9 under load -------------------------------------------------------------


def test_kill9_under_load_every_job_finishes_once_in_order(fleet: Fleet, r: redis.Redis) -> None:
    requests = greedy_jobs("load", 200, seed=1)
    by_id = {req.job_id: req for req in requests}
    producer = Producer(r)
    handles = [outcome.handle for outcome in producer.submit_many(requests) if outcome.handle]
    assert len(handles) == len(requests)
    job_of_entry = {h.entry_id: h.id for h in handles}
    workers = [fleet.start(f"load-w{i}") for i in range(3)]

    with ThreadPoolExecutor(max_workers=24) as pool:
        streams = {h.id: pool.submit(collect, h) for h in handles}

        # The victim: once 20 jobs are done, a worker holding at least three jobs
        # mid-generation (tokens out, not near their end).
        victim: list[WorkerProcess] = []

        def victim_ready() -> bool:
            done = sum(1 for v in r.mget([KEYS.result(j) for j in by_id]) if v is not None)
            if done < 20:
                return False
            for worker in workers:
                jobs = [job_of_entry[e] for e in pending_entries(r, worker.name)]
                out = token_count(r, jobs)
                mid = [j for j in jobs if 1 <= out[j] <= by_id[j].max_new_tokens - 5]
                if len(mid) >= 3:
                    victim.append(worker)
                    return True
            return False

        wait_for(victim_ready, 90, "a worker holding jobs mid-generation")
        dead = victim[0]
        dead.kill()
        killed_at = time.monotonic()
        orphans = [job_of_entry[e] for e in pending_entries(r, dead.name)]
        out_at_kill = token_count(r, orphans)
        wait_for(lambda: not pending_entries(r, dead.name), 60, "the orphans to be claimed")
        recovery_s = time.monotonic() - killed_at
        for worker in workers:
            if worker is not dead:
                assert worker.wait(120) == 0, worker.output()
        yielded = {job_id: future.result() for job_id, future in streams.items()}

    expected = in_process(requests)
    results: dict[str, JobResult] = {}
    for handle in handles:
        result = handle.result(timeout=10)
        results[handle.id] = result
        events = yielded[handle.id]
        assert result.finish_reason == FinishReason.LENGTH, handle.id
        want = expected[handle.id].token_ids
        assert [e.token_id for e in events] == result.token_ids == want, handle.id
        assert "".join(e.text for e in events) == result.text, handle.id
        finish = check_replay(r, handle.id)
        assert finish.worker == result.worker
    assert orphans, "the victim held no jobs when it was killed"
    assert all(results[j].worker != dead.name for j in orphans)
    mid_stream = [j for j in orphans if out_at_kill[j] > 0]
    assert mid_stream, "no job was resumed mid-stream"
    assert queue_empty(r)
    assert r.xlen(KEYS.dead_letters()) == 0
    claim_logs = [w.output().count("orphaned job") for w in workers if w is not dead]
    print(
        f"\nkill -9: {len(requests)} jobs; {dead.name} killed holding {len(orphans)} "
        f"({len(mid_stream)} mid-stream, {sum(out_at_kill.values())} tokens already out); "
        f"all resumed by the survivors (claim log lines {claim_logs}); "
        f"orphans claimed {recovery_s:.1f}s after the kill"
    )


# ---- 2. SIGTERM drain --------------------------------------------------------------------


def _in_flight(r: redis.Redis, worker: WorkerProcess, handles: list[JobHandle]) -> bool:
    pending = set(pending_entries(r, worker.name))
    if not all(h.entry_id in pending for h in handles):
        return False
    return all(n >= 1 for n in token_count(r, [h.id for h in handles]).values())


def test_sigterm_drains_in_flight_jobs_and_pulls_nothing_new(fleet: Fleet, r: redis.Redis) -> None:
    requests = greedy_jobs("drain", 4, seed=2, low=400, high=500)
    producer = Producer(r)
    handles = [producer.submit(req) for req in requests]
    w1 = fleet.start("drain-w1", "--drain-timeout", "300", burst=False)
    wait_for(lambda: _in_flight(r, w1, handles), 60, "four jobs in flight on drain-w1")
    w1.signal(signal.SIGTERM)
    w1.wait_log("draining")
    late = [producer.submit(req) for req in greedy_jobs("late", 2, seed=3)]
    # Submitted while the drain was under way (no result yet), yet never pulled.
    assert not any(r.exists(KEYS.result(h.id)) for h in handles)
    assert w1.wait(120) == 0, w1.output()
    expected = in_process(requests)

    for handle in handles:
        result = handle.result(timeout=10)
        assert result.worker == "drain-w1"
        assert result.finish_reason == FinishReason.LENGTH
        assert result.token_ids == expected[handle.id].token_ids
        check_replay(r, handle.id)
    # The jobs submitted after the signal were never read: still queued, pending to nobody.
    assert r.xlen(STREAM) == 2
    assert r.xpending(STREAM, GROUP)["pending"] == 0
    assert {h.status().status for h in late} == {"queued"}
    assert not r.exists(KEYS.worker("drain-w1"))

    w2 = fleet.start("drain-w2")
    assert w2.wait(120) == 0, w2.output()
    for handle in late:
        assert handle.result(timeout=10).worker == "drain-w2"
        check_replay(r, handle.id)
    assert queue_empty(r)


def test_sigterm_drain_timeout_hands_leftovers_to_another_worker(
    fleet: Fleet, r: redis.Redis
) -> None:
    requests = greedy_jobs("handback", 4, seed=4, low=300, high=400)
    producer = Producer(r)
    handles = [producer.submit(req) for req in requests]
    w1 = fleet.start("handback-w1", "--drain-timeout", "0.2", burst=False)
    with ThreadPoolExecutor(max_workers=4) as pool:
        streams = [pool.submit(collect, h) for h in handles]
        wait_for(lambda: _in_flight(r, w1, handles), 60, "four jobs in flight on handback-w1")
        w1.signal(signal.SIGTERM)
        assert w1.wait(60) == 0, w1.output()
        assert "handing back 4 unfinished job(s)" in w1.output()
        out_at_exit = token_count(r, [h.id for h in handles])
        w2 = fleet.start("handback-w2")
        assert w2.wait(120) == 0, w2.output()
        yielded = [future.result() for future in streams]
    expected = in_process(requests)

    for handle, events in zip(handles, yielded, strict=True):
        result = handle.result(timeout=10)
        assert result.worker == "handback-w2"  # w1 could not finish 300+ tokens in 0.2 s
        assert result.finish_reason == FinishReason.LENGTH
        assert [e.token_id for e in events] == result.token_ids == expected[handle.id].token_ids
        check_replay(r, handle.id)
        assert 1 <= out_at_exit[handle.id] < len(result.token_ids)  # resumed mid-stream
    assert queue_empty(r)
    assert r.xlen(KEYS.dead_letters()) == 0


# ---- 3. cancel ---------------------------------------------------------------------------


def test_cancel_stops_a_running_and_a_queued_job_and_frees_kv(fleet: Fleet, r: redis.Redis) -> None:
    producer = Producer(r)
    worker = fleet.start("cancel-w", "--max-active", "1", burst=False)
    running = producer.submit(
        job_id="cancel-running", prompt="tell me a long story", max_new_tokens=2000, ignore_eos=True
    )
    queued = producer.submit(
        job_id="cancel-queued", prompt="x" * 500, max_new_tokens=50, ignore_eos=True
    )
    stream = running.stream(timeout=60)
    first = [next(stream) for _ in range(5)]

    def second_waits() -> bool:
        info = fleet.info(worker)
        return info.get("waiting") == 1 and info["kv_used_bytes"] > 0

    wait_for(second_waits, 30, "the second job waiting behind the first, KV in use")

    assert queued.cancel()
    result = queued.result(timeout=30)
    assert result.finish_reason == FinishReason.CANCELLED
    assert result.token_ids == [] and result.usage.completion_tokens == 0
    assert check_replay(r, queued.id).reason == FinishReason.CANCELLED

    assert running.cancel()
    rest = list(stream)
    assert running.finish is not None and running.finish.reason == FinishReason.CANCELLED
    events = first + rest
    assert [e.index for e in events] == list(range(len(events)))
    assert running.finish.usage.completion_tokens == len(events) < 2000
    assert running.result(timeout=10).token_ids == [e.token_id for e in events]
    assert not running.cancel()  # finished: nothing to cancel

    def idle() -> bool:
        info = fleet.info(worker)
        return info.get("active") == 0 and info["waiting"] == 0 and info["kv_used_bytes"] == 0

    wait_for(idle, 30, "the worker idle with its KV back to zero")
    # Nothing was produced after the finish event, and the queued job never prefilled.
    check_replay(r, running.id)
    prompt_tokens = running.finish.usage.prompt_tokens
    assert fleet.info(worker)["prefill_tokens_total"] == prompt_tokens
    assert fleet.info(worker)["finished_by_reason"] == {"cancelled": 2}
    assert queue_empty(r)
    assert worker.proc.poll() is None
    stop(worker)


# ---- 4. deadline -------------------------------------------------------------------------


def test_deadline_passed_while_queued_ends_the_job_before_prefill(
    fleet: Fleet, r: redis.Redis
) -> None:
    producer = Producer(r)
    worker = fleet.start("deadline-w", "--max-active", "1", "--max-waiting", "1", burst=False)
    ahead = producer.submit(
        job_id="deadline-ahead", prompt="the long job", max_new_tokens=2000, ignore_eos=True
    )
    stream = ahead.stream(timeout=60)
    next(stream)  # running
    long_prompt = "y" * 1500  # + 8 new tokens: within the 2048-token context
    past = producer.submit(
        job_id="deadline-past", prompt=long_prompt, max_new_tokens=8, deadline=time.time() - 1
    )
    soon = producer.submit(
        job_id="deadline-soon", prompt=long_prompt, max_new_tokens=8, deadline=time.time() + 1
    )
    for handle in (past, soon):
        result = handle.result(timeout=60)
        assert result.finish_reason == FinishReason.DEADLINE
        assert result.token_ids == [] and result.usage.completion_tokens == 0
        assert check_replay(r, handle.id).reason == FinishReason.DEADLINE
    assert not r.exists(KEYS.result(ahead.id))  # still running: the deadline passed in the queue

    assert ahead.cancel()
    list(stream)
    assert ahead.finish is not None and ahead.finish.reason == FinishReason.CANCELLED

    def idle() -> bool:
        info = fleet.info(worker)
        return info.get("active") == 0 and info["waiting"] == 0

    wait_for(idle, 30, "the worker idle")
    info = fleet.info(worker)
    # Only the job ahead was prefilled; neither 1500-token prompt was.
    assert info["prefill_tokens_total"] == ahead.finish.usage.prompt_tokens < 1500
    assert info["finished_by_reason"] == {"deadline": 2, "cancelled": 1}
    assert queue_empty(r)
    stop(worker)


# ---- 5. garbage in the jobs stream -------------------------------------------------------


SPOOF = b"<the id of a job submitted before>"


def _garbage(rng: random.Random, i: int) -> tuple[dict[Any, Any], str | None]:
    """One malformed jobs-stream entry: (fields, the job id its client should be told about).

    A `job_id` of SPOOF is replaced, when the entry is added, with the id of a valid
    job submitted earlier: such an entry must not end that job."""
    job_id = f"junk-{i:03d}"

    def pack(obj: Any) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]

    good = {"v": 1, "job_id": job_id, "prompt": "hi", "max_new_tokens": 4}
    kind = i % 20
    if kind == 0:  # random bytes
        return {"job_id": job_id, "payload": rng.randbytes(rng.randint(1, 300))}, job_id
    if kind == 1:  # wrong types
        bad = {**good, "max_new_tokens": "ten", "prompt": 123}
        return {"job_id": job_id, "payload": pack(bad)}, job_id
    if kind == 2:  # over the payload limit (a few of these: they are big)
        if i % 100 == 2:
            return {"job_id": job_id, "payload": b"\x00" * (MAX_PAYLOAD_BYTES + 1)}, job_id
        return {"job_id": job_id, "payload": pack({**good, "prompt": "p" * 70_000})}, job_id
    if kind == 3:  # negative lengths
        field = ["max_new_tokens", "prompt_ids"][i % 2]
        bad = {**good, "max_new_tokens": -rng.randint(1, 99)}
        if field == "prompt_ids":
            bad = {**good, "prompt": None, "prompt_ids": [-1, 5]}
        return {"job_id": job_id, "payload": pack(bad)}, job_id
    if kind == 4:  # unknown versions
        version = [2, 0, "1", 1.0, True, None][i % 6]
        return {"job_id": job_id, "payload": pack({**good, "v": version})}, job_id
    if kind == 5:  # no version
        bad = dict(good)
        del bad["v"]
        return {"job_id": job_id, "payload": pack(bad)}, job_id
    if kind == 6:  # no payload field
        return {"job_id": job_id, "data": b"where is it"}, job_id
    if kind == 7:  # the entry's job id differs from the payload's
        return {"job_id": job_id, "payload": pack({**good, "job_id": f"other-{i}"})}, job_id
    if kind == 8:  # valid msgpack, not a map
        value = [[1, 2, 3], "a string", 42, None, b"bytes"][i % 5]
        return {"job_id": job_id, "payload": pack(value)}, job_id
    if kind == 9:  # JSON garbage
        text = ['{"v": 1, "job_id": ', "{not json}", '{"v": 1}}}', "{" * 5000][i % 4]
        return {"job_id": job_id, "payload": text.encode()}, job_id
    if kind == 10:  # JSON object that fails validation (its id is readable)
        bad = {**good, "sampling": {"temperature": -1}}
        return {"job_id": job_id, "payload": json.dumps(bad).encode()}, job_id
    if kind == 11:  # unreadable entry job ids: nobody can be told
        raw_id = [b"has space", b"\xff\xfe", b"a:b", b"x" * 200][i % 4]
        return {"job_id": raw_id, "payload": rng.randbytes(20)}, None
    if kind == 12:  # no job id anywhere, payload garbage
        return {"payload": rng.randbytes(10)}, None
    if kind == 13:  # unknown fields, NaN, non-string map keys, deep nesting
        bad_obj: Any = [
            {**good, "priority": 9},
            {**good, "sampling": {"temperature": float("nan")}},
            {1: 2, "v": 1},
            {**good, "metadata": {"deep": [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]}},
        ][i % 4]
        return {"job_id": job_id, "payload": pack(bad_obj)}, job_id
    if kind == 14:  # a huge entry job id field
        return {"job_id": b"j" * 100_000, "payload": pack(good)}, None
    if kind == 15:  # payload names a valid job but the entry names none
        return {"payload": pack({**good, "job_id": f"nameless-{i}"})}, None
    if kind == 16:  # spoof: the entry names a real job, the payload is garbage
        return {"job_id": SPOOF, "payload": rng.randbytes(8)}, None
    if kind == 17:  # spoof: the entry names a real job, the payload names another id
        return {"job_id": SPOOF, "payload": pack(good)}, None
    if kind == 18:  # empty payload
        return {"job_id": job_id, "payload": b""}, job_id
    # kind 19: a prompt over its character limit as JSON
    return {"job_id": job_id, "payload": json.dumps({**good, "prompt": "q" * 70_000})}, job_id


def test_garbage_entries_are_dead_lettered_and_valid_jobs_still_finish(
    fleet: Fleet, r: redis.Redis
) -> None:
    rng = random.Random(5)
    valid = greedy_jobs("valid", 50, seed=6, low=4, high=24)
    items: list[GenerationRequest | tuple[dict[Any, Any], str | None]] = [*valid[1:]]
    items += [_garbage(rng, i) for i in range(500)]
    rng.shuffle(items)
    items.insert(0, valid[0])  # so a spoofing entry always has a job to name
    worker = fleet.start("garbage-w", burst=False)
    fleet.wait_alive(worker)
    producer = Producer(r)
    handles: list[JobHandle] = []
    told: dict[str, str] = {}  # garbage entry id -> job id whose client gets `rejected`
    garbage_entries: set[str] = set()
    for item in items:
        if isinstance(item, GenerationRequest):
            handles.append(producer.submit(item))
        else:
            fields, job_id = item
            if fields.get("job_id") == SPOOF:
                fields = {**fields, "job_id": rng.choice(handles).id}
            entry = r.xadd(STREAM, fields).decode()
            garbage_entries.add(entry)
            if job_id is not None:
                told[entry] = job_id
    wait_for(lambda: r.xlen(KEYS.dead_letters()) >= 500, 120, "500 dead letters")
    wait_for(lambda: queue_empty(r), 120, "the jobs stream to empty")
    expected = in_process(valid)

    for handle in handles:
        result = handle.result(timeout=30)
        assert result.finish_reason == FinishReason.LENGTH
        assert result.token_ids == expected[handle.id].token_ids
        check_replay(r, handle.id)  # spoofed entries naming it added no terminal event
    dead = dead_letters(r)
    assert set(dead) == garbage_entries
    assert all(fields[b"reason"] and fields[b"message"] for fields in dead.values())
    for entry, job_id in told.items():
        # XADDed around the submit script: the job was never submitted, so the dead
        # letter names it but the fleet creates no state, events or result for it.
        assert dead[entry][b"job_id"].decode() == job_id
        assert not r.exists(KEYS.job(job_id), KEYS.result(job_id), KEYS.events(job_id))
        with pytest.raises(JobNotFound):
            producer.handle(job_id).result(timeout=10)
    reasons = sorted({fields[b"reason"].decode() for fields in dead.values()})
    print(f"\ngarbage: {len(dead)} dead letters, reasons {reasons}; {len(told)} clients told")
    assert worker.proc.poll() is None, worker.output()
    stop(worker)


# ---- 6. Redis restarted (AOF) ------------------------------------------------------------


def test_worker_reconnects_after_a_redis_restart_and_finishes_every_job(
    aof_redis: RedisServer, tmp_path: Path
) -> None:
    fleet = Fleet(aof_redis.url, tmp_path)
    client = redis.Redis.from_url(aof_redis.url)
    try:
        requests = greedy_jobs("restart", 24, seed=8, low=60, high=120)
        producer = Producer(client)
        handles = [producer.submit(req) for req in requests]
        worker = fleet.start("restart-w")
        wait_for(lambda: _in_flight(client, worker, handles[:4]), 60, "jobs in flight")
        aof_redis.stop()
        worker.wait_log("redis unavailable")
        aof_redis.start()
        worker.wait_log("reconnected")
        assert worker.wait(120) == 0, worker.output()
        expected = in_process(requests)
        for handle in handles:
            result = handle.result(timeout=10)
            assert result.finish_reason == FinishReason.LENGTH
            events = collect(handle, timeout=10)
            assert [e.token_id for e in events] == result.token_ids == expected[handle.id].token_ids
            check_replay(client, handle.id)  # each index once, even across the restart
        assert queue_empty(client)
        assert client.xlen(KEYS.dead_letters()) == 0
    finally:
        fleet.stop_all()
        client.close()


# ---- 7. poison job -----------------------------------------------------------------------


def test_poison_job_is_dead_lettered_after_max_deliveries_and_its_batch_finishes(
    fleet: Fleet, r: redis.Redis
) -> None:
    producer = Producer(r)
    good = greedy_jobs("batch", 6, seed=9, low=20, high=40)
    poison = GenerationRequest(
        job_id="poison", prompt="bad", max_new_tokens=20, metadata={"poison": True}
    )
    handles = [producer.submit(req) for req in good]
    bad = producer.submit(poison)
    worker = fleet.start(
        "poison-w", "--inject-fault-on-metadata", "poison", "--max-deliveries", "3"
    )
    assert worker.wait(120) == 0, worker.output()
    expected = in_process(good)

    with pytest.raises(JobFailed) as caught:
        bad.result(timeout=10)
    assert caught.value.reason == "engine_error"
    assert "injected fault" in caught.value.message
    finish = check_replay(r, bad.id)
    assert finish.reason == FinishReason.ERROR and finish.usage.completion_tokens == 0
    dead = dead_letters(r)
    assert list(dead) == [bad.entry_id]
    assert dead[bad.entry_id][b"reason"] == b"engine_error"
    assert dead[bad.entry_id][b"deliveries"] == b"3"
    assert dead[bad.entry_id][b"job_id"] == b"poison"
    assert encode(poison) == dead[bad.entry_id][b"payload"]
    assert worker.output().count("injected fault") >= 2  # the retries were logged
    for handle in handles:
        result = handle.result(timeout=10)
        assert result.finish_reason == FinishReason.LENGTH
        assert result.token_ids == expected[handle.id].token_ids
        check_replay(r, handle.id)
    assert queue_empty(r)


# ---- 8. lost replies and failed writes (in-process worker, injected) ------------------------


def test_lost_replies_and_failed_terminal_writes_lose_no_job(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read whose reply is lost, a tick's writes that fail before they run and a tick
    whose reply (with finishes in it) is lost after it ran: every job still finishes
    exactly once, and every token index is in its replay stream once."""
    requests = greedy_jobs("flaky", 6, seed=10, low=10, high=30)
    producer = Producer(r)
    handles = [producer.submit(req) for req in requests]
    engine = Engine(load_model("tiny-random", device="cpu"), EngineConfig(), worker="flaky-w")
    client = redis.Redis.from_url(redis_url)
    options = WorkerOptions(name="flaky-w", burst=True, idle_block_ms=50, reconnect_max_s=0.2)
    worker = Worker(engine, client, KEYS, options)
    faults = {"read": 1, "tick before": 1, "tick after": 1}

    def inject(where: str) -> None:
        if faults[where]:
            faults[where] -= 1
            raise redis.ConnectionError(f"injected: {where}")

    real_read, real_tick, real_parse = worker.queue.read, worker.queue.tick, worker.queue.parse_tick

    def read(count: int, block_ms: int | None = None) -> list[Delivery]:
        got = real_read(count, block_ms)
        if got:
            inject("read")  # the entries are pending to this worker; the reply is lost
        return got

    def tick(writes: Any, pipe: Any) -> Any:
        if any(w.end is not None for w in writes):
            inject("tick before")  # nothing of this tick reaches Redis
        return real_tick(writes, pipe)

    def parse_tick(reply: Any) -> Any:
        parsed = real_parse(reply)
        if any(p.verdict == "done" for p in parsed):
            inject("tick after")  # the writes ran; the reply saying so is lost
        return parsed

    monkeypatch.setattr(worker.queue, "read", read)
    monkeypatch.setattr(worker.queue, "tick", tick)
    monkeypatch.setattr(worker.queue, "parse_tick", parse_tick)
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(worker.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: not thread.is_alive(), 60, "the burst worker to finish every job")
    finally:
        worker.stop_now = True
        thread.join(10)
        client.close()
    assert exit_code == [0]
    assert faults == {"read": 0, "tick before": 0, "tick after": 0}
    expected = in_process(requests)
    for handle in handles:
        result = handle.result(timeout=10)
        assert result.finish_reason == FinishReason.LENGTH
        assert result.token_ids == expected[handle.id].token_ids
        check_replay(r, handle.id)  # resyncs resend every event; each index lands once
    assert queue_empty(r)
    assert r.xlen(KEYS.dead_letters()) == 0


def test_a_read_reply_lost_in_transit_strands_no_job(
    redis_server: RedisServer, r: redis.Redis, tmp_path: Path
) -> None:
    """The server hands entries to the worker (pull.lua's XREADGROUP >) but the reply never
    arrives: the entries are pending to a live worker, which nobody else may claim. The
    worker must notice (no silent client-side retry of the read) and re-read its pending
    list."""
    proxy = LostReplyProxy(redis_server.port)
    requests = greedy_jobs("lost-read", 5, seed=11, low=10, high=30)
    producer = Producer(r)
    handles = [producer.submit(req) for req in requests]
    proxy.arm(b"EVALSHA", hashlib.sha1(PULL_LUA.encode()).hexdigest().encode())
    fleet = Fleet(proxy.url, tmp_path)
    try:
        worker = fleet.start("lost-read-w")
        wait_for(lambda: worker.proc.poll() is not None, 60, "the burst worker to finish")
        assert worker.proc.returncode == 0, worker.output()
    finally:
        fleet.stop_all()
        proxy.close()
    assert proxy.cut.is_set()
    assert "reconnected" in worker.output()
    expected = in_process(requests)
    for handle in handles:
        result = handle.result(timeout=10)
        assert result.token_ids == expected[handle.id].token_ids
        check_replay(r, handle.id)
    assert queue_empty(r)
