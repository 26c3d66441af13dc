"""The gateway's view of the fleet (`tokenfleet.fleet.FleetView`: which models live
workers serve, how big a job each can hold), read from the workers' heartbeats and
cached for a moment: heartbeats only change about once a second. Read-only: the gateway
role may not prune stale worker names."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aredis

from tokenfleet.fleet import FleetCache, FleetView, read_workers_async
from tokenfleet.keys import Keys


class FleetReader:
    def __init__(self, client: aredis.Redis, keys: Keys, cache_s: float) -> None:
        self.client = client
        self.keys = keys
        self._cache = FleetCache(cache_s)
        self._reading: asyncio.Task[FleetView] | None = None

    async def read(self, *, fresh: bool = False) -> FleetView:
        cached = None if fresh else self._cache.get(time.monotonic())
        if cached is not None:
            return cached
        if fresh:
            return await self._read()
        # one read for every request that finds the cache stale at once (a burst of
        # thousands would otherwise queue thousands of reads for the connection pool)
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read())
        return await asyncio.shield(self._reading)

    async def _read(self) -> FleetView:
        now = time.monotonic()
        return self._cache.put(now, FleetView(await read_workers_async(self.client, self.keys)))
