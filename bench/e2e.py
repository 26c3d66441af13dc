"""End to end through Redis: the engine benchmark's mixed workload, on the same weights,
through `tokenfleet worker` processes vs the engine in process, in the same run.

Usage: python bench/e2e.py [--configs tiny,small] [--workers 1,2,4] [--threads 2,1]
                           [--quick] [--out bench/out/e2e.json] [--plot docs/img/e2e.png]

Per config: one checkpoint (bench/_common.py's `build_checkpoint`), one embedded
redis-server, and blocks of k worker processes × t torch threads each: one block per
`--threads` value for k = 1 (default: all cores, then 1), one thread each for k > 1.
Each block starts its workers and warms them up (a small job, then an untimed round)
before any clock runs, then alternates rounds between
  in process     `Engine` in this process with the 1-worker node's EngineConfig (the
                 one its CLI flags build) and the block's torch threads per worker,
                 stepped until done;
  through Redis  `Producer.submit_many`, every job followed by `JobHandle.stream()`
                 in its own thread (subscribed before the submit), token arrival
                 times taken as the client sees them.
Each round runs two scenarios in both modes:
  all at once  the 16 mixed jobs submitted together: wall time until the last finish
               event, useful tokens/s (= generated tokens, ignore_eos), TTFT
               (first token − submit), queue wait (FinishEvent `queued_s`);
  burst        the 4 longest jobs first; once each has 8 tokens the other 12 are
               submitted at once; inter-token gaps of the 4 that end in the burst
               window [burst submit, last burst job's first token].
Workers run under a shim that adds the seconds spent inside `Engine.step` to their
heartbeat (nothing else changes), so the run can say where the time went.
k > 1: each worker holds 16/k sessions (--max-active/--max-batch, --max-waiting 0) so
the fleet, not the first reader, spreads the jobs.
Prints a table, writes JSON (and a PNG). `--quick`: one round per block, for development.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
import torch
from _common import Job, build_checkpoint, machine_info, mixed_jobs, num_params
from engine import Settings as EngineSettings

from tokenfleet.keys import Keys
from tokenfleet.local import EmbeddedRedis
from tokenfleet.model import LoadedModel, load_model
from tokenfleet.producer import Producer
from tokenfleet.protocol import FinishEvent, GenerationRequest, TokenEvent
from tokenfleet.worker.engine import Engine, EngineConfig
from tokenfleet.worker.publish import queue_event
from tokenfleet.worker.recovery import live_workers

MiB = 1024 * 1024
LONG = 4  # sessions in flight when the burst arrives
BURST_AFTER = 8  # tokens each of them has before the burst is submitted
TIMEOUT_S = 300.0
EXTRA_WORKER_ARGS: list[str] = []  # --worker-args: more `tokenfleet worker` flags (A/B runs)

# Runs `tokenfleet worker` unchanged except that the seconds inside Engine.step reach
# the heartbeat (as bench_step_s), so the loop's own time can be told apart.
WORKER_SHIM = """
import sys, time
from tokenfleet.worker.engine import Engine
_step, _telemetry = Engine.step, Engine.telemetry
def step(self):
    start = time.perf_counter()
    try:
        return _step(self)
    finally:
        self.bench_step_s = getattr(self, "bench_step_s", 0.0) + time.perf_counter() - start
def telemetry(self):
    return {**_telemetry(self), "bench_step_s": getattr(self, "bench_step_s", 0.0)}
Engine.step, Engine.telemetry = step, telemetry
from tokenfleet.cli import main
sys.argv = ["tokenfleet", *sys.argv[1:]]
main()
"""


@dataclass(frozen=True)
class NodeFlags:
    """One worker's engine, as `tokenfleet worker` flags and as the same EngineConfig."""

    kv_mb: int
    max_batch: int
    max_active: int
    max_waiting: int
    threads: int
    prefill_tokens: int = 256

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            kv_budget_bytes=self.kv_mb * MiB,
            max_active=self.max_active,
            max_batch_size=self.max_batch,
            max_prefill_tokens_per_tick=self.prefill_tokens,
            max_waiting=self.max_waiting,
        )

    def cli(self) -> list[str]:
        return [
            *("--kv-mb", str(self.kv_mb), "--max-batch", str(self.max_batch)),
            *("--max-active", str(self.max_active), "--max-waiting", str(self.max_waiting)),
            *("--prefill-tokens", str(self.prefill_tokens), "--threads", str(self.threads)),
        ]


def node_flags(loaded: LoadedModel, jobs: list[Job], workers: int, threads: int) -> NodeFlags:
    """bench/engine.py's `new_engine` budget for a batch of all the jobs (rounded up to
    whole MiB for the CLI); k workers share the sessions."""
    cfg = loaded.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    longest = max(len(j.prompt_ids) + j.max_new for j in jobs) + 16
    kv_mb = math.ceil(max(16 * MiB, 2 * per_token * longest * len(jobs)) / MiB)
    if workers == 1:
        return NodeFlags(kv_mb, len(jobs), len(jobs), len(jobs), threads)
    share = math.ceil(len(jobs) / workers)
    return NodeFlags(kv_mb, share, share, 0, threads)


def requests(jobs: list[Job], tag: str) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            job_id=f"{tag}-{i}", prompt_ids=j.prompt_ids, max_new_tokens=j.max_new, ignore_eos=True
        )
        for i, j in enumerate(jobs)
    ]


def scenario(jobs: list[Job], tag: str, burst: bool) -> list[list[GenerationRequest]]:
    """Submission groups: everything at once, or the LONG longest jobs then the rest."""
    reqs = requests(jobs, tag)
    if not burst:
        return [reqs]
    longest = sorted(range(len(jobs)), key=lambda i: -jobs[i].max_new)[:LONG]
    return [[reqs[i] for i in longest], [r for i, r in enumerate(reqs) if i not in longest]]


# ---- one run, either mode ----------------------------------------------------------


@dataclass
class Trace:
    """perf_counter times of one run: when each job was submitted, when each token and
    the finish event arrived (at the client, or after the step that produced them)."""

    groups: list[list[str]]
    submitted: dict[str, float] = field(default_factory=dict)
    arrivals: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_at: dict[str, float] = field(default_factory=dict)
    finish: dict[str, FinishEvent] = field(default_factory=dict)
    step_s: float = 0.0  # in process: time inside Engine.step
    ticks: int = 0

    @property
    def t0(self) -> float:
        return min(self.submitted.values())

    @property
    def wall_s(self) -> float:
        return max(self.finished_at.values()) - self.t0

    @property
    def useful_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def ttft_s(self, ids: Sequence[str] | None = None) -> list[float]:
        ids = list(self.submitted) if ids is None else ids
        return [self.arrivals[j][0] - self.submitted[j] for j in ids]

    def queued_s(self) -> list[float]:
        return [f.timings.queued_s for f in self.finish.values() if f.timings.queued_s is not None]

    def burst_gaps_s(self) -> list[float]:
        """Gaps between consecutive tokens of the first group's jobs that end inside the
        window from the burst's submit to the last burst job's first token."""
        if len(self.groups) < 2:
            return []
        start = min(self.submitted[j] for j in self.groups[1])
        end = max(self.arrivals[j][0] for j in self.groups[1])
        gaps = []
        for j in self.groups[0]:
            a = self.arrivals[j]
            gaps += [b - a_ for a_, b in itertools.pairwise(a) if start < b <= end]
        return gaps

    def all_gaps_s(self) -> list[float]:
        return [b - a for t in self.arrivals.values() for a, b in itertools.pairwise(t)]


def run_inprocess(
    loaded: LoadedModel, flags: NodeFlags, groups: list[list[GenerationRequest]]
) -> Trace:
    """Submit the first group, step; submit the next once every job of the first has
    BURST_AFTER tokens. Event times are taken when the step that made them returns."""
    engine = Engine(loaded, flags.engine_config())
    trace = Trace([[r.job_id for r in g] for g in groups])
    for g in groups:
        for r in g:
            trace.arrivals[r.job_id], trace.tokens[r.job_id] = [], []
    waiting = list(groups)

    def submit_next() -> None:
        now = time.perf_counter()
        for r in waiting.pop(0):
            trace.submitted[r.job_id] = now
            assert engine.submit(r).accepted

    submit_next()
    while engine.has_work or waiting:
        if waiting and all(len(trace.tokens[j]) >= BURST_AFTER for j in trace.groups[0]):
            submit_next()
        start = time.perf_counter()
        out = engine.step()
        now = time.perf_counter()
        trace.step_s += now - start
        for event in out.tokens:
            trace.arrivals[event.job_id].append(now)
            trace.tokens[event.job_id].append(event.token_id)
        for done in out.finished:
            trace.finished_at[done.job_id] = now
            trace.finish[done.job_id] = done.event
    trace.ticks = engine.stats.ticks
    return trace


class Follower(threading.Thread):
    """Follows one job with `JobHandle.stream()`, timing every token as it arrives."""

    def __init__(self, producer: Producer, job_id: str) -> None:
        super().__init__(daemon=True)
        self.handle = producer.handle(job_id)
        self.arrivals: list[float] = []
        self.tokens: list[int] = []
        self.finished_at = 0.0
        self.reached = threading.Event()  # BURST_AFTER tokens seen (or the job ended)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for event in self.handle.stream(timeout=TIMEOUT_S):
                self.arrivals.append(time.perf_counter())
                self.tokens.append(event.token_id)
                if len(self.tokens) == BURST_AFTER:
                    self.reached.set()
            self.finished_at = time.perf_counter()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self.reached.set()


def run_redis(producer: Producer, groups: list[list[GenerationRequest]]) -> Trace:
    trace = Trace([[r.job_id for r in g] for g in groups])
    followers = {r.job_id: Follower(producer, r.job_id) for g in groups for r in g}
    for f in followers.values():
        f.start()
    channels = [producer.keys.channel(j) for j in followers]
    deadline = time.monotonic() + 30
    while not all(n >= 1 for _, n in producer.redis.pubsub_numsub(*channels)):
        if time.monotonic() > deadline:
            raise TimeoutError("followers did not subscribe")
        time.sleep(0.005)
    for i, g in enumerate(groups):
        if i > 0:
            for j in trace.groups[0]:
                if not followers[j].reached.wait(TIMEOUT_S):
                    raise TimeoutError(f"{j} did not reach {BURST_AFTER} tokens")
        now = time.perf_counter()
        outcomes = producer.submit_many(g)
        for r, outcome in zip(g, outcomes, strict=True):
            assert outcome.accepted and not outcome.duplicate, outcome
            trace.submitted[r.job_id] = now
    for j, f in followers.items():
        f.join(TIMEOUT_S)
        if f.error is not None or f.is_alive() or f.handle.finish is None:
            raise RuntimeError(f"job {j} did not finish: {f.error!r}")
        trace.arrivals[j], trace.tokens[j] = f.arrivals, f.tokens
        trace.finished_at[j], trace.finish[j] = f.finished_at, f.handle.finish
    return trace


# ---- the fleet ----------------------------------------------------------------------


def load_now() -> dict[str, Any]:
    """Load average and the share of the last 60 s some task waited for a CPU (Linux PSI)."""
    pressure = None
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()
        pressure = float(dict(f.split("=") for f in some[1:])["avg60"])
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpu_pressure_avg60": pressure}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Fleet:
    """k worker processes on one checkpoint and one Redis prefix."""

    def __init__(self, url: str, prefix: str, model_dir: str, flags: NodeFlags, k: int) -> None:
        self.keys = Keys(prefix)
        self.client = redis.Redis.from_url(url)
        self.producer = Producer(self.client, keys=self.keys)
        self.logs = tempfile.TemporaryDirectory(prefix="tokenfleet-e2e-")
        args = ["--redis-url", url, "--prefix", prefix, "--model", model_dir, "--device", "cpu"]
        args += ["--dtype", "float32", *flags.cli(), *EXTRA_WORKER_ARGS]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for i in range(k):
            name = f"e2e-{os.getpid()}-{i}"
            log = open(Path(self.logs.name) / f"{name}.log", "wb")  # noqa: SIM115
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-c", WORKER_SHIM, "worker", *args, "--name", name],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.pids = {name: p.pid for name, p in self.procs.items()}

    def wait_live(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while len(live_workers(self.client, self.keys)) < len(self.procs):
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"workers did not come up (exited: {dead}); {self.log_tail()}")
            time.sleep(0.1)

    def settle(self, timeout: float = 15) -> dict[str, dict[str, Any]]:
        """Wait for a heartbeat from every worker written after now with nothing held;
        return the heartbeats (ticks, bench_step_s, ... as of the end of the last run)."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while True:
            # Scores first: a heartbeat's HSET lands before its ZADD, so hashes read after
            # a fresh score are at least that fresh.
            stamps = [self.client.zscore(self.keys.workers(), n) or 0 for n in self.procs]
            live = live_workers(self.client, self.keys)
            beats = {n: live.get(n, {}) for n in self.procs}
            if all(s >= since for s in stamps) and all(
                b.get("held_jobs") == 0 and b.get("active") == 0 for b in beats.values()
            ):
                return beats
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not settle: {beats}")
            time.sleep(0.05)

    def cpu(self) -> dict[str, float]:
        return {n: cpu_seconds(pid) for n, pid in self.pids.items()}

    def log_tail(self) -> str:
        return " | ".join(
            p.read_text()[-800:] for p in Path(self.logs.name).glob("*.log") if p.stat().st_size
        )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.client.close()
        self.logs.cleanup()


def redis_costs(url: str, batch: int, reps: int = 200) -> dict[str, float]:
    """What the worker loop's Redis calls cost from one Python process here (median ms):
    a tick's token events in one pipeline (XADD + EXPIRE + PUBLISH each), the per-tick
    cancel check (MGET of the running jobs) and a non-blocking XREADGROUP."""
    client = redis.Redis.from_url(url)
    keys = Keys("bench-e2e-cost:")
    ids = [f"cost-{i}" for i in range(batch)]
    client.xgroup_create(keys.jobs(), "g", id="0", mkstream=True)

    def median_ms(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return 1000 * statistics.median(samples)

    def publish(n: int) -> None:
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            queue_event(pipe, keys, TokenEvent(job_id=ids[i], index=i, token_id=17))
        pipe.execute()

    out = {
        "publish_1_event_ms": median_ms(lambda: publish(1)),
        f"publish_{batch}_events_ms": median_ms(lambda: publish(batch)),
        f"mget_{batch}_ms": median_ms(lambda: client.mget([keys.cancel(j) for j in ids])),
        "xreadgroup_empty_ms": median_ms(
            lambda: client.xreadgroup("g", "c", {keys.jobs(): ">"}, count=batch)
        ),
    }
    for key in client.scan_iter(match="bench-e2e-cost:*"):
        client.delete(key)
    client.close()
    return out


# ---- one config ---------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    blocks: list[tuple[int, int]]  # (worker processes, torch threads each)
    rounds: dict[str, int]  # per config: interleaved rounds per block

    @staticmethod
    def blocks_for(workers: list[int], threads: list[int]) -> list[tuple[int, int]]:
        """One block per 1-worker thread count; k > 1 workers get one thread each."""
        return [(k, t) for k in workers for t in (threads if k == 1 else [1])]

    @classmethod
    def full(cls, blocks: list[tuple[int, int]]) -> Settings:
        return cls(blocks, {"tiny": 5, "small": 2})

    @classmethod
    def quick(cls, blocks: list[tuple[int, int]]) -> Settings:
        return cls(blocks, {"tiny": 1, "small": 1})


def pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarise(runs: list[Trace], bursts: list[Trace]) -> dict[str, Any]:
    """Throughput from the all-at-once runs (best and median), latencies pooled."""
    rates = [r.useful_tokens / r.wall_s for r in runs]
    ttft = [t for r in runs for t in r.ttft_s()]
    queued = [q for r in runs for q in r.queued_s()]
    burst_gaps = [g for b in bursts for g in b.burst_gaps_s()]
    burst_ttft = [t for b in bursts for t in b.ttft_s(b.groups[1])]
    gaps = [g for r in runs for g in r.all_gaps_s()]
    return {
        "useful_tokens": runs[0].useful_tokens,
        "wall_s": [r.wall_s for r in runs],
        "tok_s_best": max(rates),
        "tok_s_median": statistics.median(rates),
        "tok_s_rounds": rates,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "queued_p50_s": pct(queued, 50),
        "queued_p99_s": pct(queued, 99),
        "gap_p50_s": pct(gaps, 50),
        "gap_p99_s": pct(gaps, 99),
        "burst_gap_p50_s": pct(burst_gaps, 50),
        "burst_gap_p99_s": pct(burst_gaps, 99),
        "burst_gap_n": len(burst_gaps),
        "burst_ttft_p50_s": pct(burst_ttft, 50),
        "burst_ttft_p99_s": pct(burst_ttft, 99),
    }


def matches(a: Trace, b: Trace) -> int:
    """Jobs (in submission order) whose tokens are identical in both runs."""
    ids_a = [j for g in a.groups for j in g]
    ids_b = [j for g in b.groups for j in g]
    return sum(a.tokens[x] == b.tokens[y] for x, y in zip(ids_a, ids_b, strict=True))


def bench_workers(
    name: str,
    k: int,
    threads: int,
    url: str,
    redis_pid: int,
    model_dir: str,
    loaded: LoadedModel,
    jobs: list[Job],
    rounds: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    base = node_flags(loaded, jobs, 1, threads)  # the in-process engine: a 1-worker node
    flags = node_flags(loaded, jobs, k, threads)
    torch.set_num_threads(base.threads)
    load_at_start = load_now()
    fleet = Fleet(url, f"bench-e2e-{name}-{k}x{threads}:", model_dir, flags, k)
    inproc: dict[str, list[Trace]] = {"all": [], "burst": []}
    through: dict[str, list[Trace]] = {"all": [], "burst": []}
    per_round: list[dict[str, Any]] = []
    try:
        fleet.wait_live()
        # Warm up: a small job, then an untimed all-at-once round in both modes.
        warm = GenerationRequest(
            job_id="warm", prompt_ids=jobs[0].prompt_ids[:8], max_new_tokens=4, ignore_eos=True
        )
        fleet.producer.submit(warm).result(timeout=TIMEOUT_S)
        run_inprocess(loaded, base, scenario(jobs, "warm-all", False))
        run_redis(fleet.producer, scenario(jobs, "warm-all", False))
        before = fleet.settle()
        for i in range(rounds):
            for burst in (False, True):
                kind = "burst" if burst else "all"
                tag = f"r{i}-{kind}"
                order = ("inproc", "redis") if i % 2 == 0 else ("redis", "inproc")
                for mode in order:
                    if mode == "inproc":
                        inproc[kind].append(run_inprocess(loaded, base, scenario(jobs, tag, burst)))
                        continue
                    cpu_before = fleet.cpu(), cpu_seconds(redis_pid), time.process_time()
                    trace = run_redis(fleet.producer, scenario(jobs, tag, burst))
                    cpu_after = fleet.cpu(), cpu_seconds(redis_pid), time.process_time()
                    after = fleet.settle()
                    through[kind].append(trace)
                    per_round.append(round_stats(kind, trace, before, after, cpu_before, cpu_after))
                    before = after
            a, b = inproc["all"][-1], through["all"][-1]
            log(
                f"  {name} {k}x{threads} round {i}: in process "
                f"{a.useful_tokens / a.wall_s:.0f} tok/s, "
                f"through Redis {b.useful_tokens / b.wall_s:.0f} tok/s "
                f"({b.wall_s / a.wall_s:.3f}x the time)"
            )
    except BaseException:
        log(f"worker logs: {fleet.log_tail()}")
        raise
    finally:
        fleet.stop()
    ours, ref = (
        summarise(through["all"], through["burst"]),
        summarise(inproc["all"], inproc["burst"]),
    )
    pairs = [*zip(through["all"], inproc["all"], strict=True)]
    pairs += zip(through["burst"], inproc["burst"], strict=True)
    all_rounds = [r for r in per_round if r["scenario"] == "all"]
    return {
        "load_at_start": load_at_start,
        "load_at_end": load_now(),
        "workers": k,
        "worker_flags": asdict(flags),
        "in_process_flags": asdict(base),
        "rounds": rounds,
        "in_process": ref
        | {
            "ticks": [t.ticks for t in inproc["all"]],
            "step_s": [t.step_s for t in inproc["all"]],
        },
        "through_redis": ours,
        "ratio_best": ours["tok_s_best"] / ref["tok_s_best"],
        "ratio_median": ours["tok_s_median"] / ref["tok_s_median"],
        "tokens_match": min(matches(x, y) for x, y in pairs),
        "tokens_compared": len(jobs),
        "per_round": per_round,
        "worker_ticks_mean": statistics.mean(r["worker_ticks"] for r in all_rounds),
        "worker_step_s_mean": statistics.mean(r["worker_step_s"] for r in all_rounds),
        "in_process_step_s_mean": statistics.mean(t.step_s for t in inproc["all"]),
    }


def round_stats(
    kind: str,
    trace: Trace,
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    cpu_before: tuple[dict[str, float], float, float],
    cpu_after: tuple[dict[str, float], float, float],
) -> dict[str, Any]:
    """Where one run through Redis spent its time (worker heartbeats, /proc CPU)."""
    jobs_by_worker: dict[str, int] = {}
    for f in trace.finish.values():
        jobs_by_worker[f.worker or "?"] = jobs_by_worker.get(f.worker or "?", 0) + 1
    return {
        "scenario": kind,
        "wall_s": trace.wall_s,
        "ttft_s": trace.ttft_s(),
        "queued_s": trace.queued_s(),
        "jobs_by_worker": jobs_by_worker,
        "worker_ticks": sum(after[n]["ticks"] - before[n]["ticks"] for n in after),
        "worker_step_s": sum(after[n]["bench_step_s"] - before[n]["bench_step_s"] for n in after),
        "cpu_s": {
            "workers": sum(cpu_after[0][n] - cpu_before[0][n] for n in cpu_after[0]),
            "redis_server": cpu_after[1] - cpu_before[1],
            "client": cpu_after[2] - cpu_before[2],
        },
    }


def bench_config(name: str, s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        hf = build_checkpoint(name, Path(folder))
        params = num_params(hf)
        del hf
        loaded = load_model(folder, dtype="float32", device="cpu")
        w = EngineSettings.full()  # the engine benchmark's mixed workload, unchanged
        jobs = mixed_jobs(w.mixed_n, w.mixed_prompt, w.mixed_new, loaded.config.vocab_size)
        server = EmbeddedRedis.start()
        assert server.kind == "redis-server", "install redis-server: fakeredis is not comparable"
        assert server._proc is not None
        try:
            costs = redis_costs(server.url, len(jobs))
            blocks = {
                f"{k}x{t}": bench_workers(
                    name,
                    k,
                    t,
                    server.url,
                    server._proc.pid,
                    folder,
                    loaded,
                    jobs,
                    s.rounds[name],
                    log,
                )
                for k, t in s.blocks
            }
        finally:
            server.stop()
    return {
        "params": params,
        "requests": len(jobs),
        "prompt_lens": [len(j.prompt_ids) for j in jobs],
        "max_new_tokens": [j.max_new for j in jobs],
        "useful_tokens": sum(j.max_new for j in jobs),
        "redis_costs_ms": costs,
        "blocks": blocks,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }


# ---- output -------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def labels(b: dict[str, Any]) -> tuple[str, str]:
    """(in-process label, through-Redis label) of one block."""
    t_in, k, t = b["in_process_flags"]["threads"], b["workers"], b["worker_flags"]["threads"]
    return (
        f"in process, {t_in} thread{'s' * (t_in > 1)}",
        f"Redis, {k} worker{'s' * (k > 1)} × {t} thread{'s' * (t > 1)}",
    )


LATENCIES = (
    "ttft_p50_s",
    "ttft_p99_s",
    "queued_p50_s",
    "queued_p99_s",
    "burst_gap_p50_s",
    "burst_gap_p99_s",
)


def markdown(results: dict[str, Any]) -> str:
    """The tables docs/benchmarks.md shows, generated so no number is copied by hand."""
    lines = []
    for name, res in results.items():
        lines += [
            f"**{name}** ({res['params'] / 1e6:.1f}M parameters), {res['requests']} requests, "
            f"{res['useful_tokens']} useful tokens; each block's in-process engine was run in "
            "the same rounds, interleaved.",
            "",
            "| system | useful tok/s best (median) | Redis ÷ in process, best (median) "
            "| TTFT p50 / p99 ms | queue wait p50 / p99 ms | burst gaps p50 / p99 ms (n) "
            "| tokens equal |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for b in res["blocks"].values():
            for label, x, redis_row in zip(
                labels(b), (b["in_process"], b["through_redis"]), (False, True), strict=True
            ):
                ratio = f"{b['ratio_best']:.3f} ({b['ratio_median']:.3f})" if redis_row else ""
                match = f"{b['tokens_match']}/{b['tokens_compared']}" if redis_row else ""
                lat = [ms(x[key]) for key in LATENCIES]
                lines.append(
                    f"| {label} | {x['tok_s_best']:.0f} ({x['tok_s_median']:.0f}) | {ratio} "
                    f"| {lat[0]} / {lat[1]} | {lat[2]} / {lat[3]} "
                    f"| {lat[4]} / {lat[5]} ({x['burst_gap_n']}) | {match} |"
                )
        lines += [
            "",
            "Where the time went (all-at-once runs, means over rounds): wall time, ticks and "
            "seconds inside `Engine.step` (workers: summed over workers), and CPU seconds "
            "used during the Redis runs.",
            "",
            "| block | Redis wall s | in-process wall s | worker ticks | in-process ticks "
            "| workers' s in `Engine.step` | in-process s in `Engine.step` "
            "| CPU s workers / redis-server / client | jobs per worker "
            "| load avg (1 min) at block start / end |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for b in res["blocks"].values():
            rs = [r for r in b["per_round"] if r["scenario"] == "all"]
            cpu = {c: statistics.mean(r["cpu_s"][c] for r in rs) for c in rs[0]["cpu_s"]}
            split = sorted({"+".join(map(str, sorted(r["jobs_by_worker"].values()))) for r in rs})
            lines.append(
                f"| {labels(b)[1]} | {statistics.mean(b['through_redis']['wall_s']):.3f} "
                f"| {statistics.mean(b['in_process']['wall_s']):.3f} "
                f"| {b['worker_ticks_mean']:.0f} | {statistics.mean(b['in_process']['ticks']):.0f} "
                f"| {b['worker_step_s_mean']:.3f} | {b['in_process_step_s_mean']:.3f} "
                f"| {cpu['workers']:.2f} / {cpu['redis_server']:.2f} / {cpu['client']:.2f} "
                f"| {', '.join(split)} | {b['load_at_start']['loadavg'][0]:.2f} / "
                f"{b['load_at_end']['loadavg'][0]:.2f} |"
            )
        costs = ", ".join(
            f"{k.removesuffix('_ms')} {v:.3f}" for k, v in res["redis_costs_ms"].items()
        )
        lines += ["", f"Redis calls from one Python process here, median ms: {costs}.", ""]
    return "\n".join(lines)


def table(results: dict[str, Any]) -> str:
    lines = []
    for name, res in results.items():
        lines.append(f"\n{name} ({res['params'] / 1e6:.1f}M params), {res['useful_tokens']} tokens")
        lines.append(
            f"{'system':<32}{'tok/s':>7}{'ratio':>7}{'med.r':>7}{'TTFT50':>8}{'TTFT99':>8}"
            f"{'queue50':>8}{'queue99':>8}{'burst50':>8}{'burst99':>8}{'match':>7}"
        )
        for b in res["blocks"].values():
            for label, x, redis_row in zip(
                labels(b), (b["in_process"], b["through_redis"]), (False, True), strict=True
            ):
                ratios = f"{b['ratio_best']:>7.3f}{b['ratio_median']:>7.3f}" if redis_row else ""
                lines.append(
                    f"{label:<32}{x['tok_s_best']:>7.0f}{ratios:>14}"
                    + "".join(f"{ms(x[key]):>8}" for key in LATENCIES)
                    + (f"{b['tokens_match']:>4}/{b['tokens_compared']}" if redis_row else "")
                )
        lines.append("target: useful tok/s ratio (Redis ÷ in process) >= 0.95; latencies in ms")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(8 * len(names), 8), squeeze=False)
    for col, name in enumerate(names):
        blocks = list(results[name]["blocks"].values())
        ax = axes[0][col]
        x = range(len(blocks))
        ax.bar(
            [i - 0.2 for i in x],
            [b["in_process"]["tok_s_best"] for b in blocks],
            0.4,
            label="in process",
            color="C7",
        )
        bars = ax.bar(
            [i + 0.2 for i in x],
            [b["through_redis"]["tok_s_best"] for b in blocks],
            0.4,
            label="through Redis",
            color="C0",
        )
        ax.bar_label(bars, labels=[f"{b['ratio_best']:.2f}×" for b in blocks], fontsize=8)
        ax.set_xticks(list(x), [labels(b)[1].removeprefix("Redis, ") for b in blocks], fontsize=8)
        ax.set_ylim(top=1.25 * max(b["in_process"]["tok_s_best"] for b in blocks))
        ax.set_ylabel("useful tokens/s (best round)")
        ax.set_title(f"{name}: mixed workload (bar label: Redis ÷ in process)")
        ax.legend(fontsize=8, ncol=2, loc="upper center")
        ax = axes[1][col]
        keys = [
            ("ttft_p50_s", "TTFT p50"),
            ("ttft_p99_s", "TTFT p99"),
            ("burst_gap_p50_s", "burst gap p50"),
            ("burst_gap_p99_s", "burst gap p99"),
        ]
        # each in-process thread count once (its first block), then every Redis block
        series = list({labels(b)[0]: b["in_process"] for b in reversed(blocks)}.items())[::-1]
        series += [(labels(b)[1], b["through_redis"]) for b in blocks]
        width = 0.8 / len(series)
        for i, (label, s) in enumerate(series):
            ax.bar(
                [m + i * width for m in range(len(keys))],
                [1000 * s[k] for k, _ in keys],
                width,
                label=label,
            )
        ax.set_xticks(
            [m + width * (len(series) - 1) / 2 for m in range(len(keys))],
            [label for _, label in keys],
        )
        ax.set_ylabel("ms")
        ax.set_title(f"{name}: latency (burst gaps: the 4 sessions in flight)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny", help="tiny,small (small takes minutes)")
    parser.add_argument("--workers", default="1,2,4")
    cores = os.cpu_count() or 1
    parser.add_argument(
        "--threads",
        default=",".join(dict.fromkeys([str(cores), "1"])),
        help="torch threads of the single worker (and of the engine it is compared with), "
        "one block each; k > 1 workers always get 1",
    )
    parser.add_argument("--quick", action="store_true", help="one round per block")
    parser.add_argument(
        "--worker-args", default="", help="extra `tokenfleet worker` flags, e.g. --no-overlap"
    )
    parser.add_argument("--out", default="bench/out/e2e.json")
    parser.add_argument("--plot", default="docs/img/e2e.png")
    args = parser.parse_args()
    EXTRA_WORKER_ARGS.extend(args.worker_args.split())
    # A SIGTERM unwinds like Ctrl-C, so workers, redis-server and temp folders are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    torch.set_num_threads(os.cpu_count() or 1)
    blocks = Settings.blocks_for(
        [int(k) for k in args.workers.split(",")], [int(t) for t in args.threads.split(",")]
    )
    settings = Settings.quick(blocks) if args.quick else Settings.full(blocks)
    machine = machine_info()
    machine["env"] = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_"))}
    machine["worker_args"] = EXTRA_WORKER_ARGS
    machine["load_at_start"] = load_now()
    started = time.perf_counter()
    results: dict[str, Any] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    for name in args.configs.split(","):
        print(f"[{time.perf_counter() - started:6.1f}s] {name} ...", flush=True)
        results[name] = bench_config(name, settings, lambda msg: print(msg, flush=True))
        machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        machine["load_at_end"] = load_now()
        report = {
            "machine": machine,
            "quick": args.quick,
            "settings": asdict(settings) | {"long": LONG, "burst_after_tokens": BURST_AFTER},
            "wall_s": time.perf_counter() - started,
            "configs": results,
        }
        out.write_text(json.dumps(report, indent=2))  # after each config: a partial run counts
        out.with_suffix(".md").write_text(markdown(results))
    print(table(results))
    if args.plot:
        plot(results, Path(args.plot))
    print(
        f"\nwrote {out} (+ .md tables){' and ' + args.plot if args.plot else ''}"
        f" in {report['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
