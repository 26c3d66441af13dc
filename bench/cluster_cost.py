"""Tick cost on a Redis Cluster vs one Redis: the same job load served by the same
simulated fleet, once on a single redis-server and once on a 3-master cluster with the
queue in P partitions (issue 24: "measure the tick cost on a cluster vs one Redis").

Usage: python bench/cluster_cost.py [--rounds 3] [--workers 2] [--batch 32] [--tok-s 3000]
                                    [--jobs 256] [--length 256] [--partitions 3,6]
                                    [--out bench/results-cluster-cost-DATE.json]

Each run gets a fresh server (`tokenfleet.local.RedisServer`) or cluster
(`tokenfleet.local.RedisCluster`, 3 masters, no replicas), W `tokenfleet worker --runner
sim` processes (bench/coordination.py's simulated GPU: `--sim-tok-s R`, `--max-batch B
--max-active B`) that have joined and idle, then the load: `--jobs` jobs of exactly
`--length` tokens (16-token prompts, eos ignored), submitted at once with
`Producer.submit_many` (one pipelined round trip on one Redis; one script call per job
on a cluster). The window runs from just before the submit to the moment the last
result exists (checked on one key at a time every 0.1 s), so every run does the same
work: the submits, L tokens of every job, its finish.

Read from every node (summed) between `CONFIG RESETSTAT` and the end: Redis's CPU (INFO
cpu used_cpu_user + used_cpu_sys, as bench/coordination.py reads it), its commands
(INFO commandstats) and the read events it served (INFO stats total_reads_processed: one
per batch of commands a connection sent, about one per round trip; the few this
script's own checks cost are counted and taken off). From the workers' heartbeats:
ticks (telemetry `ticks`), so µs per token, per tick, EVALSHA and round trips per tick;
and the worker's side of a tick: its wall time per tick (the loop's period: forward
+ what the round trip adds) and its CPU per tick (`/proc`). Runs are interleaved round
by round (ABBA order) and reported as min / median / max.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from _rounds import abba
from coordination import commandstats, redis_cpu
from report import load_now, machine_info, mark_end, spread

from tokenfleet.connect import connect
from tokenfleet.local import LocalWorkers, RedisCluster, RedisServer
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest

PREFIX = "ccost:"
FIELDS = (
    "us_per_token",
    "us_per_tick",
    "evalsha_per_tick",
    "round_trips_per_tick",
    "commands_per_token",
    "tokens_per_tick",
    "worker_ms_per_tick",
    "worker_cpu_us_per_tick",
    "tok_s",
    "redis_util",
)


@contextlib.contextmanager
def redis_of(setup: str, partitions: int) -> Iterator[tuple[str, list[redis.Redis]]]:
    """(URL, a client of each node) of a fresh single server or 3-master cluster."""
    if setup == "single":
        server = RedisServer.launch()
        try:
            client = redis.Redis.from_url(server.url)
            yield server.url, [client]
            client.close()
        finally:
            server.stop()
        return
    cluster = RedisCluster.launch(masters=3)
    try:
        nodes = [cluster.node_client(port) for port in cluster.master_ports()]
        yield cluster.url, nodes
        for node in nodes:
            node.close()
    finally:
        cluster.stop()


def node_stats(nodes: list[redis.Redis]) -> dict[str, Any]:
    """What every node has done so far, summed: CPU seconds, commands, read events."""
    cpu = 0.0
    per_node: list[float] = []
    reads = 0
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for node in nodes:
        user, sys_ = redis_cpu(node)
        cpu += user + sys_
        per_node.append(user + sys_)
        reads += int(node.info("stats")["total_reads_processed"])
        for name, stat in commandstats(node).items():
            calls[name] += int(stat["calls"])
            usec[name] += int(stat["usec"])
    return {"cpu_s": cpu, "per_node": per_node, "reads": reads, "calls": calls, "usec": usec}


def run_once(
    setup: str, partitions: int, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    with redis_of(setup, partitions) as (url, nodes):
        env = {"OMP_NUM_THREADS": "1", "TOKENFLEET_PARTITIONS": str(partitions)}
        worker_args = ["--runner", "sim", "--sim-tok-s", str(args.tok_s)]
        worker_args += ["--max-batch", str(args.batch), "--max-active", str(args.batch)]
        group = LocalWorkers(url, PREFIX, worker_args, log_dir=log_dir, env=env)
        names = group.start(args.workers, name_prefix=f"{setup}{partitions}")
        try:
            group.wait_live(names, timeout=120)
            producer = Producer.from_url(
                url, prefix=PREFIX, partitions=partitions, default_cap=1_000_000
            )
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
            for node in nodes:
                node.config_resetstat()
            before = node_stats(nodes)
            t0 = time.perf_counter()
            outcomes = producer.submit_many(requests)
            assert all(o.accepted for o in outcomes), [o.error for o in outcomes if o.error]
            checks = wait_results(connect(url), producer, [r.job_id for r in requests])
            wall = time.perf_counter() - t0
            after = node_stats(nodes)
            wcpu1 = sum(group.cpu_seconds().values())
            load = load_now()
            beats = group.settle(30)  # counters as of the end of the run
            ticks = sum(float(beats[n]["ticks"]) - ticks0[n] for n in names)
        finally:
            group.kill_all()
    tokens = args.jobs * args.length
    cpu = after["cpu_s"] - before["cpu_s"]
    calls = after["calls"]  # since RESETSTAT (the stat reads before it are not in)
    # this script's own: the INFO reads of `before` (2 INFO + 1 commandstats a node) and
    # one EXISTS a check; and the submit: one round trip a node on one Redis, one a job
    # on a cluster (redis-py's cluster client sends a script call at a time)
    own_reads = 3 * len(nodes) + checks + (len(nodes) if setup == "single" else args.jobs)
    round_trips = after["reads"] - before["reads"] - own_reads
    out = {
        "setup": setup,
        "partitions": partitions,
        "nodes": len(nodes),
        "wall_s": wall,
        "tokens": tokens,
        "ticks": ticks,
        "redis_cpu_s": cpu,
        "redis_cpu_s_per_node": [
            b - a for a, b in zip(before["per_node"], after["per_node"], strict=True)
        ],
        "commands": sum(calls.values()),
        "evalsha": calls.get("evalsha", 0),
        "round_trips": round_trips,
        "top_commands": dict(sorted(after["usec"].items(), key=lambda kv: -kv[1])[:8]),
        "calls": dict(calls),
        "workers_cpu_s": wcpu1 - wcpu0,
        "load": load,
    }
    out.update(
        us_per_token=1e6 * cpu / tokens,
        us_per_tick=1e6 * cpu / ticks,
        evalsha_per_tick=out["evalsha"] / ticks,
        round_trips_per_tick=round_trips / ticks,
        commands_per_token=out["commands"] / tokens,
        tokens_per_tick=tokens / ticks,
        worker_ms_per_tick=1e3 * wall * args.workers / ticks,
        worker_cpu_us_per_tick=1e6 * out["workers_cpu_s"] / ticks,
        tok_s=tokens / wall,
        redis_util=cpu / wall,
    )
    return out


def wait_results(client: Any, producer: Producer, job_ids: list[str], timeout: float = 600) -> int:
    """Until every job's result exists, checking one key at a time (the oldest not seen
    yet) every 0.1 s; returns how many checks it sent."""
    checks = 0
    deadline = time.monotonic() + timeout
    pending = list(job_ids)
    while pending:
        checks += 1
        if client.exists(producer.keys.result(pending[0])):
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} jobs not finished")
        time.sleep(0.1)
    client.close()
    return checks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tok-s", type=float, default=3000)
    p.add_argument("--jobs", type=int, default=256)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--partitions", default="3,6", help="cluster partition counts")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    today = dt.date.today().isoformat()
    out = args.out or Path(__file__).parent / f"results-cluster-cost-{today}.json"
    setups = [("single", 1)] + [("cluster", int(x)) for x in args.partitions.split(",")]
    machine = machine_info()
    print(f"cpu: {machine['cpu']} ({machine['cores']} cores), load {machine['loadavg_at_start']}")
    runs: list[dict[str, Any]] = []
    log_dir = Path("/tmp") / f"cluster-cost-{time.time():.0f}"
    log_dir.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for setup, partitions in abba(setups, r):
            run = run_once(setup, partitions, args, log_dir)
            run["round"] = r
            runs.append(run)
            print(
                f"round {r} {setup:7s} P={partitions}: {run['us_per_token']:6.2f} us/token"
                f"  {run['us_per_tick']:7.1f} us/tick  {run['evalsha_per_tick']:4.2f} evalsha/tick"
                f"  {run['round_trips_per_tick']:4.2f} round trips/tick"
                f"  worker {run['worker_ms_per_tick']:5.1f} ms/tick"
                f" {run['worker_cpu_us_per_tick']:6.0f} us CPU/tick"
                f"  {run['tok_s']:6.0f} tok/s  load {run['load']['loadavg'][0]:.2f}",
                flush=True,
            )
            summary = {
                f"{s} P={n}": {
                    f: spread([x[f] for x in runs if (x["setup"], x["partitions"]) == (s, n)])
                    for f in FIELDS
                }
                for s, n in setups
            }
            doc = {
                "what": "tick cost on a Redis Cluster vs one Redis (bench/cluster_cost.py)",
                "args": {k: v for k, v in vars(args).items() if k != "out"},
                "machine": mark_end(machine),
                "summary": summary,
                "runs": runs,
            }
            out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
