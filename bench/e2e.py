"""End to end through Redis: the engine benchmark's mixed workload, on the same weights,
through `tokenfleet worker` processes vs the engine in process, in the same run; and,
with `--tree`, the same for other checkouts of the code, rounds interleaved.

Usage: python bench/e2e.py [--configs tiny,small] [--workers 1,2,4] [--threads 2,1]
                           [--tree new=. --tree old=/tmp/old | --trees new=.,old=/tmp/old]
                           [--quick] [--out bench/out/e2e.json] [--plot docs/img/e2e.png]

Per config: one checkpoint (bench/_common.py's `build_checkpoint`), one redis-server
of its own, and blocks of k worker processes × t torch threads each: one block per
`--threads` value for k = 1 (default: all cores, then 1), one thread each for k > 1.
Per code tree (default: this checkout), a block runs k plain `tokenfleet worker`
processes of that tree (PYTHONPATH and cwd = the tree, a key prefix of its own) and
one engine process of that tree (bench/e2e_inprocess.py). Each tree's side is warmed up
(a small job, then an untimed round in both modes) before any clock runs; then each
round alternates, trees in rotating order, between
  in process     `Engine` in the tree's engine process with the 1-worker node's
                 EngineConfig (the one its CLI flags build) and the block's torch
                 threads per worker, stepped until done;
  through Redis  `Producer.submit_many` (this checkout's client, for every tree), every
                 job followed by `JobHandle.stream()` in its own thread (subscribed
                 before the submit), token arrival times taken as the client sees them.
Each round runs two scenarios in both modes:
  all at once  the 16 mixed jobs submitted together: wall time until the last finish
               event, useful tokens/s (= generated tokens, ignore_eos), TTFT
               (first token − submit), queue wait (FinishEvent `queued_s`);
  burst        the 4 longest jobs first; once each has 8 tokens the other 12 are
               submitted at once; inter-token gaps of the 4 that end in the burst
               window [burst submit, last burst job's first token].
The seconds workers spent inside `Engine.step` come from their heartbeats (`step_s`);
a tree whose heartbeat lacks it reports them as unavailable.
k > 1: each worker holds 16/k sessions (--max-active/--max-batch, --max-waiting 0) so
the fleet, not the first reader, spreads the jobs.
Prints a table, writes JSON (and a PNG). `--quick`: one round per block, for development.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import redis
from _common import Job, build_checkpoint, mixed_workload, num_params, requests
from _engine import MiB, kv_budget_bytes, kv_bytes_per_token
from _fleet import Fleet, follow
from _rounds import abba, median_seconds, rotated
from _trees import Tree, parse_trees
from e2e_inprocess import BURST_AFTER, LONG, EngineProcess, Trace
from e2e_report import markdown, plot, table
from report import (
    Run,
    load_now,
    loadavg,
    mean_or_none,
    outputs,
    parser,
    pct,
    write_report,
)

from tokenfleet.keys import EVENTS_MAXLEN, EVENTS_TTL_S, Keys
from tokenfleet.local import LocalWorkers, cpu_seconds
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest, TokenEvent, encode

TIMEOUT_S = 300.0
EXTRA_WORKER_ARGS: list[str] = []  # --worker-args: more `tokenfleet worker` flags (A/B runs)


@dataclass(frozen=True)
class NodeFlags:
    """One worker's engine, as `tokenfleet worker` flags and as the same EngineConfig."""

    kv_mb: int
    max_batch: int
    max_active: int
    max_waiting: int
    threads: int
    prefill_tokens: int = 256

    def engine_config(self) -> dict[str, int]:
        """EngineConfig keyword arguments (the engine process builds it from its tree)."""
        return {
            "kv_budget_bytes": self.kv_mb * MiB,
            "max_active": self.max_active,
            "max_batch_size": self.max_batch,
            "max_prefill_tokens_per_tick": self.prefill_tokens,
            "max_waiting": self.max_waiting,
        }

    def cli(self) -> list[str]:
        return [
            *("--kv-mb", str(self.kv_mb), "--max-batch", str(self.max_batch)),
            *("--max-active", str(self.max_active), "--max-waiting", str(self.max_waiting)),
            *("--prefill-tokens", str(self.prefill_tokens), "--threads", str(self.threads)),
        ]


def node_flags(config: Any, jobs: list[Job], workers: int, threads: int) -> NodeFlags:
    """bench/_engine.py's budget for a batch of all the jobs (rounded up to whole MiB for
    the CLI); k workers share the sessions. `config`: the checkpoint's LlamaConfig."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, 4)  # fp32
    kv_mb = math.ceil(kv_budget_bytes(per_token, jobs, len(jobs)) / MiB)
    if workers == 1:
        return NodeFlags(kv_mb, len(jobs), len(jobs), len(jobs), threads)
    share = math.ceil(len(jobs) / workers)
    return NodeFlags(kv_mb, share, share, 0, threads)


def scenario(jobs: list[Job], tag: str, burst: bool) -> list[list[GenerationRequest]]:
    """Submission groups: everything at once, or the LONG longest jobs then the rest."""
    reqs = requests(jobs, tag)
    if not burst:
        return [reqs]
    longest = sorted(range(len(jobs)), key=lambda i: -jobs[i].max_new)[:LONG]
    return [[reqs[i] for i in longest], [r for i, r in enumerate(reqs) if i not in longest]]


# ---- through Redis ------------------------------------------------------------------


def run_redis(producer: Producer, groups: list[list[GenerationRequest]]) -> Trace:
    trace = Trace([[r.job_id for r in g] for g in groups])
    ids = [r.job_id for g in groups for r in g]
    followers = follow(producer, ids, TIMEOUT_S, notify_after=BURST_AFTER)
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
        finish = f.result().handle.finish
        assert finish is not None
        trace.arrivals[j], trace.tokens[j] = f.arrivals, f.tokens
        trace.finished_at[j] = f.finished_at
        trace.queued[j], trace.worker[j] = finish.timings.queued_s, finish.worker
    return trace


def redis_costs(url: str, batch: int, reps: int = 200) -> dict[str, float]:
    """What the worker loop's Redis calls cost from one Python process here (median ms):
    a tick's token events in one pipeline (XADD + EXPIRE + PUBLISH each: tick.lua's
    appends without its fence), the per-tick cancel check (MGET of the running jobs)
    and a non-blocking XREADGROUP."""
    client = redis.Redis.from_url(url)
    keys = Keys("bench-e2e-cost:")
    ids = [f"cost-{i}" for i in range(batch)]
    client.xgroup_create(keys.jobs(), "g", id="0", mkstream=True)

    def publish(n: int) -> None:
        # The unfenced copy of tick.lua's appends: no owner check, no `emitted` in the
        # job hash, not in a script. Each event to its job's replay stream (its TTL set
        # by the first event), then on the job's live channel.
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            data = encode(TokenEvent(job_id=ids[i], index=i, token_id=17))
            pipe.xadd(keys.events(ids[i]), {"m": data}, maxlen=EVENTS_MAXLEN, approximate=True)
            if i == 0:
                pipe.expire(keys.events(ids[i]), EVENTS_TTL_S)
            pipe.publish(keys.channel(ids[i]), data)
        pipe.execute()

    def median_ms(fn: Any) -> float:
        return 1000 * median_seconds(fn, reps)

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


# ---- one block ----------------------------------------------------------------------


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


Heartbeats = dict[str, dict[str, Any]]
CpuSample = tuple[dict[str, float], float, float]  # workers, redis-server, this process


@dataclass
class Side:
    """One tree in one block: its workers, its engine process, what they measured."""

    tree: Tree
    workers: LocalWorkers
    producer: Producer
    engine: EngineProcess
    redis_pid: int
    inproc: dict[str, list[Trace]] = field(default_factory=lambda: {"all": [], "burst": []})
    through: dict[str, list[Trace]] = field(default_factory=lambda: {"all": [], "burst": []})
    per_round: list[dict[str, Any]] = field(default_factory=list)
    before: Heartbeats = field(default_factory=dict)  # the heartbeats after the last run

    def measure(
        self, mode: str, kind: str, groups: list[list[GenerationRequest]], flags: NodeFlags
    ) -> None:
        if mode == "inproc":
            self.inproc[kind].append(self.engine.run(flags.engine_config(), flags.threads, groups))
            return
        cpu_before = self.cpu()
        trace = run_redis(self.producer, groups)
        cpu_after = self.cpu()
        after = self.workers.settle()
        self.through[kind].append(trace)
        self.per_round.append(round_stats(kind, trace, self.before, after, cpu_before, cpu_after))
        self.before = after

    def cpu(self) -> CpuSample:
        return self.workers.cpu_seconds(), cpu_seconds(self.redis_pid), time.process_time()


def bench_workers(
    name: str,
    k: int,
    threads: int,
    fleet: Fleet,
    model_dir: str,
    config: Any,
    jobs: list[Job],
    rounds: int,
    engines: dict[str, EngineProcess],
    run: Run,
) -> dict[str, Any]:
    base = node_flags(config, jobs, 1, threads)  # the in-process engine: a 1-worker node
    flags = node_flags(config, jobs, k, threads)
    assert fleet.redis.pid is not None
    load_at_start = load_now()
    logs = tempfile.TemporaryDirectory(prefix="tokenfleet-e2e-")
    sides: list[Side] = []
    try:
        for tree_name, engine in engines.items():  # each tree: k workers of its own code
            prefix = f"bench-e2e-{name}-{k}x{threads}-{tree_name}:"
            args = ["--model", model_dir, "--device", "cpu", "--dtype", "float32"]
            args += [*flags.cli(), *EXTRA_WORKER_ARGS]
            workers = fleet.workers(prefix, args, engine.tree, Path(logs.name))
            producer = fleet.producer(workers)
            sides.append(Side(engine.tree, workers, producer, engine, fleet.redis.pid))
            workers.start(k, name_prefix=f"e2e-{tree_name}")
        for side in sides:
            side.workers.wait_live()
        # Warm up: a small job, then an untimed all-at-once round in both modes.
        for side in sides:
            warm = GenerationRequest(
                job_id="warm", prompt_ids=jobs[0].prompt_ids[:8], max_new_tokens=4, ignore_eos=True
            )
            side.producer.submit(warm).result(timeout=TIMEOUT_S)
            side.engine.run(base.engine_config(), base.threads, scenario(jobs, "warm-all", False))
            run_redis(side.producer, scenario(jobs, "warm-all", False))
            side.before = side.workers.settle()
        for i in range(rounds):
            for burst in (False, True):
                kind = "burst" if burst else "all"
                tag = f"r{i}-{kind}"
                for side in rotated(sides, i):  # trees take turns going first
                    for mode in abba(("inproc", "redis"), i):
                        side.measure(mode, kind, scenario(jobs, tag, burst), base)
            for side in sides:
                a, b = side.inproc["all"][-1], side.through["all"][-1]
                run.log(
                    f"  {name} {k}x{threads} {side.tree.name} round {i}: in process "
                    f"{a.useful_tokens / a.wall_s:.0f} tok/s, "
                    f"through Redis {b.useful_tokens / b.wall_s:.0f} tok/s "
                    f"({b.wall_s / a.wall_s:.3f}x the time)"
                )
    except BaseException:
        for side in sides:
            run.log(f"{side.tree.name} worker logs: {side.workers.log_tail()}")
        raise
    finally:
        for side in sides:
            side.workers.drain()
            side.producer.redis.close()
        logs.cleanup()
    first = sides[0]
    return {
        "load_at_start": load_at_start,
        "load_at_end": load_now(),
        "workers": k,
        "worker_flags": asdict(flags),
        "in_process_flags": asdict(base),
        "rounds": rounds,
        "trees": {side.tree.name: tree_result(side, first) for side in sides},
    }


def tree_result(side: Side, first: Side) -> dict[str, Any]:
    ours = summarise(side.through["all"], side.through["burst"])
    ref = summarise(side.inproc["all"], side.inproc["burst"])
    pairs = [*zip(side.through["all"], side.inproc["all"], strict=True)]
    pairs += zip(side.through["burst"], side.inproc["burst"], strict=True)
    all_rounds = [r for r in side.per_round if r["scenario"] == "all"]
    return {
        "in_process": ref
        | {
            "ticks": [t.ticks for t in side.inproc["all"]],
            "step_s": [t.step_s for t in side.inproc["all"]],
        },
        "through_redis": ours,
        "ratio_best": ours["tok_s_best"] / ref["tok_s_best"],
        "ratio_median": ours["tok_s_median"] / ref["tok_s_median"],
        "tokens_match": min(matches(x, y) for x, y in pairs),
        "tokens_compared": len(side.inproc["all"][0].tokens),
        # greedy tokens equal to the first tree's, in process (the engines agree)
        "tokens_match_first_tree": matches(side.inproc["all"][0], first.inproc["all"][0]),
        "per_round": side.per_round,
        "worker_ticks_mean": statistics.mean(r["worker_ticks"] for r in all_rounds),
        "worker_step_s_mean": mean_or_none(r["worker_step_s"] for r in all_rounds),
        "in_process_step_s_mean": statistics.mean(t.step_s for t in side.inproc["all"]),
    }


def step_seconds(before: Heartbeats, after: Heartbeats) -> float | None:
    """Seconds the workers spent inside Engine.step between two heartbeats (summed), or
    None when a heartbeat lacks `step_s` (a tree from before the engine published it)."""
    if not all("step_s" in before[n] and "step_s" in after[n] for n in after):
        return None
    return float(sum(after[n]["step_s"] - before[n]["step_s"] for n in after))


def round_stats(
    kind: str,
    trace: Trace,
    before: Heartbeats,
    after: Heartbeats,
    cpu_before: CpuSample,
    cpu_after: CpuSample,
) -> dict[str, Any]:
    """Where one run through Redis spent its time (worker heartbeats, /proc CPU)."""
    jobs_by_worker: dict[str, int] = {}
    for worker in trace.worker.values():
        jobs_by_worker[worker or "?"] = jobs_by_worker.get(worker or "?", 0) + 1
    return {
        "scenario": kind,
        "wall_s": trace.wall_s,
        "ttft_s": trace.ttft_s(),
        "queued_s": trace.queued_s(),
        "jobs_by_worker": jobs_by_worker,
        "worker_ticks": sum(after[n]["ticks"] - before[n]["ticks"] for n in after),
        "worker_step_s": step_seconds(before, after),
        "cpu_s": {
            "workers": sum(cpu_after[0][n] - cpu_before[0][n] for n in cpu_after[0]),
            "redis_server": cpu_after[1] - cpu_before[1],
            "client": cpu_after[2] - cpu_before[2],
        },
    }


def bench_config(name: str, s: Settings, trees: list[Tree], run: Run) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        hf = build_checkpoint(name, Path(folder))
        params, config = num_params(hf), hf.config
        del hf
        jobs = mixed_workload(config.vocab_size)  # the engine benchmark's, unchanged
        engines: dict[str, EngineProcess] = {}
        with Fleet() as fleet:
            try:
                for tree in trees:
                    engines[tree.name] = EngineProcess(
                        tree, folder, Path(folder) / f"engine-{tree.name}.log"
                    )
                costs = redis_costs(fleet.url, len(jobs))
                blocks = {
                    f"{k}x{t}": bench_workers(
                        name, k, t, fleet, folder, config, jobs, s.rounds[name], engines, run
                    )
                    for k, t in s.blocks
                }
            finally:
                for engine in engines.values():
                    engine.close()
    return {
        "params": params,
        "requests": len(jobs),
        "prompt_lens": [len(j.prompt_ids) for j in jobs],
        "max_new_tokens": [j.max_new for j in jobs],
        "useful_tokens": sum(j.max_new for j in jobs),
        "redis_costs_ms": costs,
        "blocks": blocks,
        "loadavg_at_end": loadavg(),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--configs", default="tiny", help="tiny,small (small takes minutes)")
    p.add_argument("--workers", default="1,2,4")
    cores = os.cpu_count() or 1
    p.add_argument(
        "--threads",
        default=",".join(dict.fromkeys([str(cores), "1"])),
        help="torch threads of the single worker (and of the engine it is compared with), "
        "one block each; k > 1 workers always get 1",
    )
    p.add_argument(
        "--tree",
        action="append",
        metavar="NAME=PATH",
        help="a checkout to measure (repeatable; the first is the reference); default: this one",
    )
    p.add_argument("--trees", default="", help="the same, comma-separated: new=.,old=/tmp/old")
    p.add_argument("--quick", action="store_true", help="one round per block")
    p.add_argument(
        "--worker-args", default="", help="extra `tokenfleet worker` flags, e.g. --no-overlap"
    )
    outputs(p, "e2e")
    args = p.parse_args()
    EXTRA_WORKER_ARGS.extend(args.worker_args.split())
    trees = parse_trees([*(args.tree or []), *(s for s in args.trees.split(",") if s)])
    # A SIGTERM unwinds like Ctrl-C, so workers, redis-server and temp folders are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    blocks = Settings.blocks_for(
        [int(k) for k in args.workers.split(",")], [int(t) for t in args.threads.split(",")]
    )
    settings = Settings.quick(blocks) if args.quick else Settings.full(blocks)
    run = Run()
    run.machine["worker_args"] = EXTRA_WORKER_ARGS
    run.machine["trees"] = {tree.name: tree.describe() for tree in trees}
    results: dict[str, Any] = {}
    report: dict[str, Any] = {}
    for name in args.configs.split(","):
        run.log(f"{name} ...")
        results[name] = bench_config(name, settings, trees, run)
        report = run.report(
            quick=args.quick,
            settings=asdict(settings) | {"long": LONG, "burst_after_tokens": BURST_AFTER},
            configs=results,
        )
        write_report(Path(args.out), report, markdown(results))  # a partial run counts
    run.finish(args, report, markdown(results), partial(plot, results), table=table(results))


if __name__ == "__main__":
    main()
