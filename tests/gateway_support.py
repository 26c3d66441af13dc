"""Gateway test support: `create_app(config)` served by uvicorn in a background thread,
a module's fleet on the session's Redis, and the workers' telemetry hashes."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import redis
import uvicorn
from fleet import Fleet
from support import free_port, wait_for

from tokenfleet.gateway import GatewayConfig, create_app
from tokenfleet.keys import Keys


class ServedGateway:
    """`create_app(config)` served by uvicorn in a background thread on a free port."""

    def __init__(self, config: GatewayConfig) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(config),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=5,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 20, "the gateway to start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


@contextlib.contextmanager
def fleet_on(url: str, tmp: Path) -> Iterator[tuple[redis.Redis, Fleet]]:
    """A client of the Redis at `url` (flushed first) and a `Fleet` on it; every worker
    the caller starts is killed, and the client closed, on the way out."""
    r = redis.Redis.from_url(url)
    r.flushall()
    fleet = Fleet(url, tmp)
    try:
        yield r, fleet
    finally:
        fleet.stop_all()
        r.close()


def worker_info(r: redis.Redis, name: str, keys: Keys | None = None) -> dict[str, Any]:
    """Worker `name`'s telemetry hash, decoded (like `Fleet.info`, but on any prefix and
    client)."""
    raw = r.hgetall((keys or Keys()).worker(name))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


@dataclass
class GatewayEnv:
    r: redis.Redis
    gateway: ServedGateway
    fleet: Fleet


@contextlib.contextmanager
def gateway_fleet(
    url: str, tmp: Path, workers: Sequence[tuple[str, Sequence[str]]], timeout: float = 60
) -> Iterator[GatewayEnv]:
    """`fleet_on` with the given long-running workers (name, extra flags) started and
    alive, and a gateway in front of them (no fleet cache, so tests see changes at once)."""
    with fleet_on(url, tmp) as (r, fleet):
        started = [fleet.start(name, *args, burst=False) for name, args in workers]
        for worker in started:
            fleet.wait_alive(worker, timeout=timeout)
        gateway = ServedGateway(GatewayConfig(redis_url=url, fleet_cache_s=0.0))
        try:
            yield GatewayEnv(r, gateway, fleet)
        finally:
            gateway.stop()
