"""Gateway test support: `create_app(config)` served by uvicorn in a background thread,
a module's fleet on the session's Redis (the `fleet_env` / `gateway_env` fixtures), the
workers' telemetry hashes, and batch input files."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import uvicorn

from tests.helpers.support import KEYS, wait_for
from tests.helpers.workers import Fleet
from tokenfleet.gateway import GatewayConfig, create_app
from tokenfleet.keys import Keys
from tokenfleet.local import RedisServer, free_port

# A long-running worker of a module's fleet: its name and its extra `tokenfleet worker`
# flags (on top of tests.helpers.workers.TEST_WORKER_ARGS).
WorkerSpec = tuple[str, Sequence[str]]
# The module's workers, or what makes them from the module's temp dir (a checkpoint
# folder a worker's --model points at, say).
Workers = Sequence[WorkerSpec] | Callable[[Path], Sequence[WorkerSpec]]
# What `fleet_env` and `gateway_env` return: a fixture function (its type is pytest's own).
FleetFixture = Callable[..., Iterator["FleetEnv"]]
GatewayFixture = Callable[..., Iterator["GatewayEnv"]]


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


def worker_info(r: redis.Redis, name: str, keys: Keys = KEYS) -> dict[str, Any]:
    """Worker `name`'s telemetry hash, decoded (like `Fleet.info`, but on any prefix and
    client)."""
    raw = r.hgetall(keys.worker(name))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def jsonl(lines: Sequence[dict[str, Any]]) -> bytes:
    """A batch input file: one JSON object a line."""
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


BATCH_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


def run_batch(
    client: openai.OpenAI, lines: Sequence[dict[str, Any]], timeout: float = 180
) -> tuple[Any, list[dict[str, Any]]]:
    """Upload `lines` as a batch input file, create a chat-completions batch of it and
    wait for it to end: the ended batch, and its output file's lines (none if it has
    no output file)."""
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    seen: list[Any] = []

    def ended() -> bool:
        seen.append(client.batches.retrieve(batch.id))
        return seen[-1].status in BATCH_ENDED

    wait_for(ended, timeout, f"batch {batch.id} to end")
    done = seen[-1]
    if not done.output_file_id:
        return done, []
    text = client.files.content(done.output_file_id).text
    return done, [json.loads(line) for line in text.splitlines()]


# ---- a module's fleet -------------------------------------------------------------------


@dataclass
class FleetEnv:
    """A module's fleet: the Redis at `url`, a client `r` of it, and the `Fleet` whose
    long-running workers are alive there."""

    url: str
    r: redis.Redis
    fleet: Fleet


@dataclass
class GatewayEnv(FleetEnv):
    """A module's fleet with a gateway in front of it."""

    gateway: ServedGateway


@contextlib.contextmanager
def running_fleet(
    url: str, tmp: Path, workers: Workers, join_timeout: float = 60
) -> Iterator[FleetEnv]:
    """`fleet_on` with `workers` started (not in burst mode) and alive."""
    specs = workers(tmp) if callable(workers) else workers
    with fleet_on(url, tmp) as (r, fleet):
        started = [fleet.start(name, *flags, burst=False) for name, flags in specs]
        for worker in started:
            fleet.wait_alive(worker, timeout=join_timeout)
        yield FleetEnv(url, r, fleet)


def fleet_env(workers: Workers, *, join_timeout: float = 60) -> FleetFixture:
    """A module-scoped fixture: `workers` alive on the session's Redis (flushed first),
    killed after the module. In a test module: `env = fleet_env([("w", ["--max-batch", "8"])])`.
    """

    @pytest.fixture(scope="module")
    def fixture(
        redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[FleetEnv]:
        tmp = tmp_path_factory.mktemp("fleet")
        with running_fleet(redis_server.url, tmp, workers, join_timeout) as env:
            yield env

    return fixture


def gateway_env(
    workers: Workers,
    *,
    join_timeout: float = 60,
    env_type: type[GatewayEnv] = GatewayEnv,
    **config: Any,
) -> GatewayFixture:
    """A module-scoped fixture: `fleet_env`'s workers with a gateway in front of them,
    `GatewayConfig(redis_url=..., fleet_cache_s=0.0, **config)` (no fleet cache: tests see
    a change at once). `env_type`: a GatewayEnv subclass with the module's own methods.
    In a test module: `env = gateway_env([("gw", [])], api_keys=("k=alpha",))`."""

    @pytest.fixture(scope="module")
    def fixture(
        redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[GatewayEnv]:
        tmp = tmp_path_factory.mktemp("gateway")
        with running_fleet(redis_server.url, tmp, workers, join_timeout) as fleet:
            gateway_config = GatewayConfig(redis_url=fleet.url, fleet_cache_s=0.0, **config)
            gateway = ServedGateway(gateway_config)
            try:
                yield env_type(fleet.url, fleet.r, fleet.fleet, gateway)
            finally:
                gateway.stop()

    return fixture
