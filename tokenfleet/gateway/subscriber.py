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

On a Redis Cluster job channels are shard channels (`Keys.sharded`: SPUBLISH, served by
the primary of the channel's slot, not broadcast to every node), so `ClusterSubscriber`
keeps one such connection per primary that serves a watched channel, and SSUBSCRIBEs a
burst one slot at a time (a cluster refuses channels of several slots in one command).
When a primary's connection fails, or Redis unsubscribes a channel itself (its slot
moved: a failover, a resharding), the slot map is read again and the channels whose
slot another node serves now move there, each watcher resyncing as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

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


class SlotMoved(Exception):
    """Redis unsubscribed a shard channel that is still watched: its slot moved."""


class _Shard:
    def __init__(
        self,
        index: int,
        connect: Callable[[], AbstractConnection],
        *,
        sharded: bool = False,
        lost: Callable[[_Shard], Awaitable[None]] | None = None,
    ) -> None:
        self.index = index
        self._connect = connect
        # shard channels (a cluster): SSUBSCRIBE, one slot per command
        self.sharded = sharded
        self._verbs = ("SSUBSCRIBE", "SUNSUBSCRIBE") if sharded else ("SUBSCRIBE", "UNSUBSCRIBE")
        self._lost = lost  # after a failure: the cluster's subscriber re-homes channels
        self.retired = False  # no channel left on a node that failed: the tasks end
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

    def forget(self, channel: bytes) -> Sink | None:
        """Drop a channel without unsubscribing (its connection is gone: it moves)."""
        self._subs.discard(channel)
        self._unsubs.discard(channel)
        return self.sinks.pop(channel, None)

    def _schedule(self) -> None:
        if self.conn is not None and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the rest of this burst register first
        while self.conn is not None and (self._subs or self._unsubs):
            unsubs, self._unsubs = list(self._unsubs), set()
            subs, self._subs = list(self._subs), set()
            subscribe, unsubscribe = self._verbs
            try:
                for group in self._batches(unsubs):
                    await self._send(unsubscribe, *group)
                for group in self._batches(subs):
                    await self._send(subscribe, *group)
            except (RedisError, OSError) as exc:
                # the reader sees the broken connection too and reconnects, which
                # subscribes every channel still watched
                log.warning("pub/sub shard %d: sending failed: %s", self.index, exc)
                await self._drop()
                return

    def _batches(self, channels: list[bytes]) -> list[list[bytes]]:
        """Channels in commands of SUBSCRIBE_BATCH at most (shard channels: one slot each)."""
        groups: dict[int, list[bytes]] = {}
        for channel in channels:
            groups.setdefault(key_slot(channel) if self.sharded else 0, []).append(channel)
        return [
            group[i : i + SUBSCRIBE_BATCH]
            for group in groups.values()
            for i in range(0, len(group), SUBSCRIBE_BATCH)
        ]

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
        while not self.retired:
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
            if self._lost is not None:
                await self._lost(self)  # channels whose slot moved go to their new node
            if self.retired:
                return
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
            if kind in (b"message", b"smessage"):
                sink = sinks.get(reply[1])
                if sink is not None:
                    sink(reply[2])
            elif kind in (b"subscribe", b"ssubscribe"):
                sink = sinks.get(reply[1])
                if sink is not None:
                    sink(RESYNC)
            elif kind == b"sunsubscribe" and reply[1] in sinks and reply[1] not in self._subs:
                raise SlotMoved(f"redis unsubscribed {reply[1]!r}: its slot moved")
            # "unsubscribe" and "pong" need nothing

    async def ping(self) -> None:
        """PING now and then: a shard whose connection went silent reconnects."""
        while not self.retired:
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


async def _close(tasks: list[asyncio.Task[None]], shards: list[_Shard]) -> None:
    """Stop a subscriber: its shards' tasks, then their connections."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    tasks.clear()
    for shard in shards:
        await shard._drop()


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
        await _close(self._tasks, self._shards)

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


class ClusterSubscriber:
    """`Subscriber` for a fleet on a Redis Cluster (see the module): one shard
    connection per primary serving a watched shard channel, made when first needed."""

    def __init__(self, client: AsyncRedisCluster, pool: ConnectionPool) -> None:
        self._client = client
        self._kwargs = {
            **pool.connection_kwargs,
            "health_check_interval": 0,
            "socket_timeout": None,
            "client_name": PUBSUB_CLIENT_NAME,
        }
        self._connection_class = pool.connection_class
        self._shards: dict[str, _Shard] = {}  # node name -> its shard
        self._home: dict[bytes, str] = {}  # channel -> the node name it is watched on
        self._early: dict[bytes, Sink] = {}  # watched before the slot map was read
        self._ready = False
        self._tasks: list[asyncio.Task[None]] = []
        self._retired_connects = 0

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._read_slot_map()))

    async def _read_slot_map(self) -> None:
        backoff = Backoff(RECONNECT_FIRST_S, RECONNECT_MAX_S)
        while True:
            try:
                await self._client.initialize()  # redis-py#4296: before sharded pub/sub
                break
            except (RedisError, RedisClusterException) as exc:
                log.warning("pub/sub: reading the cluster's slot map failed: %s", exc)
                await asyncio.sleep(backoff.failed(time.monotonic()))
        self._ready = True
        early, self._early = self._early, {}
        for channel, sink in early.items():
            self._place(channel, sink)

    async def aclose(self) -> None:
        await _close(self._tasks, list(self._shards.values()))

    def _node_of(self, channel: bytes) -> Any:
        return self._client.nodes_manager.get_node_from_slot(key_slot(channel))

    def _shard_at(self, node: Any) -> _Shard:
        shard = self._shards.get(node.name)
        if shard is None:
            kwargs = {**self._kwargs, "host": node.host, "port": node.port}

            def connect() -> AbstractConnection:
                conn: AbstractConnection = self._connection_class(**kwargs)
                return conn

            shard = _Shard(len(self._shards), connect, sharded=True, lost=self._lost)
            self._shards[node.name] = shard
            self._tasks.append(asyncio.create_task(shard.run()))
            self._tasks.append(asyncio.create_task(shard.ping()))
        return shard

    def _place(self, channel: bytes, sink: Sink) -> None:
        node = self._node_of(channel)
        self._home[channel] = node.name
        self._shard_at(node).watch(channel, sink)

    async def _lost(self, shard: _Shard) -> None:
        """A shard's connection failed: read the slot map again and move the channels
        another node serves now (each resyncs once subscribed there). A shard left
        with no channel ends."""
        try:
            await self._client.nodes_manager.initialize()
        except (RedisError, RedisClusterException) as exc:
            log.warning("pub/sub: re-reading the cluster's slot map failed: %s", exc)
            return  # the shard retries, and so does this at its next failure
        name = next((n for n, s in self._shards.items() if s is shard), None)
        for channel in list(shard.sinks):
            node = self._node_of(channel)
            if node.name != name:
                sink = shard.forget(channel)
                if sink is not None:
                    self._home[channel] = node.name
                    self._shard_at(node).watch(channel, sink)
        if not shard.sinks and name is not None:
            shard.retired = True
            self._retired_connects += max(0, shard.connects - 1)
            del self._shards[name]

    def watch(self, channel: str, sink: Sink) -> None:
        key = channel.encode()
        if not self._ready:
            self._early[key] = sink
        else:
            self._place(key, sink)

    def unwatch(self, channel: str, sink: Sink) -> None:
        key = channel.encode()
        if self._early.get(key) is sink:
            del self._early[key]
            return
        shard = self._shards.get(self._home.get(key, ""))
        if shard is not None and shard.sinks.get(key) is sink:
            shard.unwatch(key, sink)
            del self._home[key]

    def is_up(self, channel: str) -> bool:
        shard = self._shards.get(self._home.get(channel.encode(), ""))
        return shard is not None and shard.conn is not None

    @property
    def shards(self) -> int:
        return len(self._shards)

    @property
    def connected(self) -> int:
        return sum(shard.conn is not None for shard in self._shards.values())

    @property
    def watched(self) -> int:
        return len(self._early) + sum(len(shard.sinks) for shard in self._shards.values())

    @property
    def reconnects(self) -> int:
        live = sum(max(0, shard.connects - 1) for shard in self._shards.values())
        return self._retired_connects + live


LiveChannels: TypeAlias = "Subscriber | ClusterSubscriber"  # what a gateway streams from


def subscriber_for(client: Any, pool: ConnectionPool, shards: int) -> LiveChannels:
    """A gateway's subscriber: shard channels by node on a cluster, else `shards`
    connections to the one server."""
    if isinstance(client, AsyncRedisCluster):
        return ClusterSubscriber(client, pool)
    return Subscriber(pool, shards=shards)
