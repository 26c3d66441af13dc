"""The worker's Redis edge (WorkerQueue) against a real redis-server: reading,
ownership-checked finish and dead-letter, orphan claims, heartbeats."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import redis

from tests.helpers.publish import queue_event
from tests.helpers.reads import queue_stats
from tests.helpers.support import KEYS, wait_for
from tests.helpers.ticks import finish, outcome, tick
from tokenfleet.errors import JobFailed
from tokenfleet.fleet import live_workers
from tokenfleet.keys import DEFAULT_BAND, EVENTS_TTL_S, GROUP, RESULT_TTL_S, WORKER_TTL_S
from tokenfleet.local import free_port
from tokenfleet.producer import JobHandle, Producer
from tokenfleet.protocol import (
    ErrorInfo,
    FinishEvent,
    TokenEvent,
    decode_events,
    decode_request,
    decode_result,
    encode,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.queue import (
    Accepted,
    Delivery,
    TickReply,
    TickVerdict,
    TickWrite,
    Verdict,
    WorkerQueue,
    _packed,
    _stack,
)

BAND = next(band for band in KEYS.bands() if band.name == DEFAULT_BAND)
STREAM = BAND.stream


def submit(r: redis.Redis, n: int) -> list[JobHandle]:
    producer = Producer(r)
    return [producer.submit(prompt=f"prompt {i}", job_id=f"job-{i}") for i in range(n)]


def worker(r: redis.Redis, name: str) -> WorkerQueue:
    queue = WorkerQueue(r, KEYS, name)
    queue.ensure_group()
    queue.load_scripts()
    return queue


def _d(entry_id: str, job_id: str) -> Delivery:
    """A delivery of the default band's stream, as a worker would hold it."""
    return Delivery(entry_id, job_id, None, band=BAND)


def verdicts(accepted: list[Accepted]) -> list[tuple[Verdict, bool]]:
    return [(a.verdict, a.cancelled) for a in accepted]


def _tokens(job_id: str, indices: range) -> list[TokenEvent]:
    return [TokenEvent(job_id=job_id, index=i, token_id=100 + i, text=f"t{i}") for i in indices]


def events(r: redis.Redis, job_id: str) -> list[TokenEvent | FinishEvent]:
    return [e for _id, f in r.xrange(KEYS.events(job_id)) for e in decode_events(f[b"m"])]


def finish_events(r: redis.Redis, job_id: str) -> list[FinishEvent]:
    return [e for e in events(r, job_id) if isinstance(e, FinishEvent)]


def pending(r: redis.Redis) -> list[tuple[str, str]]:
    """(entry id, consumer) of every pending entry of the jobs stream."""
    rows = r.xpending_range(STREAM, GROUP, "-", "+", 100)
    return [(row["message_id"].decode(), row["consumer"].decode()) for row in rows]


# --- read ------------------------------------------------------------------------
def test_read_returns_at_most_count_fresh_entries(r: redis.Redis) -> None:
    handles = submit(r, 3)
    a = worker(r, "a")
    first = a.read(2, block_ms=None)
    assert [d.job_id for d in first] == ["job-0", "job-1"]
    assert [d.entry_id for d in first] == [h.entry_id for h in handles[:2]]
    assert all(d.deliveries == 1 and not d.lost for d in first)
    assert decode_request(first[0].payload or b"").prompt == "prompt 0"
    assert a.read(0) == []
    assert [d.job_id for d in a.read(5)] == ["job-2"]
    assert a.read(5, block_ms=20) == []  # blocked, then nothing


def test_read_with_no_count_never_touches_redis() -> None:
    offline = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
    assert WorkerQueue(offline, KEYS, "a").read(0, block_ms=1000) == []
    assert WorkerQueue(offline, KEYS, "a").read(-3) == []


def test_jobs_submitted_before_any_worker_are_served_and_group_loss_recovers(
    r: redis.Redis,
) -> None:
    submit(r, 2)
    a = WorkerQueue(r, KEYS, "a")  # no ensure_group: the read creates the group from id 0
    got = a.read(10)
    assert [d.job_id for d in got] == ["job-0", "job-1"]
    a.ensure_group()  # idempotent (BUSYGROUP ignored)

    r.xgroup_destroy(STREAM, GROUP)  # as after a Redis restart without the group
    assert finish(a, got[0]) != [TickVerdict.DONE]  # owns nothing now
    assert finish_events(r, "job-0") == []
    assert [d.job_id for d in a.read(10)] == ["job-0", "job-1"]  # served again


def test_entries_with_odd_fields_still_read(r: redis.Redis) -> None:
    r.xadd(STREAM, {"payload": b"\xc1"})  # no job id
    r.xadd(STREAM, {"job_id": "bad:id", "payload": b"{}"})  # not a valid job id
    r.xadd(STREAM, {"job_id": b"\xff\xfe", "other": b"x"})  # undecodable id, no payload
    got = worker(r, "a").read(10)
    assert [(d.job_id, d.payload) for d in got] == [(None, b"\xc1"), (None, b"{}"), (None, None)]


# --- finish ------------------------------------------------------------------------
def test_finish_writes_the_one_terminal_event_and_removes_the_entry(r: redis.Redis) -> None:
    (handle,) = submit(r, 1)
    a = worker(r, "a")
    (d,) = a.read(1)
    assert verdicts(a.accept([d])) == [(Verdict.OK, False)]
    assert handle.status().status == "running" and handle.status().worker == "a"

    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(KEYS.channel("job-0"))
    wait_for(lambda: r.pubsub_numsub(KEYS.channel("job-0"))[0][1] == 1, 5, "subscription")
    result, fin = outcome("job-0")
    assert finish(a, d) == [TickVerdict.DONE]

    assert decode_result(r.get(KEYS.result("job-0"))) == result
    assert 0 < r.ttl(KEYS.result("job-0")) <= RESULT_TTL_S
    assert handle.status().status == "finished"
    assert handle.status().finish_reason == "length"
    assert r.ttl(KEYS.job("job-0")) > 0
    assert finish_events(r, "job-0") == [fin]
    assert 0 < r.ttl(KEYS.events("job-0")) <= EVENTS_TTL_S
    assert r.xlen(STREAM) == 0 and pending(r) == []
    message = None

    def published() -> bool:
        nonlocal message
        message = pubsub.get_message(timeout=0.05)
        return message is not None

    wait_for(published, 5, "the finish event on the live channel")
    assert message is not None and message["data"] == encode(fin)
    pubsub.close()
    assert handle.result(timeout=5) == result

    # Nobody can finish it again: not another worker, not the same one.
    assert finish(worker(r, "b"), d) != [TickVerdict.DONE]
    assert finish(a, d) != [TickVerdict.DONE]
    assert finish_events(r, "job-0") == [fin]


def test_a_tick_sends_events_and_the_finish_together(r: redis.Redis) -> None:
    submit(r, 1)
    a = worker(r, "a")
    (d,) = a.read(1)
    result, fin = outcome("job-0")
    write = TickWrite(d, "job-0", _tokens("job-0", range(1)), (result, fin))
    assert tick(a, write) == [TickReply(TickVerdict.DONE, 1)]
    assert [type(e) for e in events(r, "job-0")] == [TokenEvent, FinishEvent]
    assert r.xlen(STREAM) == 0


def test_a_round_trip_is_packed_as_redis_py_packs_it(r: redis.Redis) -> None:
    """The round trip's own packing (hiredis, a command per call) sends the very bytes
    redis-py's packer would, for every command a tick sends: tick.lua with a token and an
    end, pull.lua, the heartbeat (HSET, EXPIRE, ZADD with a float score, PUBLISH); and
    hands what hiredis would pack otherwise, or not at all, to redis-py's packer."""
    submit(r, 1)
    a = worker(r, "a")
    (d,) = a.read(1)
    pipe = _stack(r)
    a.tick([TickWrite(d, "job-0", _tokens("job-0", range(2)), outcome("job-0"))], pipe)
    a.pull(7, pipe, extra=1, floor=("batch",))
    a.heartbeat({"slots": 8, "load": 0.25, "name": "é"}, pipe=pipe)
    commands = [args for args, _ in pipe.command_stack]
    assert {type(arg) for args in commands for arg in args} >= {str, bytes, int, float}
    conn = r.connection_pool.get_connection()
    try:
        assert _packed(conn, commands) == [b"".join(conn.pack_commands(commands))]
        # what hiredis refuses (a bytearray) or would pack as one word (a two-word
        # command name, which redis-py splits) goes through redis-py's packer
        for odd in ([("SET", "k", bytearray(b"v"))], [*commands, ("CLIENT SETNAME", "w")]):
            assert b"".join(_packed(conn, odd)) == b"".join(conn.pack_commands(odd))
    finally:
        r.connection_pool.release(conn)


def test_a_tick_refuses_mismatched_job_ids(r: redis.Redis) -> None:
    result, fin = outcome("job-0")
    with pytest.raises(ValueError):
        tick(worker(r, "a"), TickWrite(_d("1-0", "job-1"), "job-1", [], (result, fin)))


# --- ownership and claims ---------------------------------------------------------
def test_dead_workers_entry_moves_and_only_the_new_owner_finishes(r: redis.Redis) -> None:
    submit(r, 1)
    a, b = worker(r, "a"), worker(r, "b")
    (d,) = a.read(1)  # a never heartbeats: presumed dead
    b.heartbeat({})
    (claimed,) = b.claim_orphans(10, min_idle_ms=0)
    assert (claimed.entry_id, claimed.job_id, claimed.payload) == (d.entry_id, "job-0", d.payload)
    assert claimed.deliveries == 2
    assert pending(r) == [(d.entry_id, "b")]

    _result, fin = outcome("job-0")
    assert finish(a, d) != [TickVerdict.DONE]
    assert finish_events(r, "job-0") == []
    assert finish(b, d) == [TickVerdict.DONE]
    assert finish_events(r, "job-0") == [fin]


def test_a_live_workers_entries_are_never_claimed(r: redis.Redis) -> None:
    submit(r, 2)
    a, b = worker(r, "a"), worker(r, "b")
    a.heartbeat({"slots": 4})
    taken = a.read(2)
    wait_for(
        lambda: all(
            row["time_since_delivered"] > 20
            for row in r.xpending_range(STREAM, GROUP, "-", "+", 10)
        ),
        5,
        "idle entries",
    )
    assert b.claim_orphans(10, min_idle_ms=0) == []
    assert pending(r) == [(d.entry_id, "a") for d in taken]

    a.leave()  # clean exit: what it still holds is claimable at once
    assert [d.entry_id for d in b.claim_orphans(10, min_idle_ms=0)] == [d.entry_id for d in taken]


def test_each_claim_counts_a_delivery_and_dead_consumers_are_removed(r: redis.Redis) -> None:
    submit(r, 1)
    a, b, c = worker(r, "a"), worker(r, "b"), worker(r, "c")
    assert a.read(1)[0].deliveries == 1
    assert [d.deliveries for d in b.claim_orphans(1, min_idle_ms=0)] == [2]
    assert [d.deliveries for d in c.claim_orphans(1, min_idle_ms=0)] == [3]
    assert [x["name"] for x in r.xinfo_consumers(STREAM, GROUP)] == [b"c"]


def test_min_idle_keeps_fresh_entries_and_a_claim_resets_idle(r: redis.Redis) -> None:
    submit(r, 1)
    a, b, c = worker(r, "a"), worker(r, "b"), worker(r, "c")
    a.read(1)
    assert b.claim_orphans(10, min_idle_ms=60_000) == []  # delivered moments ago
    assert len(b.claim_orphans(10, min_idle_ms=0)) == 1
    assert c.claim_orphans(10, min_idle_ms=60_000) == []  # b's claim just reset its idle time
    assert [consumer for _id, consumer in pending(r)] == ["b"]


def test_claims_stop_at_max_count(r: redis.Redis) -> None:
    submit(r, 3)
    a, b = worker(r, "a"), worker(r, "b")
    a.read(3)
    assert b.claim_orphans(0, min_idle_ms=0) == []
    assert [d.job_id for d in b.claim_orphans(2, min_idle_ms=0)] == ["job-0", "job-1"]
    assert [d.job_id for d in b.claim_orphans(2, min_idle_ms=0)] == ["job-2"]


def test_entry_deleted_while_pending_comes_back_lost_and_can_be_dead_lettered(
    r: redis.Redis,
) -> None:
    submit(r, 2)
    a, b = worker(r, "a"), worker(r, "b")
    gone, kept = a.read(2)
    r.xdel(STREAM, gone.entry_id)  # an operator's XDEL/XTRIM
    claimed = b.claim_orphans(10, min_idle_ms=0)
    assert claimed == [
        Delivery(gone.entry_id, None, None, deliveries=2, lost=True, band=BAND),
        Delivery(kept.entry_id, "job-1", kept.payload, deliveries=2, band=BAND),
    ]
    assert pending(r) == [(kept.entry_id, "b")]
    assert b.dead_letter(claimed[0], "entry_deleted", "data deleted while pending") is True
    (_id, fields), *_ = r.xrevrange(KEYS.dead_letters())
    assert fields[b"entry"] == gone.entry_id.encode() and fields[b"reason"] == b"entry_deleted"
    assert fields[b"job_id"] == b"" and fields[b"payload"] == b""
    # A lost delivery is accepted only while the entry is nowhere: not when its data is
    # still there, nor while its (deleted) entry is pending to another consumer.
    fake = Delivery(kept.entry_id, "job-1", None, deliveries=2, lost=True, band=BAND)
    assert a.dead_letter(fake, "entry_deleted", "x") is False
    c = worker(r, "c")
    Producer(r).submit(prompt="p", job_id="job-9")
    (held,) = c.read(1)
    r.xdel(STREAM, held.entry_id)
    assert a.dead_letter(replace(held, lost=True), "entry_deleted", "x") is False
    assert r.xlen(KEYS.dead_letters()) == 1
    assert c.dead_letter(held, "entry_deleted", "x") is True  # its owner can
    assert r.xlen(KEYS.dead_letters()) == 2 and pending(r) == [(kept.entry_id, "b")]


# --- dead letters ----------------------------------------------------------------
def test_dead_letter_with_a_job_id_tells_the_client(r: redis.Redis) -> None:
    (handle,) = submit(r, 1)
    a = worker(r, "a")
    (d,) = a.read(1)
    error = ErrorInfo(reason="too_many_deliveries", message="delivered 2 times")
    result, fin = outcome("job-0", FinishReason.ERROR, error)
    assert a.dead_letter(d, error.reason, error.message, finish=fin, result=result) is True

    ((_id, fields),) = r.xrange(KEYS.dead_letters())
    assert fields[b"job_id"] == b"job-0" and fields[b"entry"] == d.entry_id.encode()
    assert fields[b"stream"] == STREAM.encode() and fields[b"reason"] == b"too_many_deliveries"
    assert fields[b"message"] == b"delivered 2 times" and fields[b"worker"] == b"a"
    assert fields[b"deliveries"] == b"1" and fields[b"payload"] == d.payload
    assert float(fields[b"at"]) > 0
    assert finish_events(r, "job-0") == [fin]
    with pytest.raises(JobFailed, match="too_many_deliveries"):
        handle.result(timeout=5)
    assert handle.status().finish_reason == "error"
    assert r.xlen(STREAM) == 0 and pending(r) == []
    # Not the entry's owner any more: nothing written.
    assert worker(r, "b").dead_letter(d, "x", "y", finish=fin, result=result) is False
    assert r.xlen(KEYS.dead_letters()) == 1 and finish_events(r, "job-0") == [fin]


def test_dead_letter_of_unreadable_entry(r: redis.Redis) -> None:
    r.xadd(STREAM, {"payload": b"\xc1garbage"})
    a = worker(r, "a")
    (d,) = a.read(1)
    assert d.job_id is None
    assert a.dead_letter(d, "not_msgpack", "cannot decode payload") is True
    ((_id, fields),) = r.xrange(KEYS.dead_letters())
    assert fields[b"job_id"] == b"" and fields[b"payload"] == b"\xc1garbage"
    assert r.xlen(STREAM) == 0 and pending(r) == []
    _result, fin = outcome("job-0")
    with pytest.raises(ValueError):
        a.dead_letter(d, "x", "y", finish=fin)  # result missing


# --- job state, cancel, resume ----------------------------------------------------
def test_accept_serves_only_the_entry_the_submit_script_recorded(r: redis.Redis) -> None:
    handles = submit(r, 3)
    a = worker(r, "a")
    r.delete(KEYS.job("job-1"))  # expired (or never submitted)
    r.hset(KEYS.job("job-2"), "status", "finished")
    r.xadd(STREAM, {"job_id": "job-0", "payload": b"x"})  # a second entry naming job-0
    r.xadd(STREAM, {"job_id": "never", "payload": b"x"})  # XADDed around the submit script
    assert handles[0].cancel()
    got = a.read(10)
    assert [d.job_id for d in got] == ["job-0", "job-1", "job-2", "job-0", "never"]
    assert verdicts(a.accept(got)) == [
        (Verdict.OK, True),
        (Verdict.UNSUBMITTED, False),
        (Verdict.FINISHED, False),
        (Verdict.DUPLICATE, True),
        (Verdict.UNSUBMITTED, False),
    ]
    status = handles[0].status()
    assert status.status == "running" and status.worker == "a"
    assert float(status.fields["started_at"]) > 0 and r.ttl(KEYS.job("job-0")) > 0
    assert not r.exists(KEYS.job("job-1")) and not r.exists(KEYS.job("never"))
    assert handles[2].status().status == "finished"
    assert a.accept([]) == []


def test_tick_appends_each_index_once_and_finishes_only_what_it_owns(r: redis.Redis) -> None:
    submit(r, 2)
    a, b = worker(r, "a"), worker(r, "b")
    d0, d1 = a.read(2)
    a.accept([d0, d1])
    w0 = TickWrite(d0, "job-0", _tokens("job-0", range(3)))
    w1 = TickWrite(d1, "job-1", _tokens("job-1", range(2)))
    assert tick(a, w0, w1) == [TickReply(TickVerdict.OK, 3), TickReply(TickVerdict.OK, 2)]
    # A resync resends everything: only the missing indices are appended.
    again = TickWrite(d0, "job-0", _tokens("job-0", range(5)))
    assert tick(a, again) == [TickReply(TickVerdict.OK, 5)]
    assert [e.index for e in events(r, "job-0")] == [0, 1, 2, 3, 4]
    assert r.hget(KEYS.job("job-0"), "emitted") == b"5"
    # An event past a hole is not appended: the worker is told where to resend from.
    hole = TickWrite(d1, "job-1", _tokens("job-1", range(3, 4)))
    assert tick(a, hole) == [TickReply(TickVerdict.GAP, 2)]
    assert [e.index for e in events(r, "job-1")] == [0, 1]
    # Another worker never writes for a's jobs, whatever it sends.
    assert tick(b, TickWrite(d0, "job-0", _tokens("job-0", range(5, 9)))) == [
        TickReply(TickVerdict.LOST, 0)
    ]
    result, fin = outcome("job-0")
    result = result.model_copy(update={"token_ids": [100 + i for i in range(5)]})
    end = TickWrite(d0, "job-0", [], (result, fin))
    assert tick(b, end) == [TickReply(TickVerdict.LOST, 0)]
    assert not r.exists(KEYS.result("job-0"))
    assert tick(a, end) == [TickReply(TickVerdict.DONE, 5)]
    assert decode_result(r.get(KEYS.result("job-0"))) == result
    assert [type(e).__name__ for e in events(r, "job-0")] == ["TokenEvent"] * 5 + ["FinishEvent"]
    # Finished: a late tick (a paused worker waking up) writes nothing more.
    late = TickWrite(d0, "job-0", _tokens("job-0", range(7)), (result, fin))
    assert tick(a, late) == [TickReply(TickVerdict.LOST, 0)]
    assert len(events(r, "job-0")) == 6 and len(finish_events(r, "job-0")) == 1
    assert r.xlen(STREAM) == 1  # job-1 is still in flight


def test_tick_reports_cancel_and_fences_a_claimed_job(r: redis.Redis) -> None:
    (handle,) = submit(r, 1)
    a, b = worker(r, "a"), worker(r, "b")
    (d,) = a.read(1)
    a.accept([d])
    assert handle.cancel()
    assert tick(a, TickWrite(d, "job-0", _tokens("job-0", range(1)))) == [
        TickReply(TickVerdict.CANCEL, 1)
    ]
    # b takes the entry over (a's heartbeat expired): a's writes are refused from now on.
    r.xclaim(STREAM, GROUP, "b", 0, [d.entry_id])
    assert tick(a, TickWrite(d, "job-0", _tokens("job-0", range(4)))) == [
        TickReply(TickVerdict.LOST, 0)
    ]
    assert tick(b, TickWrite(d, "job-0", _tokens("job-0", range(2)))) == [
        TickReply(TickVerdict.CANCEL, 2)
    ]
    assert [e.index for e in events(r, "job-0")] == [0, 1]


def test_emitted_tokens_is_the_contiguous_run_from_zero(r: redis.Redis) -> None:
    a = worker(r, "a")
    assert a.emitted_tokens("job-0") == []
    pipe = r.pipeline(transaction=False)
    for index, token in [(0, 10), (1, 11), (1, 99), (0, 98), (2, 12), (4, 14)]:
        queue_event(pipe, KEYS, TokenEvent(job_id="job-0", index=index, token_id=token))
    pipe.execute()
    r.xadd(KEYS.events("job-0"), {"m": b"\xc1 not msgpack"})
    r.xadd(KEYS.events("job-0"), {"other": b"no m field"})
    r.xadd(KEYS.events("job-0"), {"m": encode(TokenEvent(job_id="job-9", index=3, token_id=1))})
    _result, fin = outcome("job-0")
    pipe = r.pipeline(transaction=False)
    queue_event(pipe, KEYS, TokenEvent(job_id="job-0", index=3, token_id=13))
    queue_event(pipe, KEYS, fin)
    pipe.execute()
    assert a.emitted_tokens("job-0") == [10, 11, 12, 13, 14]

    pipe = r.pipeline(transaction=False)
    queue_event(pipe, KEYS, TokenEvent(job_id="job-1", index=1, token_id=5))  # no index 0
    pipe.execute()
    assert a.emitted_tokens("job-1") == []


# --- heartbeat and fleet view --------------------------------------------------------
def test_heartbeat_live_workers_and_leave(r: redis.Redis) -> None:
    a, b = worker(r, "a"), worker(r, "b")
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(KEYS.telemetry_channel())
    wait_for(lambda: r.pubsub_numsub(KEYS.telemetry_channel())[0][1] == 1, 5, "subscription")
    info = {"slots": 4, "model": "tiny", "load": 0.5, "ok": True, "tags": ["x"]}
    a.heartbeat(info)
    pipe = r.pipeline(transaction=False)
    b.heartbeat({"model": "123"}, pipe=pipe)  # a string that looks like a number
    pipe.execute()
    r.zadd(KEYS.workers(), {"ghost": 1.0})  # its hash expired long ago

    assert live_workers(r, KEYS) == {
        "a": {"worker": "a", **info},
        "b": {"worker": "b", "model": "123"},
    }
    assert r.zscore(KEYS.workers(), "ghost") is None  # pruned
    assert 0 < r.ttl(KEYS.worker("a")) <= WORKER_TTL_S
    message = None

    def published() -> bool:
        nonlocal message
        message = pubsub.get_message(timeout=0.05)
        return message is not None

    wait_for(published, 5, "telemetry")
    assert message is not None and json.loads(message["data"]) == {"worker": "a", **info}
    pubsub.close()

    a.leave()
    assert set(live_workers(r, KEYS)) == {"b"}
    assert r.zscore(KEYS.workers(), "a") is None and not r.exists(KEYS.worker("a"))


def test_queue_stats(r: redis.Redis) -> None:
    empty = {"depth": 0, "lag": None, "pending": 0, "consumers": 0}
    assert queue_stats(r, KEYS) == empty
    submit(r, 3)
    worker(r, "a").read(1)
    assert queue_stats(r, KEYS) == {"depth": 3, "lag": 2, "pending": 1, "consumers": 1}
    assert queue_stats(r, KEYS, model="other") == empty


def test_redeliver_counts_a_retry_only_for_the_owner(r: redis.Redis) -> None:
    submit(r, 2)
    a, b = worker(r, "a"), worker(r, "b")
    mine, deleted = a.read(2)
    assert a.redeliver(mine) == 2
    assert a.redeliver(mine) == 3
    assert b.redeliver(mine) is None  # not b's
    assert pending(r)[0] == (mine.entry_id, "a")
    r.xdel(STREAM, deleted.entry_id)
    assert a.redeliver(deleted) is None
    assert finish(a, mine) == [TickVerdict.DONE]
    assert a.redeliver(mine) is None  # finished
