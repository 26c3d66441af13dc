"""What a worker is handed (`Delivery`), finding dead workers and taking over their jobs.

A worker is alive while its heartbeat hash (`keys.worker(name)`, WORKER_TTL_S)
exists. `claim_orphan_entries` moves pending jobs-stream entries away from
consumers whose hash is gone, in one script (claim_orphans.lua) that checks the
heartbeat and claims together, so a live worker's entries are never taken.
`WorkerQueue.claim_orphans` wraps it. `live_workers` and `queue_stats` are the
fleet view (for `tokenfleet status` and the workers' own telemetry).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
from redis.exceptions import ResponseError

from tokenfleet.keys import GROUP, Keys, valid_job_id


def lua(name: str) -> str:
    """The text of a script in tokenfleet/lua/."""
    return resources.files("tokenfleet").joinpath(f"lua/{name}").read_text()


CLAIM_ORPHANS_LUA = lua("claim_orphans.lua")


def text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes | bytearray) else str(value)


def is_missing_group(exc: ResponseError) -> bool:
    """The stream or its consumer group does not exist (e.g. Redis restarted empty)."""
    message = str(exc)
    return message.startswith("NOGROUP") or message.startswith("no such key")


@dataclass(frozen=True)
class Delivery:
    """One jobs-stream entry handed to this worker.

    `job_id` is the entry's `job_id` field when it is present and a valid job id,
    else None (the client cannot be told). `payload` is None when the entry has
    no `payload` field or its data was deleted. `deliveries` counts how often the
    group handed it out (1 for a fresh read; each claim adds one). `lost` marks an
    entry whose data was deleted while pending: `claim_orphans` already took it off
    the pending list, so only `dead_letter` applies to it.
    """

    entry_id: str
    job_id: str | None
    payload: bytes | None
    deliveries: int = 1
    lost: bool = False


def delivery(entry_id: Any, fields: dict[Any, Any] | None, deliveries: int) -> Delivery:
    """A `Delivery` from a stream entry's id and fields (bytes or str keys; None = deleted)."""
    fields = {text(k): v for k, v in (fields or {}).items()}
    payload = fields.get("payload")
    raw_id = fields.get("job_id")
    job_id: str | None = None
    if isinstance(raw_id, bytes | str):
        try:
            candidate = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
        except UnicodeDecodeError:
            candidate = ""
        job_id = candidate if valid_job_id(candidate) else None
    if isinstance(payload, str):
        payload = payload.encode()
    return Delivery(
        text(entry_id), job_id, payload if isinstance(payload, bytes) else None, deliveries
    )


def claim_orphan_entries(
    client: redis.Redis,
    script: Any,
    keys: Keys,
    stream: str,
    worker: str,
    max_count: int,
    min_idle_ms: int,
) -> list[Delivery]:
    """Claim up to `max_count` entries idle ≥ `min_idle_ms` from dead consumers of `stream`.

    `script` is CLAIM_ORPHANS_LUA registered on `client`. Raises ResponseError
    (NOGROUP / no such key) when the stream or group is missing."""
    if max_count <= 0:
        return []
    consumers = [text(c["name"]) for c in client.xinfo_consumers(stream, GROUP)]
    others = [name for name in consumers if name != worker]
    if not others:
        return []
    reply = script(
        keys=[stream, *(keys.worker(name) for name in others)],
        args=[GROUP, worker, min_idle_ms, max_count, *others],
    )
    claimed = []
    for entry_id, deliveries, flat in reply:
        if flat:  # [f1, v1, f2, v2, ...]
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            claimed.append(delivery(entry_id, fields, int(deliveries)))
        else:  # its data was deleted: the script took it off the pending list
            claimed.append(Delivery(text(entry_id), None, None, int(deliveries), lost=True))
    return claimed


def live_workers(client: redis.Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    """Workers whose heartbeat hash still exists → their decoded hash.

    Names whose hash expired are removed from the workers set. Values are JSON
    (see `WorkerQueue.heartbeat`); a value that is not JSON reads back as text."""
    names = [text(name) for name in client.zrange(keys.workers(), 0, -1)]
    if not names:
        return {}
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.worker(name))
    live: dict[str, dict[str, Any]] = {}
    stale: list[str] = []
    for name, raw in zip(names, pipe.execute(), strict=True):
        if raw:
            live[name] = {text(field): _json_or_text(value) for field, value in raw.items()}
        else:
            stale.append(name)
    if stale:
        client.zrem(keys.workers(), *stale)
    return live


def _json_or_text(value: Any) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return text(value)


def queue_stats(client: redis.Redis, keys: Keys, model: str | None = None) -> dict[str, int | None]:
    """depth (XLEN: accepted, unfinished), lag (never read; may be None), pending (read,
    unfinished) and consumers, from XINFO GROUPS of the model's jobs stream."""
    stream = keys.jobs(model)
    stats: dict[str, int | None] = {
        "depth": int(client.xlen(stream)),
        "lag": None,
        "pending": 0,
        "consumers": 0,
    }
    try:
        groups = client.xinfo_groups(stream)
    except ResponseError as exc:
        if not is_missing_group(exc):
            raise
        return stats
    for group in groups:
        if text(group["name"]) == GROUP:
            lag = group.get("lag")
            stats["lag"] = None if lag is None else int(lag)
            stats["pending"] = int(group["pending"])
            stats["consumers"] = int(group["consumers"])
    return stats
