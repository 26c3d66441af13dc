"""The fleet as Redis shows it: which workers are alive and what they said of themselves,
what they can hold, and how full each jobs stream (one per model and priority band) is.
One owner for that view: the producers, the gateway, `tokenfleet status`, the demo and
the workers all read it here.

A worker is alive while its heartbeat hash `keys.worker(name)` exists (WORKER_TTL_S);
its name is in the sorted set `keys.workers()`, scored with the unix time of its last
heartbeat. Every hash value is JSON (`WorkerQueue.heartbeat` writes them): the worker's
identity (`model`, `checkpoint`, `pid`, `started_at`, ...), its `status`, its `budget`
and the engine's telemetry snapshot (`active`, `waiting`, `kv_used_bytes`,
`max_job_tokens`, ...). `decode_worker` is the only code that reads one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import redis
import redis.asyncio as aredis

from tokenfleet.keys import BANDS, DEFAULT_MODEL, GROUP, Keys
from tokenfleet.redis_errors import is_missing_group


def text(value: Any) -> str:
    """A Redis reply (bytes or str) as text; undecodable bytes are replaced, not raised."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes | bytearray) else str(value)


# ---- one worker -------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    """One live worker, as its heartbeat hash says. The typed fields are the ones the
    fleet acts on; `fields` holds every field decoded (identity, budget, telemetry), as
    `tokenfleet status --json` prints them. A value that is not what a worker writes is
    left out of its typed field (None) and named in `problems`."""

    name: str
    model: str  # the model name whose jobs stream it serves (DEFAULT_MODEL when unset)
    status: str | None  # "running" | "draining"
    checkpoint: str | None
    pid: int | None
    started_at: float | None  # unix time the worker started
    max_job_tokens: int | None  # the largest prompt + max_new_tokens it could ever hold
    last_seen: float | None  # unix time of its last heartbeat (its score in keys.workers())
    fields: dict[str, Any]
    problems: tuple[str, ...] = ()


def decode_worker(name: str, raw: Any, last_seen: float | None = None) -> WorkerInfo:
    """A worker from its HGETALL reply: a {field: JSON value} mapping (bytes or str), or
    the error Redis answered in its place (the key is not a hash). Never raises: what
    cannot be read is named in `problems`; a value that is not JSON reads back as text."""
    problems: list[str] = []
    if isinstance(raw, Exception):
        problems.append(f"its hash cannot be read: {raw}")
        raw = {}
    fields: dict[str, Any] = {}
    for key, value in raw.items():
        field = text(key)
        try:
            fields[field] = json.loads(value)
        except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
            fields[field] = text(value)
            problems.append(f"{field}: not JSON")

    def typed(field: str, kind: type | tuple[type, ...], what: str) -> Any:
        value = fields.get(field)
        if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
            return value
        problems.append(f"{field}: expected {what}, got {value!r}")
        return None

    model = fields.get("model")
    started_at = typed("started_at", (int, float), "a unix time")
    return WorkerInfo(
        name=name,
        model=DEFAULT_MODEL if model in (None, "") else str(model),
        status=typed("status", str, "a string"),
        checkpoint=typed("checkpoint", str, "a string") or None,
        pid=typed("pid", int, "an integer"),
        started_at=None if started_at is None else float(started_at),
        max_job_tokens=typed("max_job_tokens", int, "an integer"),
        last_seen=last_seen,
        fields=fields,
        problems=tuple(problems),
    )


# ---- reading the live workers -----------------------------------------------------------


def _queue_hashes(pipe: Any, keys: Keys, seen: list[tuple[Any, float]]) -> Any:
    for name, _score in seen:
        pipe.hgetall(keys.worker(text(name)))
    return pipe


def _decode_all(
    seen: list[tuple[Any, float]], hashes: list[Any]
) -> tuple[dict[str, WorkerInfo], list[str]]:
    """(live workers by name, names whose hash is gone) from ZRANGE WITHSCORES of the
    workers set and each name's HGETALL reply."""
    live: dict[str, WorkerInfo] = {}
    stale: list[str] = []
    for (raw_name, score), raw in zip(seen, hashes, strict=True):
        name = text(raw_name)
        if raw:
            live[name] = decode_worker(name, raw, float(score))
        else:
            stale.append(name)
    return live, stale


def read_workers(client: redis.Redis, keys: Keys) -> dict[str, WorkerInfo]:
    """Every worker whose heartbeat hash still exists, by name. Names whose hash expired
    are removed from the workers set (ZREM, which the producer and worker roles may)."""
    seen = client.zrange(keys.workers(), 0, -1, withscores=True)
    if not seen:
        return {}
    pipe = client.pipeline(transaction=False)
    live, stale = _decode_all(seen, _queue_hashes(pipe, keys, seen).execute(raise_on_error=False))
    if stale:
        client.zrem(keys.workers(), *stale)
    return live


async def read_workers_async(client: aredis.Redis, keys: Keys) -> dict[str, WorkerInfo]:
    """`read_workers` on asyncio, read-only (the gateway role may not ZREM): stale names
    are skipped and left for a sync reader or a worker to prune."""
    seen = await client.zrange(keys.workers(), 0, -1, withscores=True)
    if not seen:
        return {}
    pipe = client.pipeline(transaction=False)
    hashes = await _queue_hashes(pipe, keys, seen).execute(raise_on_error=False)
    return _decode_all(seen, hashes)[0]


def live_workers(client: redis.Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    """Each live worker's decoded heartbeat hash, by name (JSON-safe); prunes as
    `read_workers` does."""
    return {name: info.fields for name, info in read_workers(client, keys).items()}


# ---- what the fleet serves ------------------------------------------------------------


def max_job_tokens(workers: Iterable[WorkerInfo]) -> int | None:
    """The largest prompt + max_new_tokens any of `workers` could hold; None when none
    says (then jobs queue as usual)."""
    sizes = [w.max_job_tokens for w in workers if w.max_job_tokens is not None]
    return max(sizes) if sizes else None


@dataclass(frozen=True)
class ServedModel:
    """One model name and the live workers that serve its jobs stream."""

    name: str
    workers: tuple[WorkerInfo, ...]

    @property
    def max_job_tokens(self) -> int | None:
        return max_job_tokens(self.workers)

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's own sampling defaults, as its workers advertise them (the first
        worker that names any; every worker of one model loads the same files)."""
        for w in self.workers:
            value = w.fields.get("sampling_defaults")
            if isinstance(value, dict) and value:
                return value
        return {}

    @property
    def tool_format(self) -> str | None:
        """How the model writes tool calls (tokenfleet.tools.ToolFormat), as its workers
        advertise it; None when none says."""
        for w in self.workers:
            value = w.fields.get("tool_format")
            if isinstance(value, str) and value:
                return value
        return None

    @property
    def checkpoints(self) -> list[str]:
        return sorted({w.checkpoint for w in self.workers if w.checkpoint})

    @property
    def created(self) -> int:
        """When its first worker started (unix seconds); now when none says."""
        started = [w.started_at for w in self.workers if w.started_at is not None]
        return int(min(started)) if started else int(time.time())


@dataclass(frozen=True)
class FleetView:
    workers: Mapping[str, WorkerInfo]  # the live workers, by name

    @property
    def models(self) -> dict[str, ServedModel]:
        by_model: dict[str, list[WorkerInfo]] = {}
        for info in self.workers.values():
            by_model.setdefault(info.model, []).append(info)
        return {name: ServedModel(name, tuple(ws)) for name, ws in sorted(by_model.items())}

    def capacity(self, model: str | None) -> int | None:
        """The largest job a live worker serving `model` could hold (None: no live worker
        serving it says)."""
        name = model or DEFAULT_MODEL
        return max_job_tokens(w for w in self.workers.values() if w.model == name)


@dataclass
class FleetCache:
    """The last `FleetView` read, trusted for `ttl_s` seconds (monotonic clock):
    heartbeats change about once a second, so a read a moment old is as good as fresh."""

    ttl_s: float
    read_at: float = 0.0
    view: FleetView | None = None

    def get(self, now: float) -> FleetView | None:
        """The cached view, or None when there is none or it is older than `ttl_s`."""
        fresh = self.view is not None and now - self.read_at < self.ttl_s
        return self.view if fresh else None

    def put(self, now: float, view: FleetView) -> FleetView:
        self.read_at, self.view = now, view
        return view


# ---- the jobs streams -------------------------------------------------------------------


class QueueStats(TypedDict):
    depth: int  # XLEN: accepted, unfinished
    lag: int | None  # entries never read by the group (None: Redis could not say)
    pending: int  # read, unfinished
    consumers: int


def queue_band(pipe: Any, stream: str) -> None:
    """Queue one stream's XLEN and XINFO GROUPS on `pipe` (a sync or an asyncio
    pipeline, executed with raise_on_error=False); `decode_band` reads the two replies."""
    pipe.xlen(stream)
    pipe.xinfo_groups(stream)


def decode_band(depth: Any, groups: Any) -> QueueStats:
    """One stream's stats from its XLEN and XINFO GROUPS replies (or the errors Redis
    answered in their place): a stream or group that does not exist yet is empty."""
    if isinstance(depth, Exception):
        raise depth
    stats = QueueStats(depth=int(depth), lag=None, pending=0, consumers=0)
    if is_missing_group(groups):
        return stats
    if isinstance(groups, Exception):
        raise groups
    for group in groups:
        if text(group["name"]) == GROUP:
            lag = group.get("lag")
            stats["lag"] = None if lag is None else int(lag)
            stats["pending"] = int(group["pending"])
            stats["consumers"] = int(group["consumers"])
    return stats


def waiting_jobs(stats: QueueStats) -> int:
    """Jobs of the band no worker has pulled yet: depth − pending. Exact, because workers
    delete an entry when they finish it; never `lag`, which XINFO GROUPS reports as NULL
    after some of the workers' deletes (tests/test_keda_signals.py). Pending may briefly
    count an entry whose data was deleted, hence the floor at 0."""
    return max(0, stats["depth"] - stats["pending"])


def band_stats(
    client: redis.Redis,
    keys: Keys,
    models: Iterable[str],
    bands: Iterable[str] = BANDS,
) -> dict[str, dict[str, QueueStats]]:
    """How full each of `bands` (all of them, highest first, unless told) of every
    model's jobs streams is, from XLEN and XINFO GROUPS, in one round trip: model ->
    band -> stats, in the order asked, summed over the queue's partitions. A stream that
    does not exist yet is empty."""
    plan = [(m, b, p) for m in models for b in bands for p in keys.partitions_all]
    pipe = client.pipeline(transaction=False)
    for model, band, part in plan:
        queue_band(pipe, keys.jobs(model, band, part))
    replies = pipe.execute(raise_on_error=False)
    out: dict[str, dict[str, QueueStats]] = {}
    for i, (model, band, _) in enumerate(plan):
        stats = decode_band(replies[2 * i], replies[2 * i + 1])
        known = out.setdefault(model, {}).get(band)
        out[model][band] = stats if known is None else added(known, stats)
    return out


def added(a: QueueStats, b: QueueStats) -> QueueStats:
    """Two partitions' stats of one band as one: counts add, `lag` is None if either's is."""
    lag = None if a["lag"] is None or b["lag"] is None else a["lag"] + b["lag"]
    return QueueStats(
        depth=a["depth"] + b["depth"],
        lag=lag,
        pending=a["pending"] + b["pending"],
        consumers=max(a["consumers"], b["consumers"]),
    )


class FleetReader:
    """The gateway's view of the fleet, read from the heartbeats and cached for a moment
    (they change about once a second). Read-only: the gateway role may not prune stale
    worker names."""

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
