"""Following a job across Redis restarts, against real worker processes and a real
redis-server of each test's own (never the session's: other tests share that one).

With AOF a restart loses nothing: `stream()` and `result()` reconnect, re-read the
replay stream from the last entry they saw and go on, every token once, in order.
Without persistence the job's state is gone: following it raises `JobLost`. Every
wait is on a condition; nothing asserts on wall-clock time."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.helpers.support import KEYS, wait_for
from tests.helpers.workers import Fleet, WorkerProcess
from tokenfleet.errors import JobLost, JobTimeout
from tokenfleet.local import RedisServer
from tokenfleet.producer import AsyncJobHandle, AsyncProducer, JobHandle, Producer
from tokenfleet.producer.follow import STREAM_IDLE_TIMEOUT_S, JobFollower
from tokenfleet.protocol import GenerationRequest, JobResult, TokenEvent, decode_result, encode
from tokenfleet.reasons import FinishReason

pytestmark = pytest.mark.fault

TOKENS = 600  # about 3 s on the tiny-random model: long enough to restart Redis mid-way


def long_job(job_id: str) -> GenerationRequest:
    return GenerationRequest(
        job_id=job_id,
        prompt="Once upon a time",
        max_new_tokens=TOKENS,
        ignore_eos=True,
        sampling={"temperature": 0.8, "top_k": 50, "seed": 7},
    )


@pytest.fixture
def client(aof_redis: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(aof_redis.url)
    yield c
    c.close()


@pytest.fixture
def worker_fleet(aof_redis: RedisServer, tmp_path: Path) -> Iterator[tuple[Fleet, WorkerProcess]]:
    """One long-running worker on the AOF Redis, alive (model loaded) before the test."""
    fleet = Fleet(aof_redis.url, tmp_path)
    try:
        worker = fleet.start("resume-w", burst=False)
        fleet.wait_alive(worker)
        yield fleet, worker
    finally:
        fleet.stop_all()


def restart_mid_job(
    server: RedisServer, worker: WorkerProcess, client: redis.Redis, job: str
) -> None:
    """Once the job has some tokens out (and no result yet), stop Redis, keep it down
    until the worker noticed (so does every client reading from it), start it again."""
    wait_for(lambda: client.xlen(KEYS.events(job)) >= 5, 60, f"tokens of {job}")
    assert not client.exists(KEYS.result(job)), f"{job} finished before the restart"
    lost_before = worker.output().count("redis unavailable")
    server.stop()
    wait_for(
        lambda: worker.output().count("redis unavailable") > lost_before,
        30,
        "the worker to notice Redis went away",
    )
    server.start()


def check_stream(events: list[TokenEvent], result: JobResult) -> None:
    """Every index 0..n-1 exactly once, in order, and the same tokens as the stored result."""
    assert result.finish_reason == FinishReason.LENGTH
    assert [e.index for e in events] == list(range(TOKENS))
    assert [e.token_id for e in events] == result.token_ids
    assert "".join(e.text for e in events) == result.text


def stored_result(client: redis.Redis, job: str) -> JobResult:
    raw = client.get(KEYS.result(job))
    assert raw is not None
    return decode_result(raw)


# ---- AOF: nothing is lost, the client goes on ----------------------------------------------


def test_sync_stream_survives_a_redis_restart_mid_job(
    aof_redis: RedisServer, client: redis.Redis, worker_fleet: tuple[Fleet, WorkerProcess]
) -> None:
    _, worker = worker_fleet
    handle = Producer(client).submit(long_job("sync-resume"))
    events: list[TokenEvent] = []
    failure: list[BaseException] = []

    def follow() -> None:
        try:
            events.extend(handle.stream(timeout=60))
        except BaseException as exc:  # handed to the test thread
            failure.append(exc)

    reader = threading.Thread(target=follow)
    reader.start()
    restart_mid_job(aof_redis, worker, client, handle.id)
    reader.join(60)
    assert not reader.is_alive() and not failure, failure
    check_stream(events, handle.result(timeout=10))
    assert handle.finish is not None and handle.finish.usage.completion_tokens == TOKENS


def test_async_stream_survives_a_redis_restart_mid_job(
    aof_redis: RedisServer, client: redis.Redis, worker_fleet: tuple[Fleet, WorkerProcess]
) -> None:
    _, worker = worker_fleet

    async def main() -> tuple[list[TokenEvent], JobResult]:
        producer = AsyncProducer.from_url(aof_redis.url)
        try:
            handle = await producer.submit(long_job("async-resume"))
            events: list[TokenEvent] = []

            async def follow(h: AsyncJobHandle) -> None:
                async for event in h.stream(timeout=60):
                    events.append(event)

            reader = asyncio.create_task(follow(handle))
            await asyncio.to_thread(restart_mid_job, aof_redis, worker, client, handle.id)
            await asyncio.wait_for(reader, 60)
            return events, await handle.result(timeout=10)
        finally:
            await producer.aclose()

    events, result = asyncio.run(main())
    check_stream(events, result)


def test_result_waits_across_a_redis_restart(
    aof_redis: RedisServer, client: redis.Redis, worker_fleet: tuple[Fleet, WorkerProcess]
) -> None:
    _, worker = worker_fleet
    handle = Producer(client).submit(long_job("result-resume"))
    got: list[JobResult | BaseException] = []

    def wait() -> None:
        try:
            got.append(handle.result(timeout=60))
        except BaseException as exc:
            got.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    restart_mid_job(aof_redis, worker, client, handle.id)
    waiter.join(60)
    assert len(got) == 1 and isinstance(got[0], JobResult), got
    assert got[0] == stored_result(client, handle.id)
    assert got[0].finish_reason == FinishReason.LENGTH
    assert len(got[0].token_ids) == TOKENS


# ---- no persistence: the job is gone, the client is told -----------------------------------


@pytest.mark.timeout(90)
def test_stream_and_result_raise_job_lost_after_a_restart_without_persistence(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    fleet = Fleet(own_redis.url, tmp_path)
    client = redis.Redis.from_url(own_redis.url)
    try:
        worker = fleet.start("lost-w", burst=False)
        fleet.wait_alive(worker)
        producer = Producer(client)
        handle = producer.submit(long_job("lost"))
        outcomes: dict[str, BaseException | None] = {}

        def run(name: str, action: Callable[[], object]) -> threading.Thread:
            def body() -> None:
                try:
                    action()
                    outcomes[name] = None
                except BaseException as exc:
                    outcomes[name] = exc

            thread = threading.Thread(target=body)
            thread.start()
            return thread

        # timeout=None: only the JobLost rule can end these (or the test's timeout).
        threads = [
            run("stream", lambda: list(handle.stream(timeout=None))),
            run("result", lambda: producer.handle(handle.id).result(timeout=None)),
        ]
        restart_mid_job(own_redis, worker, client, handle.id)
        for thread in threads:
            thread.join()
        assert isinstance(outcomes["stream"], JobLost), outcomes
        assert isinstance(outcomes["result"], JobLost), outcomes
        assert outcomes["stream"].job_id == handle.id
        assert not client.exists(KEYS.job(handle.id))  # really gone
    finally:
        fleet.stop_all()
        client.close()


@pytest.mark.timeout(60)
def test_a_queued_job_is_waiting_not_lost_until_a_restart_forgets_it(
    own_redis: RedisServer,
) -> None:
    """No worker: the job hash says queued and the replay stream is empty. That is a job
    waiting (the stream times out, it is not lost); after a restart without persistence
    the same wait ends with JobLost, sync and async."""
    client = redis.Redis.from_url(own_redis.url)
    try:
        handle = Producer(client).submit(prompt="nobody serves this", job_id="queued")
        with pytest.raises(JobTimeout):
            list(handle.stream(timeout=1.5))  # over STATE_CHECK_S: the state was checked

        async def main() -> BaseException | None:
            producer = AsyncProducer.from_url(own_redis.url)
            try:
                ahandle = producer.handle("queued")
                follow = asyncio.create_task(_drain(ahandle))
                channel = KEYS.channel("queued")
                await asyncio.to_thread(
                    wait_for,
                    lambda: client.pubsub_numsub(channel)[0][1] >= 1,
                    10,
                    "the async stream to subscribe",
                )
                await asyncio.to_thread(own_redis.restart)
                try:
                    await asyncio.wait_for(follow, 30)
                except BaseException as exc:
                    return exc
                return None
            finally:
                await producer.aclose()

        outcome = asyncio.run(main())
        assert isinstance(outcome, JobLost), outcome
    finally:
        client.close()


async def _drain(handle: AsyncJobHandle) -> None:
    async for _event in handle.stream(timeout=None):
        pass


# ---- the default idle timeout, and errors that are not retried -----------------------------


def test_stream_has_a_finite_default_idle_timeout_and_raises_job_timeout(
    own_redis: RedisServer,
) -> None:
    """300 s of silence by default (None, passed explicitly, waits forever); a job no
    worker serves ends with JobTimeout once the silence passes the given timeout."""
    for stream in (JobHandle.stream, AsyncJobHandle.stream):
        assert inspect.signature(stream).parameters["timeout"].default == STREAM_IDLE_TIMEOUT_S
    assert STREAM_IDLE_TIMEOUT_S == 300.0
    client = redis.Redis.from_url(own_redis.url)
    try:
        handle = Producer(client).submit(prompt="nobody serves this")
        with pytest.raises(JobTimeout) as caught:
            next(handle.stream(timeout=0.3))
        assert caught.value.job_id == handle.id and caught.value.timeout == 0.3

        async def main() -> None:
            producer = AsyncProducer.from_url(own_redis.url)
            try:
                with pytest.raises(JobTimeout):
                    async for _event in producer.handle(handle.id).stream(timeout=0.3):
                        pass
            finally:
                await producer.aclose()

        asyncio.run(main())
    finally:
        client.close()


@pytest.mark.timeout(10)
def test_a_refused_password_is_raised_at_once_not_retried(own_redis: RedisServer) -> None:
    """redis-py makes AuthenticationError a ConnectionError; it must not be retried."""
    admin = redis.Redis.from_url(own_redis.url)
    try:
        handle = Producer(admin).submit(prompt="x", job_id="auth")
        admin.config_set("requirepass", "secret")  # this connection stays authenticated
        # redis-py's own retries (which retry even this, ~4 s each) off: what is left is ours.
        wrong = redis.Redis(port=own_redis.port, password="wrong", retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):
            next(Producer(wrong).handle(handle.id).stream(timeout=None))
        with pytest.raises(redis.AuthenticationError):
            Producer(wrong).handle(handle.id).result(timeout=None)

        async def main() -> None:
            no_retry = AsyncRetry(NoBackoff(), 0)
            producer = AsyncProducer(
                aredis.Redis(port=own_redis.port, password="wrong", retry=no_retry)
            )
            try:
                with pytest.raises(redis.AuthenticationError):
                    await _drain(producer.handle(handle.id))
                with pytest.raises(redis.AuthenticationError):
                    await producer.handle(handle.id).result(timeout=None)
            finally:
                await producer.aclose()

        asyncio.run(main())
        wrong.close()
    finally:
        admin.close()


@pytest.mark.timeout(30)
def test_following_gives_up_with_the_connection_error_when_redis_stays_down(
    own_redis: RedisServer,
) -> None:
    """Reconnecting is bounded by the call's timeout: then the last ConnectionError is
    raised, with a note saying the client gave up."""
    client = redis.Redis.from_url(own_redis.url)
    handle = Producer(client).submit(prompt="nobody serves this", job_id="down")
    stream = handle.stream(timeout=1.0)
    outcomes: list[BaseException] = []

    def wait() -> None:
        try:
            handle.result(timeout=1.0)
        except BaseException as exc:
            outcomes.append(exc)

    own_redis.stop()
    waiter = threading.Thread(target=wait)
    waiter.start()
    with pytest.raises(redis.ConnectionError) as caught:
        next(stream)
    waiter.join()
    client.close()
    assert any("gave up following job down" in note for note in caught.value.__notes__)
    assert len(outcomes) == 1 and isinstance(outcomes[0], redis.ConnectionError), outcomes
    assert any("gave up" in note for note in outcomes[0].__notes__)


def test_a_follower_started_before_the_submit_is_not_told_the_job_is_lost() -> None:
    """Subscribe first, submit second (to miss nothing): a state check that ran before
    the submit must not turn into JobLost once the job's events arrive."""
    now = time.monotonic()
    follow = JobFollower("early", timeout=5)
    follow.absorb([[], 0], replay=True, check=True, now=now)  # not submitted yet
    assert follow.state_missing and not follow.known
    follow.raise_if_over(now)  # unknown ids get a grace period
    follow.feed_live(encode(TokenEvent(job_id="early", index=0, token_id=3, text="a")))
    follow.raise_if_over(now)  # the job exists now: not lost
    assert [e.index for e in follow.ready(now)] == [0]  # type: ignore[union-attr]
