"""A job's whole path through a real worker process and a real redis-server."""

from __future__ import annotations

import redis
from fleet import Fleet

from tokenfleet.keys import Keys
from tokenfleet.model import load_model
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig

KEYS = Keys()


def in_process(requests: list[GenerationRequest]) -> dict[str, tuple[list[int], str]]:
    engine = Engine(load_model("tiny-random", device="cpu"), EngineConfig(kv_budget_bytes=64 << 20))
    for request in requests:
        engine.submit(request)
    results: dict[str, tuple[list[int], str]] = {}
    while engine.has_work:
        for done in engine.step().finished:
            results[done.job_id] = (done.result.token_ids, done.result.text)
    return results


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
        assert [e.token_id for e in events] == result.token_ids == expected[handle.id][0]
        assert "".join(e.text for e in events) == result.text == expected[handle.id][1]
        assert result.worker == "w1"
        assert handle.status().status == "finished"
    assert worker.wait(60) == 0, worker.output()
    assert r.xlen(KEYS.jobs()) == 0
    assert r.xpending(KEYS.jobs(), "workers")["pending"] == 0
