"""A job's whole path through a real worker process and a real redis-server."""

from __future__ import annotations

import redis

from tests.helpers.support import KEYS
from tests.helpers.workers import Fleet, in_process
from tokenfleet.model import load_model
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig


def test_submit_stream_result_through_a_worker_matches_the_engine(
    fleet: Fleet, r: redis.Redis
) -> None:
    producer = Producer(r)
    requests = [
        GenerationRequest(
            job_id="greedy", prompt="Hello, fleet!", max_new_tokens=24, ignore_eos=True
        ),
        GenerationRequest(
            job_id="sampled",
            prompt="Once upon a time",
            max_new_tokens=16,
            sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=42),
            ignore_eos=True,
        ),
        GenerationRequest(job_id="ids", prompt_ids=[5, 6, 7], max_new_tokens=8, ignore_eos=True),
    ]
    handles = [producer.submit(request) for request in requests]
    worker = fleet.start("w1")
    expected = in_process(requests)
    for handle in handles:
        events = list(handle.stream(timeout=60))
        assert [e.index for e in events] == list(range(len(events)))
        result = handle.result(timeout=60)
        assert result.finish_reason == FinishReason.LENGTH
        assert [e.token_id for e in events] == result.token_ids == expected[handle.id].token_ids
        assert "".join(e.text for e in events) == result.text == expected[handle.id].text
        assert result.worker == "w1"
        assert handle.status().status == "finished"
    assert worker.wait(60) == 0, worker.output()
    assert r.xlen(KEYS.jobs()) == 0
    assert r.xpending(KEYS.jobs(), "workers")["pending"] == 0


class CountingConnection(redis.Connection):
    """Counts the requests this client sends: one per command, one per pipeline; not
    redis-py's own handshake on each new connection (HELLO, CLIENT SETINFO), whose number
    depends on its version, not on the loop."""

    sent = 0
    _connecting = False

    def on_connect(self) -> None:
        self._connecting = True
        try:
            super().on_connect()
        finally:
            self._connecting = False

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        if not self._connecting:
            type(self).sent += 1
        super().send_packed_command(command, check_health)  # type: ignore[arg-type]


def test_a_busy_worker_makes_one_round_trip_per_tick(r: redis.Redis, redis_url: str) -> None:
    """While sessions decode, a tick's token events, finishes, heartbeat, cancel check and
    the next read all go out in ONE pipelined call."""
    from tokenfleet.worker.loop import Worker, WorkerOptions

    producer = Producer(r)
    handles = [
        producer.submit(prompt=f"round trip {i}", max_new_tokens=96, ignore_eos=True)
        for i in range(6)
    ]
    engine = Engine(load_model("tiny-random", device="cpu"), EngineConfig(), worker="rtt")
    pool = redis.ConnectionPool.from_url(redis_url, connection_class=CountingConnection)
    client = redis.Redis(connection_pool=pool)
    options = WorkerOptions(name="rtt", burst=True, idle_block_ms=50, claim_every_s=3600)
    CountingConnection.sent = 0
    assert Worker(engine, client, KEYS, options).run() == 0
    ticks = engine.stats.ticks
    for handle in handles:
        assert handle.result(timeout=10).finish_reason == FinishReason.LENGTH
    # Besides one call per tick: start-up (3 groups, the probe, 2 script loads, a
    # heartbeat, 3 orphan looks), the blocked first reads, one accept per batch of new
    # entries, the round trips that only write the last finishes, the burst-mode XLEN
    # checks, leaving: 28-31 measured (6c2e2c2 and after, AMD EPYC, 2 cores). A second
    # call per tick would be 96 more.
    assert ticks >= 96
    assert CountingConnection.sent <= ticks + 40, (CountingConnection.sent, ticks)
    client.close()
