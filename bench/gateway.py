"""What the HTTP gateway costs: streamed chat requests through `tokenfleet gateway` vs the
Python `AsyncProducer` directly, same workload, same worker, same run; and (`--streams N`)
whether one gateway process holds N concurrent streams.

Usage: python bench/gateway.py [--requests 16] [--rounds 5] [--device cpu] [--threads 1]
       [--out bench/out/gateway.json]
       python bench/gateway.py --streams 2000 [--workers 2] [--leave-share 0.1]
       [--out bench/out/gateway-streams.json] [--plot docs/img/gateway-streams.png]

Starts a redis-server of its own, ONE `tokenfleet worker` (tiny-random) and the gateway
as a subprocess (`tokenfleet.gateway.command.gateway`), then runs rounds: each round
submits all requests at once and streams every one to its end, directly and through
the gateway (SSE, httpx), the order alternating between rounds. Greedy, `ignore_eos`,
so every request makes exactly its max_tokens.

Reported per mode: useful tokens/s (completion tokens of a round / its wall time,
median over rounds) and time to first token (submit → first token seen by the
client, pooled over rounds). The gateway sends a chat stream's first chunk (the
assistant role) as soon as the first token reaches it, so both modes time the same
event. Also: the gateway process's CPU time per streamed token (Linux /proc).
Prints a table, writes JSON.

`--streams N`: the same redis-server, `--workers` tiny-random workers and the gateway
subprocess (queue cap 2 N, queue timeout 15 min), and a client in a process of its own
(this script with `--client`, httpx) that opens N streamed completions at once: most
ask for 16–48 tokens; a `--leave-share` of them ask for 256 and hang up after 4. Counted
client side: HTTP errors, error events, streams that did not end in `data: [DONE]`
with every token, connection failures. Sampled every 0.5 s meanwhile: the gateway's
RSS (/proc), its Redis connections by kind (CLIENT LIST: pub/sub and command), the
streams it follows (/health) and the workers' KV in use and active sessions. At the
end: the gateway's peak RSS (VmHWM), how the abandoned jobs finished, and whether the
workers' `kv_used_bytes` went back to 0. Writes JSON and a plot of the samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from _fleet import Fleet
from _rounds import abba, wait_until
from report import figure, machine_info, mark_end, parser, pct, write_json

from tokenfleet.gateway.app import CLIENT_NAME
from tokenfleet.gateway.subscriber import PUBSUB_CLIENT_NAME
from tokenfleet.keys import Keys
from tokenfleet.local import cpu_seconds, free_port
from tokenfleet.producer import AsyncProducer, Producer
from tokenfleet.protocol import GenerationRequest

PREFIX = "bench-gw:"
WORDS = ["the", "fleet", "pulls", "jobs", "from", "a", "capped", "stream", "and", "tokens"]


def workload(n: int, seed: int = 5) -> list[tuple[str, int]]:
    """n (user message, max_tokens) pairs: messages of 3–40 words, 16–128 new tokens."""
    rng = random.Random(seed)
    return [
        (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))), rng.randint(16, 128))
        for _ in range(n)
    ]


def stream_body(max_tokens: int, **content: Any) -> dict[str, Any]:
    """A streamed, greedy OpenAI request body (usage in its last chunk), eos ignored."""
    return {
        "model": "default",
        **content,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


Streamer = Callable[[str, int], Awaitable[tuple[float, int]]]


async def one_round(one: Streamer, jobs: list[tuple[str, int]]) -> dict[str, Any]:
    """Every job at once through `one` (its TTFT, its tokens): wall time, TTFTs, tokens."""
    start = time.perf_counter()
    results = await asyncio.gather(*(one(m, n) for m, n in jobs))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "ttft_s": [t for t, _ in results], "tokens": sum(n for _, n in results)}


async def direct_round(producer: AsyncProducer, jobs: list[tuple[str, int]]) -> dict[str, Any]:
    async def one(message: str, new: int) -> tuple[float, int]:
        start = time.perf_counter()
        handle = await producer.submit(
            GenerationRequest(
                messages=[{"role": "user", "content": message}],
                max_new_tokens=new,
                ignore_eos=True,
            )
        )
        ttft = -1.0
        async for _event in handle.stream(timeout=300):
            if ttft < 0:
                ttft = time.perf_counter() - start
        assert handle.finish is not None and handle.finish.reason == "length", handle.finish
        return ttft, handle.finish.usage.completion_tokens

    return await one_round(one, jobs)


async def gateway_round(http: httpx.AsyncClient, jobs: list[tuple[str, int]]) -> dict[str, Any]:
    async def one(message: str, new: int) -> tuple[float, int]:
        body = stream_body(new, messages=[{"role": "user", "content": message}])
        start = time.perf_counter()
        ttft = -1.0
        tokens = 0
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if ttft < 0:
                    ttft = time.perf_counter() - start
                assert not line.startswith('data: {"error"'), line
                if '"usage":{' in line:  # the last chunk; the client skips parsing the rest
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return ttft, tokens

    return await one_round(one, jobs)


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["tokens"] / r["wall_s"] for r in rounds]
    ttfts = [t for r in rounds for t in r["ttft_s"]]
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_rounds": rates,
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p99_s": pct(ttfts, 99),
        "tokens_per_round": rounds[0]["tokens"],
    }


async def run(
    url: str, gateway_url: str, gateway_pid: int, jobs: list[tuple[str, int]], rounds: int
) -> Any:
    producer = AsyncProducer.from_url(url, prefix=PREFIX)
    limits = httpx.Limits(max_connections=len(jobs) * 2, max_keepalive_connections=len(jobs) * 2)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=300, limits=limits) as http:
        await direct_round(producer, jobs)  # warm-up: first forwards, connections
        await gateway_round(http, jobs)
        direct, gateway = [], []
        gateway_cpu = 0.0
        for i in range(rounds):  # alternate which mode goes first, so drift hits both
            for mode in abba(("direct", "gateway"), i):
                if mode == "direct":
                    direct.append(await direct_round(producer, jobs))
                else:
                    before = cpu_seconds(gateway_pid)
                    gateway.append(await gateway_round(http, jobs))
                    gateway_cpu += cpu_seconds(gateway_pid) - before
    await producer.aclose()
    tokens = sum(r["tokens"] for r in gateway)
    return summarise(direct), summarise(gateway), 1000 * gateway_cpu / tokens


def start_gateway(redis_url: str, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    """`tokenfleet gateway` (PREFIX, a free port, `extra` flags) as a subprocess: its URL, it."""
    port = free_port()
    cmd = [sys.executable, "-c", "import typer; from tokenfleet.cli.gateway import gateway;"]
    cmd[-1] += " typer.run(gateway)"
    cmd += ["--redis-url", redis_url, "--prefix", PREFIX, "--port", str(port)]
    cmd += ["--log-level", "warning", *extra]
    return f"http://127.0.0.1:{port}", subprocess.Popen(cmd)


def wait_healthy(
    gateway_url: str, proc: subprocess.Popen[bytes], timeout: float = 120, want: int = 1
) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("the gateway exited early")
        try:
            health = httpx.get(f"{gateway_url}/health", timeout=2).json()
        except httpx.HTTPError:
            return False
        return bool(health.get("live_workers", 0) >= want)

    if not wait_until(healthy, timeout, every_s=0.2):
        raise TimeoutError("the gateway or the worker did not come up")


@dataclass
class Served:
    """A fleet on PREFIX and one gateway process in front of it."""

    redis_url: str
    producer: Producer
    gateway_url: str
    gateway: subprocess.Popen[bytes]


@contextmanager
def served(worker_args: list[str], workers: int, *gateway_flags: str) -> Iterator[Served]:
    """A redis-server, `workers` workers with `worker_args` and the gateway (with
    `gateway_flags`), once the gateway sees every worker; all stopped on exit."""
    with Fleet() as fleet:
        group = fleet.workers(PREFIX, worker_args)
        gateway_url, gateway = start_gateway(fleet.url, *gateway_flags)
        try:
            group.start(workers, name_prefix="bench-gw")
            wait_healthy(gateway_url, gateway, want=workers)
            yield Served(fleet.url, fleet.producer(group), gateway_url, gateway)
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)


# ---- N concurrent streams (--streams) ------------------------------------------------


def stream_plan(n: int, leave_share: float, seed: int = 11) -> list[tuple[int, int | None]]:
    """(max_tokens, hang up after this many chunks or None) per stream."""
    rng = random.Random(seed)
    return [
        (256, 4) if rng.random() < leave_share else (rng.randint(16, 48), None) for _ in range(n)
    ]


async def storm_client(url: str, plan: list[tuple[int, int | None]]) -> list[dict[str, Any]]:
    """Every stream of `plan` at once; one record per stream."""
    limits = httpx.Limits(max_connections=len(plan) + 16, max_keepalive_connections=0)
    timeout = httpx.Timeout(1800, connect=120, pool=120)

    async def one(http: httpx.AsyncClient, i: int, new: int, leave: int | None) -> dict[str, Any]:
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 13))
        body = stream_body(new, prompt=words)
        rec: dict[str, Any] = {"max_tokens": new, "leaves": leave is not None, "status": None}
        rec |= {"error": None, "done": False, "tokens": 0, "chunks": 0, "keepalives": 0}
        start = time.perf_counter()
        try:
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                rec["status"] = reply.status_code
                rec["job_id"] = reply.headers.get("x-tokenfleet-job-id")
                if reply.status_code != 200:
                    rec["error"] = (await reply.aread()).decode(errors="replace")[:300]
                    return rec
                async for line in reply.aiter_lines():
                    if line.startswith(":"):
                        rec["keepalives"] += 1
                        continue
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        rec["done"] = True
                        break
                    if payload.startswith('{"error"'):
                        rec["error"] = payload[:300]
                        break
                    if rec["chunks"] == 0:
                        rec["ttft_s"] = time.perf_counter() - start
                    rec["chunks"] += 1
                    if '"usage":{' in payload:
                        rec["tokens"] = json.loads(payload)["usage"]["completion_tokens"]
                    if leave is not None and rec["chunks"] >= leave:
                        break  # hang up mid-stream: the gateway must cancel the job
        except Exception as exc:  # connect/read failures count as errors
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["wall_s"] = time.perf_counter() - start
        return rec

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        return await asyncio.gather(*(one(http, i, new, lv) for i, (new, lv) in enumerate(plan)))


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def fleet_sample(r: redis.Redis, keys: Keys) -> tuple[int, int]:
    """(KV bytes in use, active sessions) summed over the live workers' hashes."""
    kv = active = 0
    for name in r.zrange(keys.workers(), 0, -1):
        info = r.hmget(keys.worker(name.decode()), ["kv_used_bytes", "active"])
        kv += int(info[0] or 0)
        active += int(info[1] or 0)
    return kv, active


def storm(args: argparse.Namespace) -> None:
    n = args.streams
    keys = Keys(PREFIX)
    machine = machine_info()
    worker_args = ["--model", "tiny-random", "--device", args.device, "--threads", "1"]
    worker_args += ["--max-batch", "256", "--max-active", "512", "--max-waiting", "64"]
    worker_args += ["--kv-mb", "512"]
    samples: list[dict[str, float]] = []
    out = Path(args.out)
    client_out = out.with_suffix(".client.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with served(worker_args, args.workers, "--queue-timeout", "900") as fleet:
        r = fleet.producer.redis
        fleet.producer.set_queue_cap(2 * n)  # every stream's job must fit in the queue
        client_cmd = [sys.executable, __file__, "--client", fleet.gateway_url]
        client_cmd += ["--streams", str(n), "--leave-share", str(args.leave_share)]
        client_cmd += ["--out", str(client_out)]
        start = time.monotonic()
        client = subprocess.Popen(client_cmd)
        while client.poll() is None:
            clients = r.client_list()
            kv, active = fleet_sample(r, keys)
            try:
                health = httpx.get(f"{fleet.gateway_url}/health", timeout=10).json()
                streams = health["pubsub"]["streams"]
            except (httpx.HTTPError, KeyError):
                streams = -1
            samples.append(
                {
                    "t_s": time.monotonic() - start,
                    "gateway_rss_mb": rss_mb(fleet.gateway.pid),
                    "pubsub_connections": sum(c.get("name") == PUBSUB_CLIENT_NAME for c in clients),
                    "command_connections": sum(c.get("name") == CLIENT_NAME for c in clients),
                    "streams": streams,
                    "kv_used_mb": kv / 2**20,
                    "active": active,
                }
            )
            time.sleep(0.5)
        wall = time.monotonic() - start
        if client.returncode != 0:
            raise RuntimeError(f"the client process failed ({client.returncode})")
        records = json.loads(client_out.read_text())
        # the workers' KV must go back to 0 once every stream ended (abandoned ones cancelled)
        settle_start = time.monotonic()
        wait_until(lambda: not any(fleet_sample(r, keys)), 120, every_s=0.5)
        settle = time.monotonic() - settle_start
        kv, active = fleet_sample(r, keys)
        peak_rss = rss_mb(fleet.gateway.pid, "VmHWM")
        leavers = [rec for rec in records if rec["leaves"] and rec.get("job_id")]
        reasons: dict[str, int] = {}
        for rec in leavers:
            reason = r.hget(keys.job(rec["job_id"]), "finish_reason")
            name = reason.decode() if reason else "unfinished"
            reasons[name] = reasons.get(name, 0) + 1

    def failed(rec: dict[str, Any]) -> bool:
        if rec["status"] != 200 or rec["error"] is not None:
            return True
        return not rec["leaves"] and not (rec["done"] and rec["tokens"] == rec["max_tokens"])

    stayers = [rec for rec in records if not rec["leaves"]]
    ttfts = [rec["ttft_s"] for rec in stayers if "ttft_s" in rec]
    result = {
        "streams": n,
        "workers": args.workers,
        "worker": {"model": "tiny-random", "device": args.device, "threads": 1},
        "leave_share": args.leave_share,
        "errors": sum(failed(rec) for rec in records),
        "error_examples": sorted({str(rec["error"])[:200] for rec in records if failed(rec)})[:10],
        "completed_streams": sum(rec["done"] for rec in stayers),
        "streams_expected_to_complete": len(stayers),
        "abandoned_streams": len(leavers),
        "abandoned_finish_reasons": reasons,
        "completion_tokens": sum(rec["tokens"] for rec in stayers),
        "keepalive_comments": sum(rec["keepalives"] for rec in records),
        "wall_s": wall,
        "ttft_p50_s": pct(ttfts, 50) if ttfts else None,
        "ttft_p99_s": pct(ttfts, 99) if ttfts else None,
        "gateway_peak_rss_mb": peak_rss,
        "pubsub_connections_max": max(s["pubsub_connections"] for s in samples),
        "command_connections_max": max(s["command_connections"] for s in samples),
        "streams_followed_max": max(s["streams"] for s in samples),
        "kv_used_bytes_after": kv,
        "active_after": active,
        "kv_settle_s": settle,
        "samples": samples,
        "machine": mark_end(machine),
    }
    write_json(out, result)
    client_out.unlink(missing_ok=True)
    if args.plot:
        plot_storm(result, Path(args.plot))
    print(f"{n} concurrent streams, {args.workers} tiny-random worker(s), one gateway process")
    for key in (
        "errors",
        "completed_streams",
        "streams_expected_to_complete",
        "abandoned_streams",
        "abandoned_finish_reasons",
        "gateway_peak_rss_mb",
        "pubsub_connections_max",
        "command_connections_max",
        "kv_used_bytes_after",
        "kv_settle_s",
        "wall_s",
    ):
        print(f"  {key}: {result[key]}")
    if result["error_examples"]:
        print("  errors, e.g.:", *result["error_examples"], sep="\n    ")


def plot_storm(result: dict[str, Any], path: Path) -> None:
    samples = result["samples"]
    t = [s["t_s"] for s in samples]
    with figure(path, 3, 1, figsize=(9, 9), sharex=True) as axes:
        axes[0].plot(t, [s["streams"] for s in samples], label="streams the gateway follows")
        axes[0].plot(t, [s["active"] for s in samples], label="sessions active on the workers")
        axes[0].set_title(
            f"{result['streams']:,} concurrent streams: {result['errors']} errors, "
            f"{result['completed_streams']:,}/{result['streams_expected_to_complete']:,} complete, "
            f"{result['abandoned_streams']} abandoned"
        )
        axes[0].legend(fontsize=8)
        axes[1].plot(t, [s["gateway_rss_mb"] for s in samples], color="C2", label="gateway RSS")
        axes[1].axhline(300, color="C3", linestyle=":", label="target 300 MB")
        axes[1].set_ylabel("MB")
        axes[1].legend(fontsize=8)
        ax = axes[1].twinx()
        ax.plot(t, [s["pubsub_connections"] for s in samples], color="C4", label="pub/sub conns")
        ax.plot(t, [s["command_connections"] for s in samples], color="C5", label="command conns")
        ax.set_ylabel("connections")
        ax.legend(fontsize=8, loc="lower right")
        axes[2].plot(t, [s["kv_used_mb"] for s in samples], color="C1")
        axes[2].set_ylabel("workers' KV in use, MiB")
        axes[2].set_xlabel("seconds since the first request")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    p.add_argument("--out", default=None, help="default bench/out/gateway[-streams].json")
    p.add_argument("--streams", type=int, default=0, help="N concurrent streams instead")
    p.add_argument("--workers", type=int, default=2, help="workers of --streams")
    p.add_argument("--leave-share", type=float, default=0.1, help="clients that hang up")
    p.add_argument("--plot", default="docs/img/gateway-streams.png", help="of --streams")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the client process
    args = p.parse_args()
    if args.client:
        plan = stream_plan(args.streams, args.leave_share)
        Path(args.out).write_text(json.dumps(asyncio.run(storm_client(args.client, plan))))
        return
    if args.streams:
        args.out = args.out or "bench/out/gateway-streams.json"
        storm(args)
        return
    args.out = args.out or "bench/out/gateway.json"
    jobs = workload(args.requests)
    machine = machine_info()
    worker_args = ["--model", "tiny-random", "--device", args.device]
    worker_args += ["--threads", str(args.threads), "--max-batch", str(max(32, args.requests))]
    with served(worker_args, 1) as fleet:
        direct, gateway, cpu_ms = asyncio.run(
            run(fleet.redis_url, fleet.gateway_url, fleet.gateway.pid, jobs, args.rounds)
        )

    result = {
        "requests": args.requests,
        "rounds": args.rounds,
        "max_tokens": [n for _, n in jobs],
        "worker": {"model": "tiny-random", "device": args.device, "threads": args.threads},
        "direct": direct,
        "gateway": gateway,
        "tokens_per_s_ratio": gateway["tokens_per_s"] / direct["tokens_per_s"],
        "added_ttft_p50_s": gateway["ttft_p50_s"] - direct["ttft_p50_s"],
        "added_ttft_p99_s": gateway["ttft_p99_s"] - direct["ttft_p99_s"],
        "gateway_cpu_ms_per_token": cpu_ms,
        "machine": mark_end(machine),
    }
    write_json(Path(args.out), result)
    print(
        f"{args.requests} streamed chat requests × {args.rounds} rounds, 1 worker ({args.device})"
    )
    print(f"{'mode':<10}{'tokens/s':>10}{'TTFT p50':>11}{'TTFT p99':>11}")
    for name, r in (("direct", direct), ("gateway", gateway)):
        print(
            f"{name:<10}{r['tokens_per_s']:>10,.1f}"
            f"{r['ttft_p50_s'] * 1000:>9.1f}ms{r['ttft_p99_s'] * 1000:>9.1f}ms"
        )
    p50, p99 = result["added_ttft_p50_s"] * 1000, result["added_ttft_p99_s"] * 1000
    ratio = result["tokens_per_s_ratio"]
    print(f"ratio {ratio:.3f}; added TTFT p50 {p50:+.1f} ms, p99 {p99:+.1f} ms")
    print(f"gateway CPU: {cpu_ms:.3f} ms per streamed token")


if __name__ == "__main__":
    main()
