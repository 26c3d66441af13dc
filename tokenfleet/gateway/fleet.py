"""The gateway's view of the fleet: which models live workers serve, and how big a job
each can hold. Read from the workers' heartbeat hashes (`keys.worker`, JSON values,
see `WorkerQueue.heartbeat`), cached for a moment: heartbeats only change about once
a second. Read-only: pruning stale names is left to `recovery.live_workers`."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis

from tokenfleet.keys import DEFAULT_MODEL, Keys


@dataclass(frozen=True)
class ServedModel:
    """One model name and the live workers that serve its jobs stream."""

    name: str
    workers: tuple[dict[str, Any], ...]

    @property
    def max_job_tokens(self) -> int | None:
        """The largest prompt + max_new_tokens any of its workers could ever hold."""
        sizes = [
            w["max_job_tokens"] for w in self.workers if isinstance(w.get("max_job_tokens"), int)
        ]
        return max(sizes) if sizes else None

    @property
    def checkpoints(self) -> list[str]:
        return sorted({str(w["checkpoint"]) for w in self.workers if w.get("checkpoint")})

    @property
    def created(self) -> int:
        started = [
            w["started_at"] for w in self.workers if isinstance(w.get("started_at"), float | int)
        ]
        return int(min(started)) if started else int(time.time())


@dataclass(frozen=True)
class FleetView:
    workers: dict[str, dict[str, Any]]  # worker name → its decoded heartbeat hash

    @property
    def models(self) -> dict[str, ServedModel]:
        by_model: dict[str, list[dict[str, Any]]] = {}
        for info in self.workers.values():
            by_model.setdefault(str(info.get("model") or DEFAULT_MODEL), []).append(info)
        return {name: ServedModel(name, tuple(ws)) for name, ws in sorted(by_model.items())}


def _decode(value: bytes) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value.decode("utf-8", "replace")


class FleetReader:
    def __init__(self, client: aredis.Redis, keys: Keys, cache_s: float) -> None:
        self.client = client
        self.keys = keys
        self.cache_s = cache_s
        self._cached: tuple[float, FleetView] | None = None
        self._reading: asyncio.Task[FleetView] | None = None

    async def read(self, *, fresh: bool = False) -> FleetView:
        now = time.monotonic()
        if not fresh and self._cached is not None and now - self._cached[0] < self.cache_s:
            return self._cached[1]
        if fresh:
            return await self._read()
        # one read for every request that finds the cache stale at once (a burst of
        # thousands would otherwise queue thousands of reads for the connection pool)
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read())
        return await asyncio.shield(self._reading)

    async def _read(self) -> FleetView:
        now = time.monotonic()
        names = [n.decode() for n in await self.client.zrange(self.keys.workers(), 0, -1)]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.worker(name))
        hashes = await pipe.execute() if names else []
        workers = {
            name: {k.decode(): _decode(v) for k, v in raw.items()}
            for name, raw in zip(names, hashes, strict=True)
            if raw
        }
        view = FleetView(workers)
        self._cached = (now, view)
        return view
