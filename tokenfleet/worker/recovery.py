"""What a worker is handed (`Delivery`), finding dead workers and taking over their jobs.

A worker is alive while its heartbeat hash (`keys.worker(name)`, WORKER_TTL_S)
exists. `claim_orphan_entries` moves pending jobs-stream entries away from
consumers whose hash is gone, in one script (claim_orphans.lua) that checks the
heartbeat and claims together, so a live worker's entries are never taken.
`WorkerQueue.claim_orphans` wraps it. The fleet view (live workers, queue stats) is
`tokenfleet.fleet`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.fleet import text
from tokenfleet.keys import DEFAULT_TENANT, GROUP, Keys, valid_job_id, valid_tenant


@dataclass(frozen=True)
class Delivery:
    """One jobs-stream entry handed to this worker.

    `job_id` is the entry's `job_id` field when it is present and a valid job id,
    else None (the client cannot be told). `payload` is None when the entry has
    no `payload` field or its data was deleted. `deliveries` counts how often the
    group handed it out (1 for a fresh read; each claim adds one). `lost` marks an
    entry whose data was deleted while pending: `claim_orphans` already took it off
    the pending list, so only `dead_letter` applies to it. `stream` is the band's jobs
    stream it was read from (entry ids are per stream); `tenant` is the entry's `tenant`
    field (written by submit.lua; `default` when absent or invalid).
    """

    entry_id: str
    job_id: str | None
    payload: bytes | None
    deliveries: int = 1
    lost: bool = False
    stream: str = ""
    tenant: str = DEFAULT_TENANT


def delivery(
    entry_id: Any, fields: dict[Any, Any] | None, deliveries: int, stream: str
) -> Delivery:
    """A `Delivery` from a stream entry's id and fields (bytes or str keys; None = deleted)."""
    fields = {text(k): v for k, v in (fields or {}).items()}
    raw_tenant = fields.get("tenant")
    tenant = text(raw_tenant) if isinstance(raw_tenant, bytes | str) else DEFAULT_TENANT
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
        text(entry_id),
        job_id,
        payload if isinstance(payload, bytes) else None,
        deliveries,
        stream=stream,
        tenant=tenant if valid_tenant(tenant) else DEFAULT_TENANT,
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

    `script` is tokenfleet.lua.CLAIM_ORPHANS_LUA registered on `client`. Raises ResponseError
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
            claimed.append(delivery(entry_id, fields, int(deliveries), stream))
        else:  # its data was deleted: the script took it off the pending list
            lost = Delivery(text(entry_id), None, None, int(deliveries), lost=True, stream=stream)
            claimed.append(lost)
    return claimed
