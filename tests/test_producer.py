"""The bounded queue and the producer client, against a real redis-server."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from tests.helpers.publish import queue_event, queue_result
from tests.helpers.support import KEYS
from tokenfleet.errors import InvalidRequest, JobNotFound, JobRejected, JobTimeout, QueueFull
from tokenfleet.producer import AsyncProducer, Producer
from tokenfleet.protocol import (
    ErrorInfo,
    FinishEvent,
    GenerationRequest,
    JobResult,
    TokenEvent,
    Usage,
    decode_request,
)
from tokenfleet.reasons import FinishReason


def emit(client: redis.Redis, *events: TokenEvent | FinishEvent) -> None:
    """Write events exactly as a worker does (replay stream + live channel)."""
    pipe = client.pipeline(transaction=False)
    for event in events:
        queue_event(pipe, KEYS, event)
    pipe.execute()


def tokens(job_id: str, indices: list[int]) -> list[TokenEvent]:
    return [TokenEvent(job_id=job_id, index=i, token_id=100 + i, text=f"t{i} ") for i in indices]


def finish(job_id: str, n: int, reason: FinishReason = FinishReason.LENGTH) -> FinishEvent:
    return FinishEvent(job_id=job_id, reason=reason, usage=Usage(completion_tokens=n))


def test_cap_is_exact_under_concurrent_producers(r: redis.Redis, redis_url: str) -> None:
    cap, threads, per_thread = 100, 8, 250
    Producer(r).set_queue_cap(cap)
    accepted: list[str] = []
    refusals: list[QueueFull] = []
    others: list[BaseException] = []
    lock = threading.Lock()

    def run(t: int) -> None:
        producer = Producer.from_url(redis_url)  # one connection per thread, like real services
        for i in range(per_thread):
            try:
                handle = producer.submit(prompt=f"job {t}-{i}", job_id=f"j{t}-{i}")
                with lock:
                    accepted.append(handle.id)
            except QueueFull as exc:
                with lock:
                    refusals.append(exc)
            except BaseException as exc:
                with lock:
                    others.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()

    assert others == []
    assert len(accepted) == cap
    assert len(refusals) == threads * per_thread - cap
    assert all(exc.depth == cap and exc.cap == cap for exc in refusals)
    entries = r.xrange(KEYS.jobs())
    assert len(entries) == cap == r.xlen(KEYS.jobs())
    by_id = {fields[b"job_id"].decode(): fields[b"payload"] for _, fields in entries}
    assert set(by_id) == set(accepted)
    for job_id, payload in by_id.items():
        request = decode_request(payload)  # payload intact
        t, i = job_id[1:].split("-")
        assert request.job_id == job_id and request.prompt == f"job {t}-{i}"


def test_resubmitting_an_accepted_id_returns_the_same_job(r: redis.Redis) -> None:
    producer = Producer(r)
    first = producer.submit(prompt="hello", job_id="same")
    again = producer.submit(prompt="hello", job_id="same")
    assert again.id == first.id and again.entry_id == first.entry_id
    assert again.duplicate and not first.duplicate
    assert r.xlen(KEYS.jobs()) == 1
    assert producer.handle("same").status().status == "queued"


def test_queue_full_is_immediate_and_carries_depth(r: redis.Redis) -> None:
    producer = Producer(r)
    producer.set_queue_cap(2)
    producer.submit(prompt="a")
    producer.submit(prompt="b")
    with pytest.raises(QueueFull) as info:
        producer.submit(prompt="c")
    assert (info.value.depth, info.value.cap) == (2, 2)
    assert producer.depth() == 2


def test_submit_many_reports_each_outcome_in_one_round_trip(r: redis.Redis) -> None:
    producer = Producer(r)
    producer.set_queue_cap(3)
    producer.submit(prompt="first", job_id="a0")
    requests = [GenerationRequest(prompt=f"p{i}", job_id=f"a{i}") for i in range(5)]
    outcomes = producer.submit_many(requests)
    assert [o.job_id for o in outcomes] == [f"a{i}" for i in range(5)]
    assert outcomes[0].accepted and outcomes[0].duplicate
    assert [o.accepted for o in outcomes[1:]] == [True, True, False, False]
    assert all(isinstance(o.error, QueueFull) for o in outcomes[3:])
    assert r.xlen(KEYS.jobs()) == 3


def test_queue_cap_is_per_model_stream(r: redis.Redis) -> None:
    producer = Producer(r)
    producer.set_queue_cap(1, model="m1")
    producer.submit(prompt="a", model="m1")
    with pytest.raises(QueueFull):
        producer.submit(prompt="b", model="m1")
    producer.submit(prompt="c")  # the default stream has its own cap
    assert r.xlen(KEYS.jobs("m1")) == 1 and r.xlen(KEYS.jobs()) == 1
    assert producer.queue_cap("m1") == 1 and producer.queue_cap() == 1000


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt": "x", "max_new_tokens": -1}, "max_new_tokens"),
        ({"prompt": "x", "sampling": {"temperature": -1}}, "sampling.temperature"),
        ({"prompt": "x", "prompt_ids": [1]}, "exactly one"),
        ({"prompt_ids": [-1]}, "prompt_ids.0"),
        ({"prompt": "x", "job_id": "has space"}, "job_id"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ],
)
def test_bad_request_fails_at_submit_and_never_reaches_redis(
    r: redis.Redis, fields: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidRequest, match=named.replace(".", r"\.")):
        Producer(r).submit(**fields)
    assert r.dbsize() == 0


def test_stream_delivers_events_published_before_subscribing_once_in_order(
    r: redis.Redis,
) -> None:
    handle = Producer(r).submit(prompt="hi", job_id="late")
    emit(r, *tokens("late", [0, 1, 2]))
    emit(r, *tokens("late", [1, 2]))  # duplicates (a resumed worker re-announcing)
    emit(r, *tokens("late", [4, 3]), finish("late", 5))  # out of order
    got = list(handle.stream(timeout=10))
    assert [e.index for e in got] == [0, 1, 2, 3, 4]
    assert "".join(e.text for e in got) == "t0 t1 t2 t3 t4 "
    assert handle.finish is not None and handle.finish.reason == FinishReason.LENGTH
    # Called again after the job finished, it replays the whole job.
    assert [e.index for e in handle.stream(timeout=10)] == [0, 1, 2, 3, 4]


def test_stream_follows_live_events_from_another_thread(r: redis.Redis, redis_url: str) -> None:
    handle = Producer(r).submit(prompt="hi", job_id="live")
    seen: list[int] = []
    subscribed = threading.Event()

    def writer() -> None:
        client = redis.Redis.from_url(redis_url)
        # Wait until the reader is subscribed so the events really arrive live.
        while client.pubsub_numsub(KEYS.channel("live"))[0][1] == 0:
            subscribed.wait(0.01)
        for i in range(20):
            emit(client, *tokens("live", [i]))
        emit(client, finish("live", 20))

    thread = threading.Thread(target=writer)
    thread.start()
    for event in handle.stream(timeout=10):
        seen.append(event.index)
    thread.join()
    assert seen == list(range(20))


def test_result_timeout_raises_named_error(r: redis.Redis) -> None:
    handle = Producer(r).submit(prompt="nobody serves this")
    with pytest.raises(JobTimeout):
        handle.result(timeout=0.3)
    with pytest.raises(JobNotFound):
        Producer(r).handle("never-submitted").result(timeout=1)


def test_result_returns_stored_result_and_raises_for_rejections(r: redis.Redis) -> None:
    producer = Producer(r)
    ok = producer.submit(prompt="a", job_id="ok")
    bad = producer.submit(prompt="b", job_id="bad")
    pipe = r.pipeline()
    queue_result(pipe, KEYS, JobResult(job_id="ok", text="hey", finish_reason=FinishReason.STOP))
    rejected = JobResult(
        job_id="bad",
        finish_reason=FinishReason.REJECTED,
        error=ErrorInfo(reason="rejected_kv_budget", message="too long"),
    )
    queue_result(pipe, KEYS, rejected)
    pipe.execute()
    assert ok.result(timeout=5).text == "hey"
    with pytest.raises(JobRejected) as info:
        bad.result(timeout=5)
    assert info.value.reason == "rejected_kv_budget"
    assert ok.status().status == "finished"


def test_cancel_sets_the_flag_for_unfinished_jobs_only(r: redis.Redis) -> None:
    producer = Producer(r)
    handle = producer.submit(prompt="a")
    assert handle.cancel() is True
    assert r.get(KEYS.cancel(handle.id)) == b"1"
    assert producer.handle("unknown").cancel() is False


def test_async_producer_has_the_same_surface(redis_url: str, r: redis.Redis) -> None:
    async def main() -> None:
        producer = AsyncProducer.from_url(redis_url)
        handle = await producer.submit(prompt="hello", job_id="aio")
        assert (await producer.submit(prompt="hello", job_id="aio")).duplicate
        emit(r, *tokens("aio", [1, 0]), finish("aio", 2, FinishReason.STOP))
        got = [e.index async for e in handle.stream(timeout=10)]
        assert got == [0, 1]
        pipe = r.pipeline()
        queue_result(pipe, KEYS, JobResult(job_id="aio", text="x", finish_reason="stop"))
        pipe.execute()
        assert (await handle.result(timeout=5)).text == "x"
        assert (await handle.status()).status == "finished"
        assert await handle.cancel() is False
        outcomes = await producer.submit_many([GenerationRequest(prompt="m")])
        assert outcomes[0][1] is not None and await producer.depth() == 2
        await producer.aclose()

    asyncio.run(main())


def test_duplicate_is_answered_even_when_the_queue_is_full(r: redis.Redis) -> None:
    producer = Producer(r)
    producer.set_queue_cap(1)
    first = producer.submit(prompt="a", job_id="only")
    assert producer.submit(prompt="a", job_id="only").entry_id == first.entry_id


def test_a_job_no_live_worker_could_hold_is_refused_at_submit(
    r: redis.Redis, redis_url: str
) -> None:
    from tokenfleet.worker.queue import WorkerQueue

    producer = Producer(r)
    # No live worker: the job queues as usual.
    assert producer.submit(prompt_ids=[1] * 100, max_new_tokens=1000, job_id="queued").id
    small = WorkerQueue(r, KEYS, "small-worker")
    small.heartbeat({"model": "default", "max_job_tokens": 512})
    other_model = WorkerQueue(r, KEYS, "big-other-model", model="big")
    other_model.heartbeat({"model": "big", "max_job_tokens": 100_000})
    producer = Producer(r)  # fresh capacity cache
    with pytest.raises(JobRejected) as info:
        producer.submit(prompt_ids=[1] * 100, max_new_tokens=1000, job_id="too-big")
    assert info.value.reason == "rejected_kv_budget" and "512" in info.value.message
    assert not r.exists(KEYS.job("too-big"))
    assert producer.submit(prompt_ids=[1] * 100, max_new_tokens=400).id  # fits: 500 <= 512
    assert producer.submit(prompt_ids=[1] * 100, max_new_tokens=1000, model="big").id
    outcomes = producer.submit_many(
        [GenerationRequest(prompt="x", max_new_tokens=600), GenerationRequest(prompt="y")]
    )
    assert isinstance(outcomes[0].error, JobRejected) and outcomes[1].accepted

    async def refused_async() -> None:
        aproducer = AsyncProducer.from_url(redis_url)
        with pytest.raises(JobRejected):
            await aproducer.submit(prompt="x", max_new_tokens=600)
        many = await aproducer.submit_many(
            [GenerationRequest(prompt="x", max_new_tokens=600), GenerationRequest(prompt="y")]
        )
        assert isinstance(many[0][2], JobRejected) and many[0][1] is None
        assert many[1][1] is not None and many[1][2] is None
        await aproducer.aclose()

    asyncio.run(refused_async())


def test_assembler_sees_a_gap_only_when_something_is_missing() -> None:
    from tokenfleet.producer.common import EventAssembler

    asm = EventAssembler()
    asm.feed(tokens("g", [0])[0])
    assert not asm.gap  # the next token, not yet handed out: no hole
    assert [e.index for e in asm.ready()] == [0]  # type: ignore[union-attr]
    asm.feed(tokens("g", [2])[0])
    assert asm.gap  # index 1 is missing
    asm.feed(tokens("g", [1])[0])
    assert not asm.gap
    assert len(asm.ready()) == 2
    asm.feed(finish("g", 5))
    assert asm.gap  # the finish says 5 tokens; 3 arrived
    asm.feed(tokens("g", [3])[0])
    asm.feed(tokens("g", [4])[0])
    assert not asm.gap
    assert isinstance(asm.ready()[-1], FinishEvent) and asm.complete
