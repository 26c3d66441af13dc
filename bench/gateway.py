"""What the HTTP gateway costs: streamed chat requests through `tokenfleet gateway` vs the
Python `AsyncProducer` directly, same workload, same worker, same run.

Usage: python bench/gateway.py [--requests 16] [--rounds 5] [--device cpu] [--threads 1]
       [--out bench/out/gateway.json]

Starts an embedded redis-server, ONE `tokenfleet worker` (tiny-random) and the gateway
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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tokenfleet.local import EmbeddedRedis, LocalWorkers, free_port
from tokenfleet.producer import AsyncProducer
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


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


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

    start = time.perf_counter()
    results = await asyncio.gather(*(one(m, n) for m, n in jobs))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "ttft_s": [t for t, _ in results], "tokens": sum(n for _, n in results)}


async def gateway_round(http: httpx.AsyncClient, jobs: list[tuple[str, int]]) -> dict[str, Any]:
    async def one(message: str, new: int) -> tuple[float, int]:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": message}],
            "max_tokens": new,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
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

    start = time.perf_counter()
    results = await asyncio.gather(*(one(m, n) for m, n in jobs))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "ttft_s": [t for t, _ in results], "tokens": sum(n for _, n in results)}


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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
            for mode in ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct"):
                if mode == "direct":
                    direct.append(await direct_round(producer, jobs))
                else:
                    before = cpu_seconds(gateway_pid)
                    gateway.append(await gateway_round(http, jobs))
                    gateway_cpu += cpu_seconds(gateway_pid) - before
    await producer.aclose()
    tokens = sum(r["tokens"] for r in gateway)
    return summarise(direct), summarise(gateway), 1000 * gateway_cpu / tokens


def wait_healthy(gateway_url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the gateway exited early")
        try:
            if httpx.get(f"{gateway_url}/health", timeout=2).json().get("live_workers", 0) >= 1:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the gateway or the worker did not come up")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    parser.add_argument("--out", default="bench/out/gateway.json")
    args = parser.parse_args()
    jobs = workload(args.requests)
    load_at_start = [round(x, 2) for x in os.getloadavg()]

    redis_server = EmbeddedRedis.start()
    worker_args = ["--model", "tiny-random", "--device", args.device]
    worker_args += ["--threads", str(args.threads), "--max-batch", str(max(32, args.requests))]
    workers = LocalWorkers(redis_server.url, PREFIX, worker_args)
    port = free_port()
    gateway_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "import typer; from tokenfleet.gateway.command import gateway;"]
    cmd[-1] += " typer.run(gateway)"
    cmd += ["--redis-url", redis_server.url, "--prefix", PREFIX, "--port", str(port)]
    cmd += ["--log-level", "warning"]
    gateway_proc = subprocess.Popen(cmd)
    try:
        workers.start(1, name_prefix="bench-gw")
        wait_healthy(gateway_url, gateway_proc)
        direct, gateway, cpu_ms = asyncio.run(
            run(redis_server.url, gateway_url, gateway_proc.pid, jobs, args.rounds)
        )
    finally:
        gateway_proc.terminate()
        gateway_proc.wait(timeout=30)
        workers.drain()
        redis_server.stop()

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
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_start": load_at_start,
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
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
