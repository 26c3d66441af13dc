"""Token coalescing (`--stream-interval N`): a worker sends a job's token events every N
ticks as ONE replay entry and ONE message (their encodings back to back), its first token
and its end at once. Clients still get every token once, in order, equal to the result;
a kill -9 of a coalescing worker resumes token-exact; a cancel is seen within N ticks.
Real worker processes, a real redis-server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import redis

from tests.helpers.support import KEYS, wait_for
from tests.helpers.workers import Fleet, collect, in_process
from tokenfleet.errors import ProtocolError
from tokenfleet.producer import Producer
from tokenfleet.protocol import (
    FinishEvent,
    GenerationRequest,
    TokenEvent,
    decode_events,
    encode,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.loop import WorkerOptions
from tokenfleet.worker.session import Outbox


def _events(n: int) -> list[TokenEvent]:
    return [TokenEvent(job_id="j", index=i, token_id=i) for i in range(n)]


def test_an_outbox_is_due_on_flush_ticks_with_the_first_token_and_the_end_at_once() -> None:
    events: list[TokenEvent] = []
    box = Outbox(events)
    assert not box.due(False) and not box.in_tick(False)  # nothing yet: checked
    assert box.in_tick(True)  # on flush ticks only (its owner and cancel checks)
    events += _events(1)
    assert box.due(False)  # the first token goes at once, flush tick or not
    box.confirm(1)
    events += [TokenEvent(job_id="j", index=i, token_id=i) for i in (1, 2, 3)]
    assert not box.due(False) and not box.in_tick(False)  # held: skips the round trip
    assert box.due(True)  # the next flush takes them all
    box.confirm(4)
    box.rewind()  # after a reconnect everything goes again, at once
    assert box.due(False)
    resumed = Outbox(_events(7), sent=7)  # 7 tokens published by a worker that died
    resumed.events.append(TokenEvent(job_id="j", index=7, token_id=7))  # type: ignore[attr-defined]
    assert resumed.due(False)  # its first token here goes at once too
    ended = Outbox(_events(2), sent=1)
    ended.first = 0
    assert not ended.due(False)
    ended.end = object()  # type: ignore[assignment]
    assert ended.due(False)  # an end is never held back
    with pytest.raises(ValueError, match="stream_interval"):
        WorkerOptions(stream_interval=0)


def test_coalesced_payloads_decode_to_every_event_and_garbage_is_refused() -> None:
    tokens = _events(3)
    finish = FinishEvent(job_id="j", reason=FinishReason.LENGTH)
    data = b"".join(encode(e) for e in [*tokens, finish])
    assert decode_events(data) == [*tokens, finish]
    assert decode_events(encode(tokens[0])) == [tokens[0]]  # one event: as before
    for bad in (data[:-3], data + b"\x92", b"", data + msgpack.packb([1, 2])):
        with pytest.raises(ProtocolError):
            decode_events(bad)


def _jobs(prefix: str, count: int, tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            job_id=f"{prefix}-{i}",
            prompt=f"coalesce {i} " * (1 + i % 3),
            max_new_tokens=tokens,
            ignore_eos=True,
        )
        for i in range(count)
    ]


def _entries(r: redis.Redis, job_id: str) -> list[list[TokenEvent | FinishEvent]]:
    return [decode_events(f[b"m"]) for _id, f in r.xrange(KEYS.events(job_id))]


def test_a_coalescing_worker_streams_every_token_once_in_fewer_entries(
    fleet: Fleet, r: redis.Redis
) -> None:
    requests = _jobs("co", 6, 40)
    producer = Producer(r)
    handles = [producer.submit(req) for req in requests]
    with ThreadPoolExecutor(max_workers=6) as pool:
        streams = [pool.submit(collect, h, 120) for h in handles]
        worker = fleet.start("co-w", "--stream-interval", "4")
        yielded = [s.result() for s in streams]
    assert worker.wait(120) == 0, worker.output()
    expected = in_process(requests)
    for handle, events in zip(handles, yielded, strict=True):
        result = handle.result(timeout=10)
        assert [e.token_id for e in events] == result.token_ids == expected[handle.id].token_ids
        assert "".join(e.text for e in events) == result.text
        entries = _entries(r, handle.id)
        assert [e.index for e in entries[0]] == [0]  # the first token at once
        assert isinstance(entries[-1][-1], FinishEvent)  # the end with the last tokens
        flat = [e.index for entry in entries for e in entry if isinstance(e, TokenEvent)]
        assert flat == list(range(40))
        # the first token, then the rest on every fourth tick (the worker's flush ticks,
        # one for all its jobs), the end at once: twelve entries at most, not 41 as one
        # event per entry would be
        assert len(entries) <= 12, [len(e) for e in entries]


def test_kill9_of_a_coalescing_worker_resumes_token_exact(fleet: Fleet, r: redis.Redis) -> None:
    requests = _jobs("co-kill", 4, 300)
    producer = Producer(r)
    handles = [producer.submit(req) for req in requests]
    with ThreadPoolExecutor(max_workers=4) as pool:
        streams = [pool.submit(collect, h, 120) for h in handles]
        first = fleet.start("co-a", "--stream-interval", "8", burst=False)

        def mid_stream() -> bool:
            emitted = [r.hget(KEYS.job(h.id), "emitted") for h in handles]
            return all(e is not None and 16 <= int(e) <= 200 for e in emitted)

        wait_for(mid_stream, 120, "every job mid-stream on the first worker")
        first.kill()
        second = fleet.start("co-b", "--stream-interval", "8")
        yielded = [s.result() for s in streams]
    assert second.wait(120) == 0, second.output()
    expected = in_process(requests)
    for handle, events in zip(handles, yielded, strict=True):
        result = handle.result(timeout=10)
        assert result.worker == "co-b"
        assert [e.token_id for e in events] == result.token_ids == expected[handle.id].token_ids
        indices = [
            e.index for entry in _entries(r, handle.id) for e in entry if isinstance(e, TokenEvent)
        ]
        assert indices == list(range(300)), handle.id  # each index once, in order


def test_a_cancel_is_seen_within_the_interval(fleet: Fleet, r: redis.Redis) -> None:
    producer = Producer(r)
    handle = producer.submit(prompt="cancel me", max_new_tokens=2000, ignore_eos=True)
    worker = fleet.start("co-c", "--stream-interval", "16")
    wait_for(lambda: int(r.hget(KEYS.job(handle.id), "emitted") or 0) >= 17, 60, "tokens out")
    handle.cancel()
    result = handle.result(timeout=60)
    assert result.finish_reason == FinishReason.CANCELLED
    assert len(result.token_ids) < 2000
    assert worker.wait(60) == 0, worker.output()


def test_between_flush_ticks_a_busy_worker_makes_no_round_trip(
    fleet: Fleet, r: redis.Redis
) -> None:
    """A tick with nothing to send (tokens held for the next flush, no first token, no
    end, no heartbeat due) costs no round trip: not even the read of new entries, which
    waits for the next flush tick as the tokens do. One 240-token job at interval 8 is
    about 30 flush ticks of tick.lua + pull.lua; reading on every tick would be 240+."""
    producer = Producer(r)
    (request,) = _jobs("co-quiet", 1, 240)
    handle = producer.submit(request)
    r.config_resetstat()
    worker = fleet.start("co-q", "--stream-interval", "8")
    events = collect(handle, 120)
    assert worker.wait(120) == 0, worker.output()
    assert [e.token_id for e in events] == handle.result(timeout=10).token_ids
    scripts = int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    assert 30 <= scripts <= 100, scripts


def test_a_busy_coalescing_worker_still_reads_new_jobs(fleet: Fleet, r: redis.Redis) -> None:
    """Between flush ticks a coalescing worker reads nothing, but a job submitted while
    it is busy is read on its next flush tick: it runs beside the first job and ends
    long before it, rather than waiting for the worker to go idle."""
    producer = Producer(r)
    (long,) = _jobs("co-busy-long", 1, 1500)
    (short,) = _jobs("co-busy-short", 1, 8)
    first = producer.submit(long)
    worker = fleet.start("co-busy", "--stream-interval", "8")
    wait_for(lambda: int(r.hget(KEYS.job(first.id), "emitted") or 0) >= 24, 60, "first mid-stream")
    second = producer.submit(short)
    assert len(second.result(timeout=60).token_ids) == 8
    emitted = int(r.hget(KEYS.job(first.id), "emitted") or 0)
    assert emitted < 1500, "the second job waited for the first to end"
    assert len(first.result(timeout=120).token_ids) == 1500
    assert worker.wait(60) == 0, worker.output()


# ---- by time: --stream-interval-ms ---------------------------------------------------


def test_an_interval_is_ticks_or_a_time_not_both() -> None:
    from tokenfleet.config.worker import WorkerSettings

    assert WorkerSettings(stream_interval_ms=25).stream_interval_ms == 25
    with pytest.raises(ValueError, match="not both"):
        WorkerSettings(stream_interval=4, stream_interval_ms=25)
    for bad in (0, -5, 20_000):
        with pytest.raises(ValueError, match="stream_interval_ms"):
            WorkerSettings(stream_interval_ms=bad)
    with pytest.raises(ValueError, match="exclude each other"):
        WorkerOptions(stream_interval=4, stream_interval_s=0.025)
    with pytest.raises(ValueError, match="stream_interval_s"):
        WorkerOptions(stream_interval_s=0.0)


def _tokens_per_entry(
    fleet: Fleet, r: redis.Redis, name: str, tokens: int, tick_ms: int, interval_ms: int
) -> list[int]:
    """One job of `tokens` on a sim worker ticking at least every `tick_ms` with
    `--stream-interval-ms interval_ms`: each replay entry's token count, after checking
    the client got every token once, in order, equal to the stored result, and the
    entries hold each index once, in order, ending with the finish."""
    handle = Producer(r).submit(prompt=name, max_new_tokens=tokens, ignore_eos=True)
    sim = ("--runner", "sim", "--sim-tok-s", "5000", "--sim-tick-ms", str(tick_ms))
    worker = fleet.start(name, *sim, "--stream-interval-ms", str(interval_ms))
    events = collect(handle, 120)
    assert worker.wait(120) == 0, worker.output()
    result = handle.result(timeout=10)
    assert [e.token_id for e in events] == result.token_ids
    assert len(result.token_ids) == tokens
    entries = _entries(r, handle.id)
    flat = [e for entry in entries for e in entry if isinstance(e, TokenEvent)]
    assert [(e.index, e.token_id) for e in flat] == list(enumerate(result.token_ids))
    assert isinstance(entries[-1][-1], FinishEvent)
    return [sum(isinstance(e, TokenEvent) for e in entry) for entry in entries]


def test_by_time_a_tick_slower_than_the_interval_sends_every_token(
    fleet: Fleet, r: redis.Redis
) -> None:
    """Ticks of at least 20 ms against a 5 ms interval: each tick's token goes out with
    its tick, one per entry, as at interval 1 (a time bound never holds slow ticks)."""
    counts = _tokens_per_entry(fleet, r, "co-ms-slow", 30, tick_ms=20, interval_ms=5)
    assert counts == [1] * 30, counts


def test_by_time_fast_ticks_share_a_send_within_the_interval(fleet: Fleet, r: redis.Redis) -> None:
    """Ticks of at least 20 ms against a 200 ms interval: the first token at once, then
    the held tokens once 200 ms passed, which at 20 ms or more a tick is within 10
    ticks: no entry holds more than 10 tokens (the 64-tick bound is not what sends),
    and tokens do share entries."""
    counts = _tokens_per_entry(fleet, r, "co-ms-fast", 60, tick_ms=20, interval_ms=200)
    assert counts[0] == 1, counts  # time to first token is never held back
    assert max(counts) <= 10, counts
    assert max(counts) >= 2 and len(counts) < 60, counts


def test_by_time_no_send_holds_more_than_64_ticks(fleet: Fleet, r: redis.Redis) -> None:
    """A 10 s interval over ticks of ~1 ms: the held tokens still go out every
    MAX_STREAM_INTERVAL (64) ticks, the bound a coalesced payload is sized for."""
    counts = _tokens_per_entry(fleet, r, "co-ms-cap", 200, tick_ms=1, interval_ms=10_000)
    assert max(counts) <= 64 and len(counts) >= 5, counts  # 1 + ceil(199 / 64)
