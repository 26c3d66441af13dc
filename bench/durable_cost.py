"""Durable mode's per-tick cost: the same job load served by the same simulated fleet on
a primary with one replica, once plain and once with `--wait-replicas 1` (issue 24,
part 3: "measure the per-tick cost").

Usage: python bench/durable_cost.py [--rounds 3] [--workers 2] [--batch 32] [--tok-s 3000]
                                    [--jobs 96] [--length 256] [--streamed 8]
                                    [--wait-timeout-ms 100]
                                    [--out bench/results-durable-cost-DATE.json] [--plot PNG]

Each run gets a fresh primary (`tokenfleet.local.RedisServer`) and a fresh replica of it
(`REPLICAOF`, waited for until the primary counts `connected_slaves:1` and the replica
reads `master_link_status:up`), then W `tokenfleet worker --runner sim` processes
(`--sim-tok-s R`, `--max-batch B --max-active B`, as bench/cluster_cost.py starts them),
durable ones with `--wait-replicas 1 --wait-timeout-ms T`, that have joined and idle.
The load: `--jobs` jobs of exactly `--length` tokens (16-token prompts, eos ignored),
submitted at once with `Producer.submit_many`; the first `--streamed` of them (the ones
the workers pull first, so no queueing in their numbers) are each followed by a client
thread (`handle.stream()`, a Producer of its own) that records when each token event
arrives. The window runs from just before the submit to the moment the last result
exists (checked one key at a time every 0.1 s).

Read between `CONFIG RESETSTAT` and the end: the primary's CPU (INFO cpu), its commands
(INFO commandstats, `wait` among them) and the replica's CPU; ticks from the workers'
heartbeats (telemetry `ticks`); the worker's wall time per tick and CPU per tick (/proc);
on the client side, each streamed job's time to first token (from the submit) and its
median gap between tokens. Runs are interleaved round by round (ABBA) and reported as
min / median / max, with durable / plain of each median.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis
from _rounds import abba, wait_until
from cluster_cost import node_stats, wait_results
from report import figure, load_now, machine_info, mark_end, spread, spread_errors

from tokenfleet.connect import connect
from tokenfleet.local import LocalWorkers, RedisServer
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest

PREFIX = "dcost:"
MODES = ("plain", "durable")
FIELDS = (
    "wall_s",
    "tok_s",
    "us_per_token",
    "replica_us_per_token",
    "us_per_tick",
    "commands_per_token",
    "wait_per_tick",
    "evalsha_per_tick",
    "tokens_per_tick",
    "worker_ms_per_tick",
    "worker_cpu_us_per_tick",
    "ttft_ms",
    "gap_ms",
    "gap_p90_ms",
    "last_token_ms",
)


class Replicated:
    """A fresh primary and one replica of it, linked and in sync."""

    def __init__(self) -> None:
        self.primary = RedisServer.launch()
        self.replica = RedisServer.launch()
        self.p = redis.Redis.from_url(self.primary.url)
        self.r = redis.Redis.from_url(self.replica.url)
        self.r.execute_command("REPLICAOF", "127.0.0.1", str(self.primary.port))

        def linked() -> bool:
            return (
                int(self.p.info("replication").get("connected_slaves", 0)) == 1
                and self.r.info("replication").get("master_link_status") == "up"
            )

        if not wait_until(linked, 30, 0.05):
            self.close()
            raise TimeoutError("the replica did not link up")

    def close(self) -> None:
        self.p.close()
        self.r.close()
        self.replica.stop()
        self.primary.stop()


def follow(producer: Producer, job_id: str, arrivals: list[float], errors: list[str]) -> None:
    """Record the monotonic arrival time of each token event of the job."""
    try:
        for _ in producer.handle(job_id).stream(timeout=120):
            arrivals.append(time.monotonic())
    except Exception as exc:  # reported with the run
        errors.append(f"{job_id}: {exc!r}")


def client_latency(t0: float, streams: list[list[float]]) -> dict[str, float]:
    """TTFT from the submit, the median (over jobs) of each job's median and p90 gap."""
    ttft = [s[0] - t0 for s in streams if s]
    gaps = [[b - a for a, b in itertools.pairwise(s)] for s in streams if len(s) > 1]
    return {
        "ttft_ms": 1e3 * statistics.median(ttft),
        "ttft_ms_max": 1e3 * max(ttft),
        "gap_ms": 1e3 * statistics.median(statistics.median(g) for g in gaps),
        "gap_p90_ms": 1e3
        * statistics.median(statistics.quantiles(g, n=10)[-1] for g in gaps if len(g) > 1),
        "last_token_ms": 1e3 * statistics.median(s[-1] - t0 for s in streams if s),
    }


def run_once(mode: str, r: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    redis_pair = Replicated()
    try:
        url = redis_pair.primary.url
        worker_args = ["--runner", "sim", "--sim-tok-s", str(args.tok_s)]
        worker_args += ["--max-batch", str(args.batch), "--max-active", str(args.batch)]
        if mode == "durable":
            worker_args += ["--wait-replicas", "1", "--wait-timeout-ms", str(args.wait_timeout_ms)]
        env = {"OMP_NUM_THREADS": "1"}
        group = LocalWorkers(url, PREFIX, worker_args, log_dir=log_dir, env=env)
        names = group.start(args.workers, name_prefix=f"{mode}{r}")  # a log per run
        try:
            group.wait_live(names, timeout=120)
            producer = Producer.from_url(url, prefix=PREFIX, default_cap=1_000_000)
            followers = [
                Producer.from_url(url, prefix=PREFIX, default_cap=1_000_000)
                for _ in range(args.streamed)
            ]
            requests = [
                GenerationRequest(
                    job_id=f"j{n}",
                    prompt_ids=[1 + (n + i) % 200 for i in range(16)],
                    max_new_tokens=args.length,
                    ignore_eos=True,
                )
                for n in range(args.jobs)
            ]
            ticks0 = {n: float(group.heartbeat(n).get("ticks", 0)) for n in names}
            wcpu0 = sum(group.cpu_seconds().values())
            redis_pair.p.config_resetstat()
            before = node_stats([redis_pair.p])
            replica0 = node_stats([redis_pair.r])["cpu_s"]
            streams: list[list[float]] = [[] for _ in range(args.streamed)]
            errors: list[str] = []
            t0m = time.monotonic()
            t0 = time.perf_counter()
            outcomes = producer.submit_many(requests)
            threads = [
                threading.Thread(target=follow, args=(f, f"j{i}", streams[i], errors), daemon=True)
                for i, f in enumerate(followers)
            ]
            for t in threads:
                t.start()
            assert all(o.accepted for o in outcomes), [o.error for o in outcomes if o.error]
            wait_results(connect(url), producer, [r.job_id for r in requests])
            wall = time.perf_counter() - t0
            after = node_stats([redis_pair.p])
            replica1 = node_stats([redis_pair.r])["cpu_s"]
            wcpu1 = sum(group.cpu_seconds().values())
            load = load_now()
            for t in threads:
                t.join(timeout=60)
            beats = group.settle(30)
            ticks = sum(float(beats[n]["ticks"]) - ticks0[n] for n in names)
            for f in [producer, *followers]:
                f.redis.close()
            log_tail = group.log_tail(600)
        finally:
            group.kill_all()
    finally:
        redis_pair.close()
    tokens = args.jobs * args.length
    cpu = after["cpu_s"] - before["cpu_s"]
    calls = after["calls"]
    counts = [len(s) for s in streams]
    out: dict[str, Any] = {
        "mode": mode,
        "wall_s": wall,
        "tokens": tokens,
        "ticks": ticks,
        "redis_cpu_s": cpu,
        "replica_cpu_s": replica1 - replica0,
        "commands": sum(calls.values()),
        "evalsha": calls.get("evalsha", 0),
        "wait": calls.get("wait", 0),
        "wait_usec": after["usec"].get("wait", 0),
        "top_commands": dict(sorted(after["usec"].items(), key=lambda kv: -kv[1])[:8]),
        "calls": dict(calls),
        "workers_cpu_s": wcpu1 - wcpu0,
        "streamed_tokens": counts,
        "stream_errors": errors,
        "load": load,
    }
    if errors or any(c != args.length for c in counts):
        out["worker_log_tail"] = log_tail
    out.update(
        tok_s=tokens / wall,
        us_per_token=1e6 * cpu / tokens,
        replica_us_per_token=1e6 * out["replica_cpu_s"] / tokens,
        us_per_tick=1e6 * cpu / ticks,
        commands_per_token=out["commands"] / tokens,
        wait_per_tick=out["wait"] / ticks,
        evalsha_per_tick=out["evalsha"] / ticks,
        tokens_per_tick=tokens / ticks,
        worker_ms_per_tick=1e3 * wall * args.workers / ticks,
        worker_cpu_us_per_tick=1e6 * out["workers_cpu_s"] / ticks,
    )
    out.update(client_latency(t0m, streams))
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        m: {f: spread([x[f] for x in runs if x["mode"] == m]) for f in FIELDS} for m in MODES
    }
    if all(summary[m]["wall_s"]["n"] for m in MODES):
        summary["durable/plain"] = {
            f: (summary["durable"][f]["median"] / summary["plain"][f]["median"])
            if summary["plain"][f]["median"]
            else None
            for f in FIELDS
        }
    return summary


def plot(summary: dict[str, Any], path: Path) -> None:
    panels = [
        ("us_per_token", "primary Redis CPU / token (µs)"),
        ("worker_cpu_us_per_tick", "worker CPU / tick (µs)"),
        ("ttft_ms", "client TTFT (ms)"),
        ("gap_ms", "median inter-token gap (ms)"),
    ]
    with figure(path, 1, len(panels), figsize=(12, 3)) as axes:
        for ax, (field, title) in zip(axes, panels, strict=True):
            medians, err = spread_errors([summary[m][field] for m in MODES])
            ax.bar(MODES, medians, yerr=err, capsize=4, color=["#888", "#c44"])
            ax.set_title(title, fontsize=9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tok-s", type=float, default=3000)
    p.add_argument("--jobs", type=int, default=96)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--streamed", type=int, default=8, help="jobs followed by a client")
    p.add_argument("--wait-timeout-ms", type=int, default=100)
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="PNG (default: next to --out)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args()
    today = dt.date.today().isoformat()
    out = args.out or Path(__file__).parent / f"results-durable-cost-{today}.json"
    png = args.plot or out.with_suffix(".png")
    machine = machine_info()
    print(f"cpu: {machine['cpu']} ({machine['cores']} cores), load {machine['loadavg_at_start']}")
    runs: list[dict[str, Any]] = []
    log_dir = Path("/tmp") / f"durable-cost-{time.time():.0f}"
    log_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    for r in range(args.rounds):
        for mode in abba(MODES, r):
            run = run_once(mode, r, args, log_dir)
            run["round"] = r
            runs.append(run)
            print(
                f"round {r} {mode:7s}: {run['wall_s']:5.1f} s  {run['us_per_token']:5.2f} us/token"
                f" (replica {run['replica_us_per_token']:5.2f})"
                f"  {run['commands_per_token']:4.2f} cmd/token"
                f"  {run['wait_per_tick']:4.2f} WAIT/tick"
                f"  worker {run['worker_ms_per_tick']:5.1f} ms/tick"
                f" {run['worker_cpu_us_per_tick']:5.0f} us CPU/tick"
                f"  TTFT {run['ttft_ms']:5.1f} ms  gap {run['gap_ms']:5.1f} ms"
                f"  load {run['load']['loadavg'][0]:.2f}"
                + (f"  ERRORS {run['stream_errors']}" if run["stream_errors"] else ""),
                flush=True,
            )
            summary = summarize(runs)
            doc = {
                "what": "durable mode's per-tick cost, plain vs --wait-replicas 1 "
                "(bench/durable_cost.py)",
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "machine": mark_end(machine),
                "summary": summary,
                "runs": runs,
            }
            out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(summary, indent=1))
    if not args.no_plot:
        plot(summary, png)
        print(f"wrote {png}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
