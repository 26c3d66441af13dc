"""Priority bands and tenant limits, on a real redis-server: the order workers pull in
(pull.lua, fleet-wide starvation guard), a tenant's queued limit at submit (submit.lua)
and its running limit at start (accept.lua), then the issue's scenarios with real worker
processes: a flood of batch jobs does not delay interactive ones, tenant A at its limit
is refused while tenant B is admitted, and batch work still finishes."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tests.helpers.support import KEYS, wait_for
from tests.helpers.ticks import finish
from tests.helpers.workers import Fleet
from tokenfleet.errors import QueueFull, TenantQueueFull
from tokenfleet.keys import GROUP, STARVATION_GUARD
from tokenfleet.producer import Producer
from tokenfleet.protocol import FinishEvent, GenerationRequest, JobResult, SamplingParams, Usage
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.queue import TickVerdict, Verdict, WorkerQueue


def queue(r: redis.Redis, name: str) -> WorkerQueue:
    q = WorkerQueue(r, KEYS, name)
    q.ensure_group()
    q.load_scripts()
    return q


def job(job_id: str, priority: str = "default", tenant: str = "default") -> GenerationRequest:
    return GenerationRequest(
        job_id=job_id,
        prompt_ids=[1, 2, 3],
        max_new_tokens=4,
        priority=priority,  # type: ignore[arg-type]
        tenant=tenant,
    )


# --- the order of pulls ---------------------------------------------------------------
def test_a_worker_pulls_the_highest_band_first_and_fifo_within_a_band(r: redis.Redis) -> None:
    producer = Producer(r)
    for i in range(3):
        producer.submit(job(f"b{i}", "batch"))
    for i in range(2):
        producer.submit(job(f"d{i}"))
    producer.submit(job("i0", "interactive"))
    producer.submit(job("i1", "interactive"))
    got = queue(r, "a").read(10)
    assert [d.job_id for d in got] == ["i0", "i1", "d0", "d1", "b0", "b1", "b2"]
    assert [d.stream for d in got[:3]] == [KEYS.jobs(None, "interactive")] * 2 + [KEYS.jobs()]
    # each band is its own stream: XLEN is that band's depth
    assert [r.xlen(b.stream) for b in KEYS.bands()] == [2, 2, 3]


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_the_starvation_guard_gives_a_waiting_band_one_pull_in_guard_plus_one(
    r: redis.Redis, chunk: int
) -> None:
    """40 interactive and 5 batch jobs waiting: however the pulls are cut up (one job at a
    time, or all in one read) and whichever worker pulls, the batch band gets pull 17 and
    pull 34 (it waited while 16 interactive jobs went first), then what is left."""
    producer = Producer(r)
    for i in range(5):
        producer.submit(job(f"b{i}", "batch"))
    for i in range(40):
        producer.submit(job(f"i{i}", "interactive"))
    workers = [queue(r, "a"), queue(r, "b")]
    order: list[str] = []
    turn = 0
    while len(order) < 45:
        got = workers[turn % 2].read(chunk)
        assert got, "the queue ran dry early"
        order += [d.job_id or "" for d in got]
        turn += 1
    g = STARVATION_GUARD
    expected = [f"i{i}" for i in range(g)] + ["b0"]
    expected += [f"i{i}" for i in range(g, 2 * g)] + ["b1"]
    expected += [f"i{i}" for i in range(2 * g, 40)] + ["b2", "b3", "b4"]
    assert order == expected


def test_every_lower_band_gets_its_share_and_a_band_that_empties_starts_over(
    r: redis.Redis,
) -> None:
    producer = Producer(r)
    producer.submit(job("d0"))
    producer.submit(job("b0", "batch"))
    for i in range(20):
        producer.submit(job(f"i{i}", "interactive"))
    q = queue(r, "a")

    def counts() -> dict[bytes, int]:
        return {k: int(v) for k, v in r.hgetall(KEYS.pulls()).items()}

    order = [d.job_id for d in q.read(10)]
    # the counts persist between reads (and workers): both lower bands passed over 10 times
    assert counts() == {b"interactive": 0, b"default": 10, b"batch": 10}
    order += [d.job_id for d in q.read(12)]
    g = STARVATION_GUARD
    # both lower bands are due after 16 interactive pulls: the higher of them first, and
    # the batch band, passed over once more meanwhile, right after it
    assert order[: g + 2] == [f"i{i}" for i in range(g)] + ["d0", "b0"]
    assert order[g + 2 :] == [f"i{i}" for i in range(g, 20)]
    # the guard's counts are reset for bands that have nothing waiting
    assert counts() == {b"interactive": 0, b"default": 0, b"batch": 0}
    # a full worker's pull of the highest band alone, with nothing there: no write at all
    r.delete(KEYS.pulls())
    pipe = r.pipeline(transaction=False)
    q.pull(0, pipe, extra=4)
    [reply] = pipe.execute()
    assert q.parse_pull(reply) == [] and not r.exists(KEYS.pulls())


def test_a_missing_group_on_a_band_is_recreated_and_the_pull_retried(r: redis.Redis) -> None:
    q = queue(r, "a")
    Producer(r).submit(job("b0", "batch"))
    r.xgroup_destroy(KEYS.jobs(None, "batch"), GROUP)  # as after a restart, or a new band
    assert [d.job_id for d in q.read(5)] == ["b0"]


# --- tenants: queued limit at submit ---------------------------------------------------
def test_a_tenant_at_its_queued_limit_is_refused_while_another_is_admitted(
    r: redis.Redis,
) -> None:
    producer = Producer(r)
    producer.set_queue_cap(20)
    r.hset(KEYS.tenant_limits(None), "queued_share", 0.25)  # every tenant: 5 of 20
    for i in range(5):
        producer.submit(job(f"a{i}", "batch", tenant="acme"))
    with pytest.raises(TenantQueueFull) as refused:
        producer.submit(job("a5", "interactive", tenant="acme"))  # the limit spans bands
    assert refused.value.tenant == "acme" and (refused.value.depth, refused.value.cap) == (5, 5)
    assert "acme" in str(refused.value) and "limit 5" in str(refused.value)
    assert isinstance(refused.value, QueueFull)  # callers that back off on QueueFull do here
    assert not r.exists(KEYS.job("a5"))  # nothing of the refused job was written
    for i in range(5):
        producer.submit(job(f"z{i}", tenant="zeta"))  # another tenant is still admitted
    # a tenant's own limit overrides the default one
    r.hset(KEYS.tenant_limits("acme"), "queued_share", 0.5)
    producer.submit(job("a5", tenant="acme"))
    assert r.zcard(KEYS.tenant_queued("acme")) == 6
    assert r.smembers(KEYS.tenants()) == {b"acme", b"zeta"}
    # once a worker starts one of acme's jobs, it is no longer queued: room again
    r.hset(KEYS.tenant_limits("acme"), "queued_share", 0.3)  # 6 of 20
    with pytest.raises(TenantQueueFull):
        producer.submit(job("a6", tenant="acme"))
    q = queue(r, "w")
    got = q.read(6)  # zeta's five default-band jobs, then acme's a5
    assert [d.tenant for d in got] == ["zeta"] * 5 + ["acme"]
    assert [a.verdict for a in q.accept(got)] == [Verdict.OK] * 6
    producer.submit(job("a6", tenant="acme"))
    assert r.zcard(KEYS.tenant_queued("acme")) == 6 and r.zcard(KEYS.tenant_running("acme")) == 1


def test_a_full_band_refuses_on_its_own_and_a_resubmit_is_still_idempotent(
    r: redis.Redis,
) -> None:
    producer = Producer(r)
    producer.set_queue_cap(2)
    producer.submit(job("b0", "batch"))
    producer.submit(job("b1", "batch"))
    with pytest.raises(QueueFull) as full:
        producer.submit(job("b2", "batch"))
    assert not isinstance(full.value, TenantQueueFull)
    assert full.value.stream == KEYS.jobs(None, "batch")
    producer.submit(job("i0", "interactive"))  # the batch band's flood leaves it room
    assert producer.submit(job("b0", "batch")).duplicate


# --- tenants: running limit at start ---------------------------------------------------
def test_a_job_whose_tenant_runs_its_limit_goes_back_to_the_tail_of_its_band(
    r: redis.Redis,
) -> None:
    producer = Producer(r)
    r.hset(KEYS.tenant_limits("acme"), "max_running", 1)
    for job_id in ("a0", "a1"):
        producer.submit(job(job_id, tenant="acme"))
    producer.submit(job("z0", tenant="zeta"))
    q = queue(r, "w")
    got = q.read(10)
    assert [d.job_id for d in got] == ["a0", "a1", "z0"]
    old_entry = got[1].entry_id
    verdicts = [a.verdict for a in q.accept(got)]
    assert verdicts == [Verdict.OK, Verdict.DEFERRED, Verdict.OK]
    # a1 waits at the tail again, as a new entry its state records; nobody holds it
    (entry_id, fields), *_ = r.xrange(KEYS.jobs())[-1:]
    assert fields[b"job_id"] == b"a1" and entry_id.decode() != old_entry
    state = r.hgetall(KEYS.job("a1"))
    assert state[b"status"] == b"queued" and state[b"entry"] == entry_id
    assert r.xpending(KEYS.jobs(), GROUP)["pending"] == 2
    # read again while a0 runs: a1 goes back once more
    (again,) = q.read(10)
    assert again.job_id == "a1" and [a.verdict for a in q.accept([again])] == [Verdict.DEFERRED]
    assert r.zcard(KEYS.tenant_running("acme")) == 1
    assert r.zcard(KEYS.tenant_queued("acme")) == 1
    # when a0 ends, a1 may start
    assert finish(q, got[0], got[2]) == [TickVerdict.DONE] * 2  # a0 and z0 end
    assert r.zcard(KEYS.tenant_running("acme")) == 0
    again = q.read(10)
    assert [d.job_id for d in again] == ["a1"]
    assert [a.verdict for a in q.accept(again)] == [Verdict.OK]
    assert r.zrange(KEYS.tenant_running("acme"), 0, -1) == [b"a1"]
    assert r.zcard(KEYS.tenant_queued("acme")) == 0
    assert finish(q, again[0]) == [TickVerdict.DONE]
    assert r.zcard(KEYS.tenant_running("acme")) == 0 and r.xlen(KEYS.jobs()) == 0


def test_dead_lettering_a_started_job_leaves_its_tenant_sets(r: redis.Redis) -> None:
    Producer(r).submit(job("a0", tenant="acme"))
    q = queue(r, "w")
    (d,) = q.read(1)
    q.accept([d])
    result = JobResult(job_id="a0", finish_reason=FinishReason.ERROR)
    fin = FinishEvent(job_id="a0", reason=FinishReason.ERROR, usage=Usage())
    assert q.dead_letter(d, "engine_error", "boom", finish=fin, result=result)
    assert r.zcard(KEYS.tenant_running("acme")) == 0 and r.zcard(KEYS.tenant_queued("acme")) == 0


# --- real workers ---------------------------------------------------------------------
def _started(r: redis.Redis, job_id: str) -> float:
    raw = r.hget(KEYS.job(job_id), "started_at")
    assert raw is not None, f"{job_id} has not started"
    return float(raw)


def test_interactive_jobs_overtake_a_queued_batch_flood_and_the_flood_still_finishes(
    fleet: Fleet, r: redis.Redis
) -> None:
    """500 batch jobs queued, then 8 interactive jobs one after another while a real worker
    serves the flood: each interactive job starts before every batch job still waiting
    when it arrived, waits a few ticks at most, and all 500 batch jobs finish."""
    producer = Producer(r)
    flood = [
        GenerationRequest(
            job_id=f"batch-{i}",
            prompt_ids=[1 + i % 50, 2, 3],
            max_new_tokens=8,
            ignore_eos=True,
            priority="batch",
        )
        for i in range(500)
    ]
    entries = {o.job_id: o.handle.entry_id for o in producer.submit_many(flood) if o.handle}
    assert len(entries) == 500
    fleet.start("w1", "--max-active", "8", burst=False)
    batch_stream = KEYS.jobs(None, "batch")
    wait_for(lambda: r.xlen(batch_stream) <= 480, 120, "the worker to serve the flood")
    waiting_at: dict[str, list[str]] = {}
    handles = []
    for n in range(8):
        request = GenerationRequest(
            job_id=f"interactive-{n}",
            prompt_ids=[7, 8, 9],
            max_new_tokens=8,
            ignore_eos=True,
            priority="interactive",
        )
        handles.append(producer.submit(request))
        # batch entries the group had not delivered once this job was in: they were
        # still waiting when it arrived
        (group,) = r.xinfo_groups(batch_stream)
        last = group["last-delivered-id"].decode()
        waiting_at[request.job_id] = [
            job_id for job_id, entry in entries.items() if _after(entry, last)
        ]
        handles[-1].result(timeout=60)
    for handle in handles:
        start = _started(r, handle.id)
        waiting = waiting_at[handle.id]
        assert waiting, "the flood was already drained: the test proves nothing"
        late = [b for b in waiting if r.hget(KEYS.job(b), "started_at") is not None]
        assert all(_started(r, b) >= start for b in late), handle.id
    # its queue wait, in ticks of the batch jobs running beside it
    tick_s = _tick_seconds(producer, [f"batch-{i}" for i in range(20)])
    for handle in handles:
        queued = handle.result(timeout=1).timings.queued_s
        assert queued is not None and queued <= 6 * tick_s, (handle.id, queued, tick_s)
    # no starvation: the whole flood finishes
    wait_for(lambda: r.xlen(batch_stream) == 0, 300, "the batch flood to finish")
    finished = [producer.handle(f"batch-{i}").status().status for i in range(500)]
    assert finished == ["finished"] * 500


def _after(entry: str, last: str) -> bool:
    a, b = (tuple(int(x) for x in s.split("-")) for s in (entry, last))
    return a > b


def _tick_seconds(producer: Producer, job_ids: list[str]) -> float:
    """Seconds per decode tick, as the batch jobs saw it: (total - ttft) / (tokens - 1)."""
    per_token = []
    for job_id in job_ids:
        result = producer.handle(job_id).result(timeout=60)
        t = result.timings
        assert t.total_s is not None and t.ttft_s is not None
        per_token.append((t.total_s - t.ttft_s) / max(1, len(result.token_ids) - 1))
    per_token.sort()
    return per_token[len(per_token) // 2]


def test_two_tenants_through_real_workers_limits_hold_and_every_job_finishes(
    fleet: Fleet, r: redis.Redis
) -> None:
    """Tenant acme floods; at its queued limit it is refused while zeta is still admitted.
    With max_running 2, acme never runs more than 2 jobs at once across two workers, and
    every admitted job of both tenants finishes."""
    producer = Producer(r)
    producer.set_queue_cap(100)
    r.hset(KEYS.tenant_limits("acme"), mapping={"queued_share": 0.2, "max_running": 2})
    admitted, refused = [], 0
    for i in range(40):
        try:
            admitted.append(producer.submit(job(f"acme-{i}", "batch", tenant="acme")))
        except TenantQueueFull as exc:
            assert exc.tenant == "acme" and exc.cap == 20
            refused += 1
    assert len(admitted) == 20 and refused == 20
    zeta = [producer.submit(job(f"zeta-{i}", tenant="zeta")) for i in range(10)]
    most = 0

    def running_acme() -> int:
        nonlocal most
        most = max(most, int(r.zcard(KEYS.tenant_running("acme"))))
        return most

    def all_finished() -> bool:
        running_acme()  # sampled on every poll: a third acme job running would show
        return all(r.hget(KEYS.job(h.id), "status") == b"finished" for h in zeta + admitted)

    fleet.start("w1", "--max-active", "4", burst=False)
    fleet.start("w2", "--max-active", "4", burst=False)
    wait_for(all_finished, 300, "every admitted job to finish")
    for handle in zeta + admitted:
        assert handle.result(timeout=5).finish_reason == FinishReason.LENGTH
    assert 1 <= most <= 2
    states = [r.hget(KEYS.job(f"acme-{i}"), "status") for i in range(20)]
    assert states == [b"finished"] * 20
    assert r.zcard(KEYS.tenant_running("acme")) == 0 == r.zcard(KEYS.tenant_queued("acme"))


# --- preemption on a worker -------------------------------------------------------------
def _engine(max_active: int) -> Any:
    from tokenfleet.model import load_model
    from tokenfleet.worker.engine import Engine, EngineConfig

    config = EngineConfig(kv_budget_bytes=64 << 20, max_active=max_active, max_waiting=4)
    return Engine(load_model("tiny-random", device="cpu"), config)


def _long(job_id: str, priority: str, new: int, seed: int) -> GenerationRequest:
    return GenerationRequest(
        job_id=job_id,
        prompt_ids=[3 + seed, 4, 5, 6, 7, 8, 9],
        max_new_tokens=new,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=seed),
        priority=priority,  # type: ignore[arg-type]
    )


def _run(engine: Any, events: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Step until idle: each job's result; token indices seen go to `events`."""
    results: dict[str, Any] = {}
    while engine.has_work:
        _record(engine.step(), events, results)
    return results


def _record(out: Any, events: dict[str, list[int]] | None, results: dict[str, Any]) -> None:
    for e in out.tokens:
        if events is not None:
            events.setdefault(e.job_id, []).append(e.index)
    for f in out.finished:
        results[f.job_id] = f.result


def test_an_interactive_job_preempts_a_batch_session_which_resumes_unchanged() -> None:
    """Both slots run batch jobs; an interactive job arrives: the next tick puts the batch
    job with the least done back to wait and starts the interactive one. The preempted job
    later resumes from prompt + emitted tokens with the same session: every job's tokens
    (seeded sampling) and events are exactly those of a run without the interruption."""
    batch = [_long("b0", "batch", 40, 1), _long("b1", "batch", 40, 2)]
    urgent = _long("i0", "interactive", 8, 3)
    reference = _engine(4)
    for request in [*batch, urgent]:
        assert reference.submit(request).accepted
    expected = _run(reference)

    engine = _engine(2)
    events: dict[str, list[int]] = {}
    results: dict[str, Any] = {}
    for request in batch:
        assert engine.submit(request).accepted
    for _ in range(6):
        _record(engine.step(), events, results)
    assert engine.interactive_room() == 2  # two batch sessions it could preempt
    assert engine.submit(urgent).accepted  # queued: both slots are taken
    _record(engine.step(), events, results)
    assert "i0" in engine.sessions and len(engine.sessions) == 2
    (preempted,) = [s.job_id for s in engine.waiting]
    assert preempted in ("b0", "b1") and engine.stats.preempted == 1
    assert engine.telemetry()["preempted_total"] == 1
    results |= _run(engine, events)
    for job_id in ("b0", "b1", "i0"):
        assert results[job_id].token_ids == expected[job_id].token_ids, job_id
        assert results[job_id].text == expected[job_id].text
        assert events[job_id] == list(range(len(expected[job_id].token_ids)))  # once each
    # the interactive job finished before the batch job it threw out
    assert results["i0"].timings.total_s < results[preempted].timings.total_s


def test_jobs_of_one_band_never_preempt_each_other() -> None:
    engine = _engine(1)
    assert engine.submit(_long("b0", "batch", 20, 1)).accepted
    engine.step()
    assert engine.submit(_long("b1", "batch", 4, 2)).accepted
    engine.step()
    assert set(engine.sessions) == {"b0"} and engine.stats.preempted == 0
    assert engine.interactive_room() == 1
    assert engine.submit(_long("d0", "default", 4, 3)).accepted  # default outranks batch
    engine.step()
    assert set(engine.sessions) == {"d0"}
    # round robin within a band: b1 has waited longer than b0, put back just now
    head = engine.bands.next_to_start(engine.waiting)
    assert head is not None and head.job_id == "b1"
    results = _run(engine)
    assert {j: len(r.token_ids) for j, r in results.items()} == {"b0": 20, "b1": 4, "d0": 4}
