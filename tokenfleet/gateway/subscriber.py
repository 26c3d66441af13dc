"""Every live stream of one gateway over a few pub/sub connections.

A request does not open a pub/sub connection of its own (redis-py's default pool
ran out at about 60 concurrent streams). `Subscriber` owns `shards` dedicated
connections; a job's channel (`keys.channel(id)`) lives on shard
``crc32(channel) % shards``. Each shard has one reader task that dispatches every
message by channel to the sink registered with `watch` (a request's
`asyncio.Queue.put_nowait`), and batches the SUBSCRIBE/UNSUBSCRIBE of a burst of
requests into one command each.

Gaps are the watcher's to fill from the job's replay stream: the shard hands a
watcher `RESYNC` whenever Redis confirms its channel's subscription, which is
once after `watch` (events published before that are only in the replay stream)
and again after every reconnect. A shard that loses its connection (Redis
restarted, the network cut, the server dropped it for a full output buffer)
reconnects with backoff, re-subscribes every live channel, and so every live
watcher replays what it missed: no stream sees an error for an outage it
outlives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import zlib
from collections.abc import Callable
from typing import Any

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import RedisError

from tokenfleet.backoff import Backoff


class Resync:
    """Handed to a watcher: your channel is (re)subscribed now, re-read the replay stream."""

    def __repr__(self) -> str:
        return "RESYNC"


RESYNC = Resync()
Sink = Callable[[bytes | Resync], None]
log = logging.getLogger(__name__)

PUBSUB_CLIENT_NAME = "tokenfleet-gateway-pubsub"  # as CLIENT LIST shows the shards
SUBSCRIBE_BATCH = 1000  # channels per SUBSCRIBE / UNSUBSCRIBE command
PING_S = 5.0  # a PING on each shard this often; a shard silent for 3 of these reconnects
RECONNECT_FIRST_S = 0.05  # a shard's first pause after losing Redis; it doubles per failure
RECONNECT_MAX_S = 2.0  # ... up to this (jittered: shards and gateways don't return at once)


class _Shard:
    def __init__(self, index: int, connect: Callable[[], AbstractConnection]) -> None:
        self.index = index
        self._connect = connect
        self.sinks: dict[bytes, Sink] = {}
        self.conn: AbstractConnection | None = None  # set while connected
        self.connects = 0
        self._subs: set[bytes] = set()  # to SUBSCRIBE with the next flush
        self._unsubs: set[bytes] = set()
        self._flusher: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self._last_read = time.monotonic()

    # ---- what requests call (no await: a burst of them is flushed as one command) ----

    def watch(self, channel: bytes, sink: Sink) -> None:
        self.sinks[channel] = sink
        self._unsubs.discard(channel)
        self._subs.add(channel)
        self._schedule()

    def unwatch(self, channel: bytes, sink: Sink) -> None:
        if self.sinks.get(channel) is not sink:
            return
        del self.sinks[channel]
        if channel in self._subs:
            self._subs.discard(channel)  # never sent
        else:
            self._unsubs.add(channel)
        self._schedule()

    def _schedule(self) -> None:
        if self.conn is not None and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the rest of this burst register first
        while self.conn is not None and (self._subs or self._unsubs):
            unsubs, self._unsubs = list(self._unsubs), set()
            subs, self._subs = list(self._subs), set()
            try:
                for i in range(0, len(unsubs), SUBSCRIBE_BATCH):
                    await self._send("UNSUBSCRIBE", *unsubs[i : i + SUBSCRIBE_BATCH])
                for i in range(0, len(subs), SUBSCRIBE_BATCH):
                    await self._send("SUBSCRIBE", *subs[i : i + SUBSCRIBE_BATCH])
            except (RedisError, OSError) as exc:
                # the reader sees the broken connection too and reconnects, which
                # subscribes every channel still watched
                log.warning("pub/sub shard %d: sending failed: %s", self.index, exc)
                await self._drop()
                return

    async def _send(self, *args: Any) -> None:
        conn = self.conn
        if conn is None:
            return
        async with self._send_lock:
            await conn.send_command(*args, check_health=False)

    async def _drop(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)

    # ---- the shard's own tasks ----------------------------------------------------

    async def run(self) -> None:
        """Connect, subscribe every watched channel, read; on any failure, again."""
        backoff = Backoff(RECONNECT_FIRST_S, RECONNECT_MAX_S)  # never gives up
        while True:
            conn = self._connect()
            try:
                await conn.connect()
                self.conn = conn
                self.connects += 1
                self._last_read = time.monotonic()
                if self.connects > 1:
                    log.warning(
                        "pub/sub shard %d reconnected: re-subscribing %d channel(s)",
                        self.index,
                        len(self.sinks),
                    )
                backoff.succeeded()
                self._unsubs.clear()
                self._subs = set(self.sinks)
                self._schedule()
                await self._read(conn)
            except Exception as exc:  # RedisError, OSError, or a parser torn down under it
                log.warning("pub/sub shard %d lost Redis: %s", self.index, exc)
            finally:
                if self.conn is conn:
                    await self._drop()
                else:
                    with contextlib.suppress(Exception):
                        await conn.disconnect(nowait=True)
            await asyncio.sleep(backoff.failed(time.monotonic()))

    async def _read(self, conn: AbstractConnection) -> None:
        sinks = self.sinks
        while True:
            # push_request: a RESP3 push frame (every message) is returned, not handled
            reply = await conn.read_response(
                timeout=math.inf, disconnect_on_error=True, push_request=True
            )
            self._last_read = time.monotonic()
            if not isinstance(reply, list) or len(reply) < 2:
                continue  # PONG
            kind = reply[0]
            if kind == b"message":
                sink = sinks.get(reply[1])
                if sink is not None:
                    sink(reply[2])
            elif kind == b"subscribe":
                sink = sinks.get(reply[1])
                if sink is not None:
                    sink(RESYNC)
            # "unsubscribe" and "pong" need nothing

    async def ping(self) -> None:
        """PING now and then: a shard whose connection went silent reconnects."""
        while True:
            await asyncio.sleep(PING_S)
            conn = self.conn
            if conn is None:
                continue
            if time.monotonic() - self._last_read > 3 * PING_S:
                log.warning("pub/sub shard %d: no reply to PING, reconnecting", self.index)
                await self._drop()
                continue
            try:
                await self._send("PING")
            except (RedisError, OSError):
                await self._drop()


class Subscriber:
    """`shards` pub/sub connections shared by every stream of a gateway (see the module)."""

    def __init__(self, pool: ConnectionPool, shards: int = 2) -> None:
        if shards < 1:
            raise ValueError("shards must be ≥ 1")
        kwargs = {
            **pool.connection_kwargs,
            "health_check_interval": 0,  # its PINGs would read replies meant for the reader
            "socket_timeout": None,  # the reader blocks until a message comes
            "client_name": PUBSUB_CLIENT_NAME,
        }
        connection_class = pool.connection_class

        def connect() -> AbstractConnection:
            conn: AbstractConnection = connection_class(**kwargs)
            return conn

        self._shards = [_Shard(i, connect) for i in range(shards)]
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for shard in self._shards:
            self._tasks.append(asyncio.create_task(shard.run()))
            self._tasks.append(asyncio.create_task(shard.ping()))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for shard in self._shards:
            await shard._drop()

    def _shard(self, channel: bytes) -> _Shard:
        return self._shards[zlib.crc32(channel) % len(self._shards)]

    def watch(self, channel: str, sink: Sink) -> None:
        """Deliver `channel`'s messages to `sink`, and `RESYNC` once it is subscribed."""
        key = channel.encode()
        self._shard(key).watch(key, sink)

    def unwatch(self, channel: str, sink: Sink) -> None:
        key = channel.encode()
        self._shard(key).unwatch(key, sink)

    def is_up(self, channel: str) -> bool:
        """Whether the shard of `channel` holds a live connection now."""
        return self._shard(channel.encode()).conn is not None

    @property
    def shards(self) -> int:
        return len(self._shards)

    @property
    def connected(self) -> int:
        """How many shards hold a live connection now."""
        return sum(shard.conn is not None for shard in self._shards)

    @property
    def watched(self) -> int:
        """Channels watched now (= live streams)."""
        return sum(len(shard.sinks) for shard in self._shards)

    @property
    def reconnects(self) -> int:
        return sum(max(0, shard.connects - 1) for shard in self._shards)
