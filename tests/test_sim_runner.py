"""`SimRunner` (tokenfleet/model/sim_runner.py): a runner with no model whose ticks take
the time a GPU forward would, and whose tokens depend on (session, position, seed) only.

In process: the engine drives it to completion, with the same tokens at batch 1 and
batch 8 and after a resume, its pacing is `max(floor, rows / tok_s)`, and EOS comes
only when asked. As a process: `tokenfleet worker --runner sim --burst` against a real
redis-server serves jobs whose streamed tokens equal their stored results, and the
worker path imports no torch.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.engine_runs import request, run_all
from tests.helpers.workers import Fleet
from tokenfleet.config import WorkerSettings
from tokenfleet.model.sim_runner import (
    FIRST,
    LAST,
    SIM_SPEC,
    SimPace,
    SimRunner,
    session_key,
    sim_token,
)
from tokenfleet.producer import Producer
from tokenfleet.seam import DecodeStep, ResolvedSampling, SeqState, SeqStatus, TickPlan
from tokenfleet.worker.engine import Engine, EngineConfig

MiB = 1024 * 1024
EOS = min(SIM_SPEC.eos_token_ids)


class FakeTime:
    """A clock that only the runner's sleeps advance: what it slept is exact."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def sim_engine(max_batch: int, runner: SimRunner | None = None) -> Engine:
    if runner is None:
        fake = FakeTime()
        runner = SimRunner(clock=fake.clock, sleep=fake.sleep)
    config = EngineConfig(kv_budget_bytes=8 * MiB, max_batch_size=max_batch, max_waiting=64)
    return Engine(runner, config)


JOBS = {f"job-{i}": ([40 + i, 41, 42 + 2 * i, 43][: 2 + i % 3], 5 + 3 * i) for i in range(12)}


def test_the_engine_runs_it_to_the_end_with_the_same_tokens_at_any_batch() -> None:
    outputs = []
    for batch in (1, 8, 8):
        engine = sim_engine(batch)
        for i, (job_id, (prompt, n)) in enumerate(JOBS.items()):
            assert engine.submit(request(job_id, prompt, n, seed=i)).accepted
        outputs.append(run_all(engine))
    assert outputs[0] == outputs[1] == outputs[2]
    got = outputs[0]
    assert {j: len(t) for j, t in got.items()} == {j: n for j, (_, n) in JOBS.items()}
    every = [t for tokens in got.values() for t in tokens]
    assert all(FIRST <= t <= LAST for t in every)  # printable bytes: EOS never drawn
    assert len(set(every)) > 20  # not a constant
    # a pure function of (session, position, seed): the first token of job-0 sits at
    # position len(prompt)
    prompt0 = JOBS["job-0"][0]
    assert got["job-0"][0] == sim_token(session_key("job-0"), len(prompt0), 0)
    assert got["job-1"] != sim_engine_single("job-1", JOBS["job-1"], seed=99)


def sim_engine_single(job_id: str, job: tuple[list[int], int], seed: int) -> list[int]:
    engine = sim_engine(4)
    engine.submit(request(job_id, job[0], job[1], seed=seed))
    return run_all(engine)[job_id]


def test_a_resumed_job_continues_identically() -> None:
    prompt, n = [50, 51, 52], 12
    whole = sim_engine_single("r", (prompt, n), seed=3)
    engine = sim_engine(4)
    engine.submit(request("r", prompt, n, seed=3), resume_ids=whole[:5])
    assert run_all(engine)["r"] == whole


def test_a_tick_takes_the_floor_or_its_rows_at_the_workers_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pace = SimPace(tok_s=1000.0, tick_floor_s=0.010)
    assert pace.tick_s(4) == 0.010  # below floor * tok_s = 10 rows: the floor
    assert pace.tick_s(32) == pytest.approx(0.032)
    with pytest.raises(ValueError, match="tok_s must be > 0"):
        SimPace(tok_s=0)
    fake = FakeTime()
    runner = SimRunner(pace, clock=fake.clock, sleep=fake.sleep)
    rows: list[int] = []
    execute = runner.execute

    def counted(plan: TickPlan, *args: object) -> list[int]:
        rows.append(plan.num_decode_tokens + plan.num_prefill_tokens)
        return execute(plan, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "execute", counted)
    engine = sim_engine(32, runner)
    for i in range(32):
        engine.submit(request(f"p{i}", [60 + i, 61], 5 + i, seed=i))  # ends spread out
    run_all(engine)
    # the fake clock moves only when the runner sleeps: each tick slept its whole pace
    assert fake.sleeps == [pace.tick_s(r) for r in rows]
    assert runner.ticks == len(rows) and runner.slept_s == pytest.approx(sum(fake.sleeps))
    # the prompts fed, then a decode row per token after each job's first
    assert sum(rows) == runner.rows == 32 * 2 + sum(4 + i for i in range(32))
    assert max(rows) > 10 and min(rows) < 10  # both regimes ran: rows / tok_s and the floor


def seq(sid: str, outputs: int) -> SeqState:
    return SeqState(
        session_id=sid,
        prompt_ids=[70, 71],
        max_new_tokens=50,
        output_ids=[72] * outputs,
        num_computed=1 + outputs,
        status=SeqStatus.DECODE,
    )


def decode(s: SeqState) -> DecodeStep:
    n = s.num_tokens
    return DecodeStep(s, s.all_ids[-1], n - 1, n, [0])


class Masks:
    def __init__(self, masks: dict[str, bytes]) -> None:
        self.masks = masks

    def __contains__(self, sid: object) -> bool:
        return sid in self.masks

    def get(self, sid: str) -> bytes:
        return self.masks[sid]


def test_eos_only_when_asked_and_masks_are_honoured() -> None:
    fake = FakeTime()
    runner = SimRunner(eos_after=3, clock=fake.clock, sleep=fake.sleep)
    plan = TickPlan(decode=[decode(seq("a", 2)), decode(seq("b", 3))], prefill=[])
    sampling = {"a": ResolvedSampling(seed=1), "b": ResolvedSampling(seed=1)}
    a, b = runner.execute(plan, sampling)
    assert a != EOS and b == EOS  # output index 2 draws; index 3 is EOS
    # a mask allowing only token 65 ('A') and 66: the session gets one of them
    words = bytearray((SIM_SPEC.vocab_size + 31) // 32 * 4)
    for t in (65, 66):
        words[t // 8] |= 1 << (t % 8)
    plan = TickPlan(decode=[decode(seq("c", 0))], prefill=[])
    [c] = runner.execute(plan, {"c": ResolvedSampling(seed=2)}, Masks({"c": bytes(words)}))
    assert c in (65, 66)
    runner.release("c")
    runner.release("never-seen")  # a no-op


def test_the_sim_worker_path_imports_no_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from tokenfleet.config import WorkerSettings
        from tokenfleet.model.sim_runner import SimRunner
        from tokenfleet.worker.main import build_worker
        worker = build_worker(WorkerSettings(
            redis_url=sys.argv[1], runner="sim", sim_tok_s=500, sim_tick_ms=4, name="sim-nt"))
        assert isinstance(worker.engine.runner, SimRunner)
        assert worker.engine.runner.pace.tick_floor_s == 0.004
        info = worker.options.info
        assert (info["runner"], info["sim_tok_s"], info["sim_tick_ms"]) == ("sim", 500, 4)
        assert worker.engine.threads is None
        print("ok")
        """
    )
    proc = subprocess.run(  # building connects to nothing: any URL does
        [sys.executable, "-c", code, "redis://127.0.0.1:1/0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_runner_setting_is_validated() -> None:
    assert WorkerSettings().runner == "torch"
    with pytest.raises(ValueError, match="runner must be one of torch, llamacpp, sim"):
        WorkerSettings(runner="gpu")


def test_a_sim_worker_process_serves_jobs_whose_streams_equal_their_results(
    redis_url: str, fleet: Fleet
) -> None:
    producer = Producer.from_url(redis_url)
    jobs = {f"sim-{i}": ([80 + i, 81, 82], 8 + 5 * i) for i in range(10)}
    handles = [
        producer.submit(request(job_id, prompt, n, seed=i))
        for i, (job_id, (prompt, n)) in enumerate(jobs.items())
    ]
    worker = fleet.start("sim-w", "--runner", "sim", "--sim-tok-s", "5000", "--sim-tick-ms", "2")
    streamed = {h.id: [e.token_id for e in h.stream(timeout=60)] for h in handles}
    assert worker.wait(timeout=60) == 0, worker.output()  # burst: exits once all are done
    results = {h.id: h.result(timeout=10) for h in handles}
    assert all(r.worker == "sim-w" for r in results.values())
    assert {j: r.token_ids for j, r in results.items()} == streamed
    assert {j: len(t) for j, t in streamed.items()} == {j: n for j, (_, n) in jobs.items()}
    # the same tokens as the runner gives in process
    engine = sim_engine(8)
    for i, (job_id, (prompt, n)) in enumerate(jobs.items()):
        engine.submit(request(job_id, prompt, n, seed=i))
    assert run_all(engine) == streamed
