"""Coordination cost: Redis's own CPU per generated token, per tick and per job, measured
on a fleet of simulated GPU workers, and how many workers one Redis core carries.

Usage: python bench/coordination.py [--seconds 10] [--warmup 4] [--rounds 1]
                                    [--tok-s 3000] [--tick-ms 15] [--fit-workers 2]
                                    [--scale-workers 1,4,8,16] [--batches 8,32,64]
                                    [--lengths 256,32] [--clients none,result,stream]
                                    [--client-procs 2] [--mode NAME=ARGS ...] [--no-base]
                                    [--out bench/results-coordination-DATE.json]
                                    [--plot docs/img/coordination.png]
       python bench/coordination.py --from RUN.json [RUN.json ...]   (fit + report only)

The workers are real `tokenfleet worker` processes with `--runner sim`
(tokenfleet/model/sim_runner.py): the whole loop, engine, fencing and tick.lua, but no
model, each tick sleeping max(--tick-ms, rows / R) like a GPU forward. Each measured
window gets a fresh redis-server (`tokenfleet.local.RedisServer`, via _fleet.Fleet),
W workers at `--max-batch B --max-active B`, and `--client-procs` client processes
(asyncio `AsyncProducer`s) that keep W * (B + 6) jobs accepted and unfinished (queued +
running; 16..32-token prompts, max_new_tokens uniform in [L/2, 3L/2], eos ignored) and,
by client mode, follow each job:

    none     nobody listens: submit only (the tokens are still published)
    result   each job awaited with `JobHandle.result()`
    stream   each job followed with `JobHandle.stream()` (the gateway's path)

The windows, per worker mode: idle (W = --fit-workers and the most --scale-workers, no
jobs); fit (W = --fit-workers at R = --tok-s: every client mode at every batch with the
first length, and at the largest batch with the other lengths); scale (each other W of
--scale-workers at the fit windows' total pace, R = tok_s * fit_workers / W, clients
--scale-clients). A window waits --warmup s (longer when filling the batch takes longer),
sends `CONFIG RESETSTAT`, and measures --seconds s, read from Redis itself: INFO cpu
(used_cpu_user + used_cpu_sys; RESETSTAT leaves them), INFO commandstats, INFO stats.
Counts are exact, from the commandstats: tokens = PUBLISH - XDEL - heartbeats (every
token event and every finish is one PUBLISH in tick.lua, every finish one XDEL, every
heartbeat one PUBLISH on the telemetry channel, which this program counts), finishes =
XDEL, submits = XADD - tokens - finishes. Ticks come from the workers' telemetry
(`ticks`, interpolated to the window's edges). The CPU of the workers, of the clients and
of the whole machine is read from /proc.

Model: Redis CPU = c_0*T + c_w*W*T + c_tok*tokens + c_tick*ticks + c_job*jobs. c_0 (Redis
itself) and c_w (a worker's heartbeats, orphan claims, idle reads) come from the idle
windows; c_tick (shared) and c_tok, c_job per client mode from one least-squares fit
(relative errors) over the busy windows, which vary B (ticks per token) and L (jobs per
token). A worker at R tok/s, batch B, mean job length L then costs Redis
R*c_tok + (R/B)*c_tick + (R/L)*c_job + c_w CPU-seconds per second, and one Redis core
carries (1 - c_0) / that many of them.

`--mode NAME=ARGS` adds a worker mode (extra `tokenfleet worker` flags, e.g.
`--mode coalesce4="--stream-interval 4"` once workers have that flag): every window
runs once per mode ("base": no extra flags; `--no-base` leaves it out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import redis
from _fleet import Fleet
from _rounds import abba, wait_until
from report import Run, figure, load_now, markdown_text, parser

from tokenfleet.keys import Keys
from tokenfleet.local import cpu_seconds
from tokenfleet.protocol import GenerationRequest

PREFIX = "coord:"
CLIENT_MODES = ("none", "result", "stream")
EXTRA_JOBS = 6  # jobs accepted per worker beyond its batch: max_waiting (4) + margin
TOP = 12  # commands kept per window, by total µs


@dataclass(frozen=True)
class Window:
    """One measured configuration."""

    workers: int
    batch: int
    length: int  # mean max_new_tokens; 0: idle (no jobs)
    clients: str  # none | result | stream
    tok_s: float  # each worker's pace at a full batch (--sim-tok-s)
    mode: str = "base"  # worker mode (--mode)
    group: str = "fit"  # fit | scale | idle

    @property
    def name(self) -> str:
        if not self.length:
            return f"{self.mode} idle W={self.workers}"
        pace = f" R={self.tok_s:.0f}" if self.group == "scale" else ""
        return f"{self.mode} {self.clients} W={self.workers} B={self.batch} L={self.length}{pace}"


# ---- the client processes ---------------------------------------------------------------


def client_main(spec: dict[str, Any]) -> None:
    """One client process: keep its share of the accepted jobs topped up, follow each job
    by its mode, print a JSON summary when SIGTERM arrives."""
    asyncio.run(_client(spec))


async def _client(spec: dict[str, Any]) -> None:
    import redis.asyncio as aredis

    from tokenfleet.producer import AsyncProducer

    client = aredis.Redis.from_url(spec["url"], max_connections=1_000_000)
    producer = AsyncProducer(client, keys=Keys(spec["prefix"]), default_cap=1_000_000)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    rng = random.Random(spec["seed"])
    stats: Counter[str] = Counter()
    tasks: set[asyncio.Task[None]] = set()
    length, share = spec["length"], spec["procs"]

    async def follow(handle: Any) -> None:
        try:
            if spec["clients"] == "stream":
                async for _event in handle.stream(timeout=120):
                    stats["tokens_seen"] += 1
            else:
                stats["tokens_seen"] += len((await handle.result(timeout=300)).token_ids)
            stats["followed"] += 1
        except Exception as exc:  # counted, reported by the parent
            stats[f"error:{type(exc).__name__}"] += 1

    while not stop.is_set():
        depth = await producer.depth()
        need = min(256, math.ceil((spec["target"] - depth) / share))
        if need > 0:
            requests = []
            for _ in range(need):
                stats["n"] += 1
                requests.append(
                    GenerationRequest(
                        job_id=f"{spec['tag']}-{stats['n']}",
                        prompt_ids=[rng.randrange(1, 256) for _ in range(rng.randint(16, 32))],
                        max_new_tokens=rng.randint(max(1, length // 2), max(1, 3 * length // 2)),
                        ignore_eos=True,
                    )
                )
            for _job_id, handle, error in await producer.submit_many(requests):
                if handle is None:
                    stats[f"refused:{type(error).__name__}"] += 1
                    continue
                stats["submitted"] += 1
                if spec["clients"] != "none":
                    task = asyncio.create_task(follow(handle))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.02)
    stats["following_at_end"] = len(tasks)
    print(json.dumps(dict(stats)), flush=True)
    os._exit(0)  # the followers still running are abandoned, not awaited


class Clients:
    """`procs` client processes of this script (`--client SPEC`)."""

    def __init__(self, url: str, window: Window, procs: int, tag: str) -> None:
        target = window.workers * (window.batch + EXTRA_JOBS)
        self.procs = []
        for p in range(procs):
            spec = {
                "url": url,
                "prefix": PREFIX,
                "clients": window.clients,
                "length": window.length,
                "target": target,
                "procs": procs,
                "seed": p,
                "tag": f"{tag}-c{p}",
            }
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--client", json.dumps(spec)],
                    stdout=subprocess.PIPE,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs if p.poll() is None)

    def stop(self) -> dict[str, int]:
        """SIGTERM each, gather their summaries (summed)."""
        total: Counter[str] = Counter()
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=30)
                lines = out.decode().strip().splitlines()
                total.update(json.loads(lines[-1]) if lines else {"client_no_summary": 1})
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                total["client_killed"] += 1
        return dict(total)


# ---- what the workers say about themselves ---------------------------------------------


class Telemetry(threading.Thread):
    """Every worker heartbeat on the telemetry channel: (arrival, fields) per worker."""

    def __init__(self, url: str, keys: Keys) -> None:
        super().__init__(daemon=True)
        self.pubsub = redis.Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(keys.telemetry_channel())
        self.samples: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        self.arrivals: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if message is None:
                continue
            now = time.time()
            try:  # a worker's preflight publishes "probe" once, before its first heartbeat
                fields = json.loads(message["data"])
            except ValueError:
                continue
            self.arrivals.append(now)
            self.samples.setdefault(fields["worker"], []).append((now, fields))

    def stop(self) -> None:
        self.done.set()
        self.join(5)
        self.pubsub.close()

    def beats_between(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.arrivals if t0 <= t < t1)

    def counter_at(self, worker: str, name: str, t: float) -> float:
        """A worker's counter at unix time `t`, interpolated (or extrapolated) linearly
        from the heartbeats around it."""
        points = [(at, float(f[name])) for at, f in self.samples.get(worker, [])]
        if len(points) < 2:
            return points[0][1] if points else 0.0
        before = [p for p in points if p[0] <= t]
        after = [p for p in points if p[0] > t]
        a, b = (
            (before[-1], after[0])
            if before and after
            else ((points[-2], points[-1]) if before else (points[0], points[1]))
        )
        return a[1] + (b[1] - a[1]) * (t - a[0]) / (b[0] - a[0])

    def delta(self, name: str, t0: float, t1: float) -> float:
        return sum(
            self.counter_at(w, name, t1) - self.counter_at(w, name, t0) for w in self.samples
        )

    def last(self, name: str) -> list[Any]:
        return [samples[-1][1].get(name) for samples in self.samples.values() if samples]


def warmup_s(window: Window, least: float) -> float:
    """`least`, or longer when filling the batch takes longer: B sessions' prompts
    (16..32 tokens) are rows at the worker's pace too."""
    if not window.length:
        return least
    return max(least, 1.5 * window.batch * 24 / window.tok_s)


# ---- reading Redis and the machine ---------------------------------------------------------


def redis_cpu(r: redis.Redis) -> tuple[float, float]:
    """(user, sys) CPU seconds of the redis-server process so far (INFO cpu)."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]), float(info["used_cpu_sys"])


def commandstats(r: redis.Redis) -> dict[str, dict[str, float]]:
    """{command: {calls, usec, usec_per_call}} since the last CONFIG RESETSTAT."""
    stats = r.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): {
            "calls": int(v["calls"]),
            "usec": int(v["usec"]),
            "usec_per_call": float(v["usec_per_call"]),
        }
        for name, v in stats.items()
    }


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs so far (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def calls(stats: dict[str, dict[str, float]], command: str) -> int:
    return int(stats.get(command, {}).get("calls", 0))


# ---- one window ------------------------------------------------------------------------------


def measure(
    window: Window, args: argparse.Namespace, worker_args: list[str], log_dir: Path, log: Any
) -> dict[str, Any]:
    keys = Keys(PREFIX)
    with Fleet() as fleet:
        sim = [
            "--runner",
            "sim",
            "--sim-tok-s",
            str(window.tok_s),
            "--sim-tick-ms",
            str(args.tick_ms),
        ]
        batch = ["--max-batch", str(window.batch), "--max-active", str(window.batch)]
        group = fleet.workers(PREFIX, [*sim, *batch, *worker_args], log_dir=log_dir)
        group.env = {"OMP_NUM_THREADS": "1"}
        tag = f"w{window.workers}b{window.batch}l{window.length}{window.clients}{window.mode}"
        started = time.perf_counter()
        names = group.start(window.workers, name_prefix=tag)
        telemetry = Telemetry(fleet.url, keys)
        telemetry.start()
        clients = None
        try:
            group.wait_live(names, timeout=120)
            start_s = time.perf_counter() - started
            r = redis.Redis.from_url(fleet.url)
            if window.length:
                clients = Clients(fleet.url, window, args.client_procs, tag)
            time.sleep(warmup_s(window, args.warmup))
            r.config_resetstat()
            t0, cpu0 = time.time(), redis_cpu(r)
            busy0 = machine_busy()
            wcpu0, ccpu0 = sum(group.cpu_seconds().values()), clients.cpu() if clients else 0.0
            time.sleep(args.seconds)
            t1, cpu1 = time.time(), redis_cpu(r)
            busy1 = machine_busy()
            wcpu1, ccpu1 = sum(group.cpu_seconds().values()), clients.cpu() if clients else 0.0
            stats = commandstats(r)
            info = r.info("stats")
            connected = int(r.info("clients")["connected_clients"])
            load = load_now()
            client_summary = clients.stop() if clients else {}
            clients = None
            wait_until(
                lambda: (
                    telemetry.samples and all(s[-1][0] > t1 for s in telemetry.samples.values())
                ),
                3,
            )
        finally:
            if clients is not None:
                clients.stop()
            group.kill_all()
            telemetry.stop()
    wall = t1 - t0
    beats = telemetry.beats_between(t0, t1)
    finishes = calls(stats, "xdel")
    events = calls(stats, "publish") - finishes - beats  # token events published
    submits = calls(stats, "xadd") - events - finishes
    ticks = telemetry.delta("ticks", t0, t1)
    decode = telemetry.delta("decode_tokens_total", t0, t1)
    user, sys_ = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    result = derive(
        {
            "window": asdict(window),
            "name": window.name,
            "worker_args": worker_args,
            "start_s": round(start_s, 2),
            "wall_s": wall,
            "redis_cpu_user_s": user,
            "redis_cpu_sys_s": sys_,
            "events": events,
            "decode_tokens_telemetry": decode,
            "ticks": ticks,
            "finishes": finishes,
            "submits": submits,
            "heartbeats": beats,
            "commands": sum(int(v["calls"]) for v in stats.values()),
            "evalsha": calls(stats, "evalsha"),
            "net_in_bytes": int(info["total_net_input_bytes"]),
            "net_out_bytes": int(info["total_net_output_bytes"]),
            "connected_clients": connected,
            "top_commands": dict(sorted(stats.items(), key=lambda kv: -kv[1]["usec"])[:TOP]),
            "workers_cpu_s": wcpu1 - wcpu0,
            "clients_cpu_s": ccpu1 - ccpu0,
            "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
            "load": load,
            "clients_summary": client_summary,
            "batch_size_mean": telemetry.last("batch_size_mean"),
        }
    )
    log(
        f"{window.name:34s} {result['tok_s']:8.0f} tok/s ({result['tok_s_per_worker']:6.0f}/worker)"
        f"  redis {100 * result['redis_util']:5.1f}% CPU  {_f(result['us_per_token'])} us/token"
        f"  {_f(result['us_per_tick'])} us/tick  {_f(result['commands_per_token'])} cmd/token"
        f"  workers {100 * result['workers_cpu_util']:4.0f}%  clients"
        f" {100 * result['clients_cpu_util']:4.0f}%  machine {100 * result['machine_busy']:3.0f}%"
        f"  load {load['loadavg'][0]:.2f}"
    )
    return result


def derive(w: dict[str, Any]) -> dict[str, Any]:
    """`w`'s raw counts plus what is derived from them. Tokens: the token events
    published (exact) while each carries one token; when a worker mode coalesces
    several into one event, the workers' telemetry (decode tokens + one first token per
    finished job: within 1 % of the exact count in uncoalesced windows with 256-token
    jobs, 3 % high with 32-token jobs)."""
    wall, ticks, finishes = w["wall_s"], w["ticks"], w["finishes"]
    cpu = w["redis_cpu_s"] = w["redis_cpu_user_s"] + w["redis_cpu_sys_s"]
    telemetry = w["decode_tokens_telemetry"] + finishes
    exact = w["events"] >= 0.8 * telemetry  # coalescing N >= 2 ticks: about 1 / N
    tokens = w["tokens"] = w["events"] if exact else telemetry
    w["tokens_from"] = "events" if exact else "telemetry"

    def per(n: float, d: float) -> float | None:
        return n / d if d > 0 else None

    w.update(
        redis_util=cpu / wall,
        worker_seconds=w["window"]["workers"] * wall,
        tok_s=tokens / wall,
        tok_s_per_worker=tokens / wall / w["window"]["workers"],
        tokens_per_tick=per(tokens, ticks),
        tokens_per_event=per(tokens, w["events"]),
        us_per_token=per(1e6 * cpu, tokens),
        us_per_tick=per(1e6 * cpu, ticks),
        us_per_job=per(1e6 * cpu, finishes),
        commands_per_token=per(w["commands"], tokens),
        evalsha_per_tick=per(w["evalsha"], ticks),
        net_in_bytes_per_token=per(w["net_in_bytes"], tokens),
        net_out_bytes_per_token=per(w["net_out_bytes"], tokens),
        workers_cpu_util=w["workers_cpu_s"] / wall,
        workers_us_per_token=per(1e6 * w["workers_cpu_s"], tokens),
        clients_cpu_util=w["clients_cpu_s"] / wall,
        clients_us_per_token=per(1e6 * w["clients_cpu_s"], tokens),
    )
    return w


def upgrade(w: dict[str, Any]) -> dict[str, Any]:
    """A window of a run written before the raw counts were kept (its `tokens` were the
    events: no worker mode coalesced then) in today's shape."""
    if "events" in w:
        return w
    w["events"] = w["tokens"]
    w["evalsha"] = round((w["evalsha_per_tick"] or 0) * w["ticks"])
    for side in ("in", "out"):
        w[f"net_{side}_bytes"] = round((w[f"net_{side}_bytes_per_token"] or 0) * w["tokens"])
    return w


def _f(value: float | None, fmt: str = "7.2f") -> str:
    return format(value, fmt) if value is not None else "      -"


# ---- the fit ------------------------------------------------------------------------------


def fit(results: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """The model's constants for one worker mode, in µs.

    c_0 (per second of Redis) and c_w (per worker-second) from the idle windows (two
    worker counts). Then one least-squares fit over every busy window of the mode of
    what its CPU leaves after them: c_tick shared by the client modes (a tick's Redis
    work is the worker's), c_tok and c_job per client mode (what clients add: a live
    subscriber per token, a follower's reads per job)."""
    import numpy as np

    mine = [r for r in results if r["window"]["mode"] == mode]
    idle = [r for r in mine if r["window"]["group"] == "idle"]
    c_0 = c_w = 0.0
    if len(idle) >= 2:
        a = np.array([[r["wall_s"], r["worker_seconds"]] for r in idle])
        b = np.array([r["redis_cpu_s"] for r in idle])
        (c_0, c_w), *_ = np.linalg.lstsq(a, b, rcond=None)
    elif idle:
        c_w = idle[0]["redis_cpu_s"] / idle[0]["worker_seconds"]
    out: dict[str, Any] = {"c_0_us_per_s": 1e6 * c_0, "c_w_us_per_worker_s": 1e6 * c_w}
    busy = [r for r in mine if r["window"]["length"] and r["ticks"] and r["tokens"] > 0]
    present = [c for c in CLIENT_MODES if sum(r["window"]["clients"] == c for r in busy) >= 2]
    busy = [r for r in busy if r["window"]["clients"] in present]
    if len(busy) < 1 + 2 * len(present) or not present:
        out["clients"] = {}
        return out
    # columns: ticks, then (tokens, jobs) of each client mode (zero in the others' rows)
    x = np.zeros((len(busy), 1 + 2 * len(present)))
    for i, r in enumerate(busy):
        k = present.index(r["window"]["clients"])
        x[i, 0] = r["ticks"]
        x[i, 1 + 2 * k] = r["tokens"]
        x[i, 2 + 2 * k] = (r["finishes"] + r["submits"]) / 2
    base = np.array([c_0 * r["wall_s"] + c_w * r["worker_seconds"] for r in busy])
    cpu = np.array([r["redis_cpu_s"] for r in busy])
    scale = x.max(axis=0)  # tokens outnumber jobs 100x: scaled columns condition better
    # relative errors: every window weighs the same, however much CPU it used
    coef, *_ = np.linalg.lstsq(x / scale / cpu[:, None], (cpu - base) / cpu, rcond=None)
    coef = coef / scale
    residual = (x @ coef + base) / cpu - 1
    out["c_tick_us"] = 1e6 * coef[0]
    out["clients"] = {
        c: {
            "c_tok_us": 1e6 * coef[1 + 2 * k],
            "c_tick_us": 1e6 * coef[0],
            "c_job_us": 1e6 * coef[2 + 2 * k],
            "windows": [r["name"] for r in busy if r["window"]["clients"] == c],
            "residual_pct": [
                round(100 * float(e), 2)
                for e, r in zip(residual, busy, strict=True)
                if r["window"]["clients"] == c
            ],
        }
        for k, c in enumerate(present)
    }
    return out


def redis_share(c: dict[str, float], c_w_us: float, tok_s: float, batch: int, length: int) -> float:
    """CPU seconds per second one worker costs Redis (the constants in µs)."""
    us = tok_s * c["c_tok_us"] + tok_s / batch * c["c_tick_us"] + tok_s / length * c["c_job_us"]
    return (us + c_w_us) / 1e6


def workers_per_core(
    f: dict[str, Any], clients: str, tok_s: float, batch: int, length: int
) -> float:
    """Workers whose Redis CPU fills one core (what Redis spends on itself, c_0, first)."""
    share = redis_share(f["clients"][clients], f["c_w_us_per_worker_s"], tok_s, batch, length)
    return (1 - f["c_0_us_per_s"] / 1e6) / share


def capacity_table(fits: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for mode, f in fits.items():
        for clients, c in f["clients"].items():
            for tok_s in (1000, 3000, 5000):
                for batch in (32, 64, 128):
                    rows.append(
                        {
                            "mode": mode,
                            "clients": clients,
                            "tok_s": tok_s,
                            "batch": batch,
                            "length": 256,
                            "redis_core_share": redis_share(
                                c, f["c_w_us_per_worker_s"], tok_s, batch, 256
                            ),
                            "workers_per_core": workers_per_core(f, clients, tok_s, batch, 256),
                        }
                    )
    return rows


# ---- report ---------------------------------------------------------------------------------


COLUMNS = (
    "window",
    "tok/s",
    "tok/s/worker",
    "ticks",
    "jobs",
    "Redis CPU %",
    "µs/token",
    "µs/tick",
    "µs/job",
    "cmd/token",
    "workers CPU %",
    "clients CPU %",
    "machine busy %",
)


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        rows.append(
            [
                r["name"],
                f"{r['tok_s']:.0f}",
                f"{r['tok_s_per_worker']:.0f}",
                f"{r['ticks']:.0f}",
                r["finishes"],
                f"{100 * r['redis_util']:.1f}",
                _f(r["us_per_token"], ".2f"),
                _f(r["us_per_tick"], ".1f"),
                _f(r["us_per_job"], ".0f"),
                _f(r["commands_per_token"], ".2f"),
                f"{100 * r['workers_cpu_util']:.0f}",
                f"{100 * r['clients_cpu_util']:.0f}",
                f"{100 * r['machine_busy']:.0f}",
            ]
        )
    return markdown_text(COLUMNS, rows)


def fit_text(fits: dict[str, Any]) -> str:
    rows = []
    for mode, f in fits.items():
        for clients, c in f["clients"].items():
            rows.append(
                [
                    mode,
                    clients,
                    f"{c['c_tok_us']:.2f}",
                    f"{c['c_tick_us']:.1f}",
                    f"{c['c_job_us']:.0f}",
                    f"{f['c_w_us_per_worker_s']:.0f}",
                    f"{f['c_0_us_per_s']:.0f}",
                    " ".join(f"{x:+.1f}" for x in c["residual_pct"]),
                ]
            )
    header = (
        "mode",
        "clients",
        "c_tok µs",
        "c_tick µs",
        "c_job µs",
        "c_w µs/worker-s",
        "c_0 µs/s",
        "residuals %",
    )
    return markdown_text(header, rows)


def commands_text(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        if not r["tokens"] > 0:
            continue
        tops = ", ".join(
            f"{name} {v['calls'] / r['tokens']:.2f}/tok {v['usec_per_call']:.2f}µs"
            for name, v in list(r["top_commands"].items())[:6]
        )
        lines.append(f"- {r['name']}: {tops}")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], fits: dict[str, Any], path: Path) -> None:
    colors = {"none": "tab:blue", "result": "tab:orange", "stream": "tab:green"}
    with figure(path, 1, 2, figsize=(12, 4.5)) as (left, right):
        rows = [r for r in results if r["window"]["group"] == "fit" and r["tokens"] > 0]
        shapes = sorted({(r["window"]["batch"], -r["window"]["length"]) for r in rows})
        bars = sorted({(r["window"]["mode"], r["window"]["clients"]) for r in rows})
        width = 0.8 / max(1, len(bars))
        for i, (mode, clients) in enumerate(bars):
            values = []
            for batch, length in shapes:
                match = [
                    r["us_per_token"]
                    for r in rows
                    if (r["window"]["mode"], r["window"]["clients"]) == (mode, clients)
                    and (r["window"]["batch"], -r["window"]["length"]) == (batch, length)
                ]
                values.append(sum(match) / len(match) if match else 0)
            label = clients if mode == "base" else f"{clients} ({mode})"
            xs = [j + i * width for j in range(len(shapes))]
            left.bar(xs, values, width, label=label, color=colors.get(clients))
        ticks = [j + (len(bars) - 1) * width / 2 for j in range(len(shapes))]
        left.set_xticks(ticks, [f"B={b} L={-n}" for b, n in shapes])
        left.set_ylabel("Redis CPU µs per generated token")
        workers = sorted({r["window"]["workers"] for r in rows})
        runs = len({(r.get("source") or {}).get("file") for r in rows})
        each = f", mean of {runs} runs" if runs > 1 else ""
        left.set_title(f"Measured, W={','.join(map(str, workers))}{each}: Redis CPU ÷ tokens")
        left.legend(title="clients")
        rates = [250 * k for k in range(2, 41)]
        for mode, f in fits.items():
            for clients in f["clients"]:
                for batch, style in ((32, ":"), (64, "-"), (128, "--")):
                    ys = [workers_per_core(f, clients, rate, batch, 256) for rate in rates]
                    tag = f"{clients} B={batch}" + ("" if mode == "base" else f" ({mode})")
                    right.plot(rates, ys, style, label=tag, color=colors.get(clients))
        right.set_xlabel("tokens/s per worker")
        right.set_ylabel("workers one Redis core carries (100 % CPU)")
        right.set_title("From the fitted constants, mean job 256 tokens")
        right.set_yscale("log")
        right.grid(True, which="both", alpha=0.3)
        right.legend(fontsize=7, ncol=3)


# ---- main -------------------------------------------------------------------------------------


def windows(args: argparse.Namespace, modes: list[str]) -> list[Window]:
    """Per worker mode: an idle window (the most workers, no jobs), the fit windows (every
    client mode x every batch at the main length, and the other lengths at the largest
    batch) and the scale windows (other worker counts at the same total pace)."""
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    clients = args.clients.split(",")
    scale = [int(x) for x in args.scale_workers.split(",") if x]
    top, fit_w = max(batches), args.fit_workers
    out = []
    for mode in modes:
        for w in sorted({fit_w, max([fit_w, *scale])}):  # c_0 and c_w: two worker counts
            out.append(Window(w, top, 0, "none", args.tok_s, mode, "idle"))
        for c in clients:
            for b in batches:
                out.append(Window(fit_w, b, lengths[0], c, args.tok_s, mode))
            for length in lengths[1:]:
                out.append(Window(fit_w, top, length, c, args.tok_s, mode))
        for w in scale:
            if w != fit_w:  # the fleet's total pace kept: fit_w workers' worth
                pace = args.tok_s * fit_w / w
                out.append(Window(w, top, lengths[0], args.scale_clients, pace, mode, "scale"))
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        client_main(json.loads(sys.argv[2]))
        return
    p = parser(__doc__)
    p.add_argument("--seconds", type=float, default=10.0, help="measured window")
    p.add_argument("--warmup", type=float, default=4.0, help="before each window")
    p.add_argument("--tok-s", type=float, default=3000.0, help="sim worker tokens/s at full batch")
    p.add_argument("--tick-ms", type=float, default=15.0, help="sim worker tick floor")
    p.add_argument("--fit-workers", type=int, default=2)
    p.add_argument("--scale-workers", default="1,4,8,16", help="at the fit windows' total pace")
    p.add_argument("--scale-clients", default="none", choices=CLIENT_MODES)
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--lengths", default="256,32", help="mean job lengths; the first is main")
    p.add_argument("--rounds", type=int, default=1, help="the plan again, in reverse order")
    p.add_argument("--clients", default=",".join(CLIENT_MODES))
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument(
        "--mode",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="a worker mode: extra worker flags (repeatable; 'base' has none)",
    )
    p.add_argument("--no-base", action="store_true", help="run the --mode modes only")
    p.add_argument(
        "--from",
        dest="sources",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="measure nothing: fit and report the windows of earlier runs (combined)",
    )
    today = dt.date.today().isoformat()
    p.add_argument("--out", default=f"bench/results-coordination-{today}.json")
    p.add_argument("--plot", default="docs/img/coordination.png")
    args = p.parse_args()
    modes: dict[str, list[str]] = {} if args.no_base else {"base": []}
    for item in args.mode:
        name, _, flags = item.partition("=")
        modes[name] = shlex.split(flags)
    run = Run()
    if args.sources:
        results = []
        for path in args.sources:
            report = json.loads(path.read_text())
            machine = report["machine"]
            source = {"file": path.name, "cpu": machine["cpu"], "date": machine["date"]}
            source["loadavg"] = [machine["loadavg_at_start"], machine["loadavg_at_end"]]
            for w in report["windows"]:
                w.pop("commandstats", None)  # earlier runs kept them all: the top ones do
                w.setdefault("source", source)
                results.append(derive(upgrade(w)))
        modes = {w["window"]["mode"]: w["worker_args"] for w in results}
        run.log(f"{len(results)} windows from {', '.join(map(str, args.sources))}")
    else:
        log_dir = Path("bench/out/coordination-logs")
        plan = windows(args, list(modes))
        run.log(
            f"{args.rounds} x {len(plan)} windows of {args.warmup:.0f}+{args.seconds:.0f} s;"
            f" {load_now()}"
        )
        results = []
        for r in range(args.rounds):
            for window in abba(plan, r):
                results.append(measure(window, args, modes[window.mode], log_dir, run.log))
                results[-1]["round"] = r
    fits = {mode: fit(results, mode) for mode in modes}
    capacity = capacity_table(fits)
    text = "\n".join(
        [
            table(results),
            fit_text(fits),
            "Commands per token and µs per call (top by total µs):\n",
            commands_text(results),
        ]
    )
    report = run.report(
        settings={k: v for k, v in vars(args).items() if k not in ("out", "plot", "sources")},
        sources=[str(path) for path in args.sources or ()],
        modes=modes,
        windows=results,
        fits=fits,
        capacity=capacity,
    )
    run.finish(args, report, None, partial(plot, results, fits), table=text)  # table: printed


if __name__ == "__main__":
    main()
