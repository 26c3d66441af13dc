"""The fleet's edges, with real worker processes and real faults: a worker paused
(SIGSTOP) or cut off (a TCP proxy that drops everything) while another takes its
jobs over writes nothing after it wakes; entries XADDed around the submit script
never touch a job; an out-of-memory Redis is waited out; the drain deadline holds
while Redis is gone.

What must hold for every job, seeded or not: its replay stream has each token
index exactly once, then one finish event and nothing after it, and the text a
client streamed equals the stored result."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import redis

from tests.helpers.proxies import PartitionProxy
from tests.helpers.support import KEYS, wait_for
from tests.helpers.workers import Fleet, WorkerProcess
from tokenfleet.errors import JobNotFound
from tokenfleet.keys import GROUP
from tokenfleet.local import RedisServer
from tokenfleet.producer import JobHandle, Producer
from tokenfleet.protocol import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    decode_events,
    encode,
)

pytestmark = pytest.mark.fault

STREAM = KEYS.jobs()


def sampled_jobs(prefix: str, count: int, new_tokens: int = 300) -> list[GenerationRequest]:
    """Unseeded temperature-1 jobs: two workers would never produce the same text."""
    return [
        GenerationRequest(
            job_id=f"{prefix}-{i:02d}",
            prompt=f"story number {i} begins",
            max_new_tokens=new_tokens,
            ignore_eos=True,
            sampling=SamplingParams(temperature=1.0),
        )
        for i in range(count)
    ]


class Follower:
    """A client streaming one job in a thread, as an application would."""

    def __init__(self, handle: JobHandle) -> None:
        self.handle = handle
        self.events: list[TokenEvent] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.events.extend(self.handle.stream(timeout=180))
        except BaseException as exc:  # reported by the test
            self.error = exc

    def text(self) -> str:
        self.thread.join(180)
        assert not self.thread.is_alive(), f"{self.handle.id}: stream never ended"
        assert self.error is None, f"{self.handle.id}: {self.error!r}"
        return "".join(e.text for e in self.events)


def check_job(r: redis.Redis, follower: Follower) -> None:
    """Each index once, one finish event last, the streamed text = the stored result."""
    handle = follower.handle
    result = handle.result(timeout=60)
    raw = [e for _id, f in r.xrange(KEYS.events(handle.id)) for e in decode_events(f[b"m"])]
    finishes = [i for i, e in enumerate(raw) if isinstance(e, FinishEvent)]
    assert finishes == [len(raw) - 1], f"{handle.id}: finish events at {finishes} of {len(raw)}"
    tokens = [e for e in raw if isinstance(e, TokenEvent)]
    assert [e.index for e in tokens] == list(range(len(tokens))), f"{handle.id}: an index twice"
    assert [e.token_id for e in tokens] == result.token_ids
    assert "".join(e.text for e in tokens) == result.text
    assert follower.text() == result.text, f"{handle.id}: streamed text != stored result"
    assert [e.index for e in follower.events] == list(range(len(tokens)))


def pending_to(r: redis.Redis, consumer: str) -> list[str]:
    pending = r.xpending_range(STREAM, GROUP, "-", "+", 1000, consumername=consumer)
    return [p["message_id"].decode() for p in pending]


def tokens_out(r: redis.Redis, job_ids: list[str]) -> int:
    """Events in the jobs' replay streams so far."""
    return sum(int(r.xlen(KEYS.events(j))) for j in job_ids)


def wait_dropped(fleet: Fleet, worker: WorkerProcess, r: redis.Redis, since: float) -> None:
    """Until `worker` has heartbeated after `since` with nothing held."""

    def settled() -> bool:
        assert worker.proc.poll() is None, worker.output()
        score = r.zscore(KEYS.workers(), worker.name)
        info = fleet.info(worker)
        return score is not None and score > since and info.get("held_jobs") == 0

    wait_for(settled, 90, f"{worker.name} to drop the jobs it lost")


def take_over(
    fleet: Fleet, r: redis.Redis, followers: list[Follower], stalled: WorkerProcess
) -> None:
    """A second worker claims the stalled worker's jobs once its heartbeat expired and
    finishes every job."""
    rescuer = fleet.start("rescuer", burst=False)
    fleet.wait_alive(rescuer)
    wait_for(
        lambda: all(r.exists(KEYS.result(f.handle.id)) for f in followers),
        180,
        "every job to finish on the rescuer",
    )
    assert pending_to(r, stalled.name) == []


def mid_stream(
    fleet: Fleet, r: redis.Redis, name: str, jobs: list[GenerationRequest]
) -> tuple[WorkerProcess, list[Follower]]:
    """A worker of `fleet` holding at least 4 of `jobs`, with tokens flowing to clients."""
    worker = fleet.start(name, burst=False)
    fleet.wait_alive(worker)
    producer = Producer(r)
    followers = [Follower(producer.submit(req)) for req in jobs]
    ids = [f.handle.id for f in followers]
    wait_for(lambda: len(pending_to(r, name)) >= 4, 60, f"{name} to hold jobs")
    wait_for(lambda: tokens_out(r, ids) >= 40, 60, "tokens to flow")
    return worker, followers


def test_a_paused_worker_writes_nothing_after_its_jobs_moved_on(
    fleet: Fleet, r: redis.Redis
) -> None:
    paused, followers = mid_stream(fleet, r, "paused", sampled_jobs("pause", 12))
    paused.signal(signal.SIGSTOP)
    held = pending_to(r, "paused")
    try:
        take_over(fleet, r, followers, paused)
    finally:
        woke_at = time.time()
        paused.signal(signal.SIGCONT)
    wait_dropped(fleet, paused, r, woke_at)
    assert held, "the paused worker held no job when it stopped"
    for follower in followers:
        check_job(r, follower)
    assert "belongs to another worker now" in paused.output()
    assert r.xlen(STREAM) == 0 and r.xlen(KEYS.dead_letters()) == 0


def test_a_partitioned_worker_writes_nothing_after_the_network_heals(
    fleet: Fleet, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = PartitionProxy(port)
    cut_off = Fleet(proxy.url, tmp_path / "cut")
    (tmp_path / "cut").mkdir()
    try:
        worker, followers = mid_stream(cut_off, r, "cut-off", sampled_jobs("cut", 10))
        proxy.cut()
        try:
            take_over(fleet, r, followers, worker)
        finally:
            healed_at = time.time()
            proxy.heal()
        wait_dropped(cut_off, worker, r, healed_at)
        for follower in followers:
            check_job(r, follower)
        assert r.xlen(STREAM) == 0
    finally:
        cut_off.stop_all()
        proxy.close()


def test_entries_added_around_the_submit_script_never_touch_a_job(
    fleet: Fleet, r: redis.Redis
) -> None:
    producer = Producer(r)
    worker = fleet.start("spoofed", burst=False)
    fleet.wait_alive(worker)
    original = GenerationRequest(
        job_id="genuine", prompt="hello", max_new_tokens=16, ignore_eos=True
    )
    first = producer.submit(original).result(timeout=60)
    assert len(first.token_ids) == 16
    events_before = r.xrange(KEYS.events("genuine"))
    state_before = r.hgetall(KEYS.job("genuine"))
    # The same id again with another prompt, and an id nobody ever submitted.
    other = original.model_copy(update={"prompt": "something else", "max_new_tokens": 40})
    duplicate = r.xadd(STREAM, {"job_id": "genuine", "payload": encode(other)}).decode()
    unsubmitted = GenerationRequest(job_id="never-submitted", prompt="free ride")
    stray = r.xadd(STREAM, {"job_id": "never-submitted", "payload": encode(unsubmitted)})
    wait_for(lambda: r.xlen(KEYS.dead_letters()) == 2, 60, "two dead letters")
    wait_for(lambda: r.xlen(STREAM) == 0, 30, "the stream to empty")
    dead = {e.decode(): f for e, f in r.xrange(KEYS.dead_letters())}
    reasons = {f[b"entry"].decode(): f[b"reason"].decode() for f in dead.values()}
    assert reasons == {duplicate: "rejected_duplicate", stray.decode(): "rejected_unsubmitted"}
    assert producer.handle("genuine").result(timeout=5) == first
    assert r.xrange(KEYS.events("genuine")) == events_before
    assert r.hgetall(KEYS.job("genuine")) == state_before
    assert not r.exists(
        KEYS.job("never-submitted"), KEYS.result("never-submitted"), KEYS.events("never-submitted")
    )
    with pytest.raises(JobNotFound):
        producer.handle("never-submitted").result(timeout=5)
    assert worker.proc.poll() is None


def test_an_out_of_memory_redis_is_waited_out_with_every_job_kept(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(own_redis.url)
    fleet = Fleet(own_redis.url, tmp_path)
    try:
        producer = Producer(r)
        first = fleet.start("oom-a", burst=False)
        fleet.wait_alive(first)
        followers = [Follower(producer.submit(req)) for req in sampled_jobs("oom", 6, 200)]
        ids = [f.handle.id for f in followers]
        wait_for(lambda: tokens_out(r, ids) >= 20, 60, "tokens to flow")
        r.config_set("maxmemory", "1")  # every write that needs memory is refused: OOM
        first.wait_log("out of memory", 60)
        second = fleet.start("oom-b", burst=False)  # starts while Redis refuses writes
        second.wait_log("out of memory", 90)
        frozen = tokens_out(r, ids)
        assert first.proc.poll() is None and second.proc.poll() is None
        assert len(pending_to(r, "oom-a")) > 0  # its jobs are still its own
        r.config_set("maxmemory", "0")
        wait_for(lambda: all(r.exists(KEYS.result(i)) for i in ids), 120, "every job")
        assert tokens_out(r, ids) > frozen
        for follower in followers:
            check_job(r, follower)
        assert r.xlen(KEYS.dead_letters()) == 0
        fleet.wait_alive(second)
        assert "accepts writes again" in first.output()
        assert first.proc.poll() is None and second.proc.poll() is None
    finally:
        fleet.stop_all()
        r.close()


def test_the_drain_deadline_bounds_the_exit_while_redis_is_gone(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(own_redis.url)
    fleet = Fleet(own_redis.url, tmp_path)
    try:
        worker = fleet.start("drain-gone", "--drain-timeout", "2", burst=False)
        fleet.wait_alive(worker)
        handle = Producer(r).submit(sampled_jobs("gone", 1, 2000)[0])
        wait_for(lambda: tokens_out(r, [handle.id]) > 0, 60, "tokens to flow")
        r.close()
        own_redis.stop(kill=True)
        worker.wait_log("redis unavailable", 60)
        worker.signal(signal.SIGTERM)  # one signal only
        code = worker.wait(60)
        assert code == 0, worker.output()
        assert "drain deadline passed" in worker.output()
    finally:
        fleet.stop_all()
