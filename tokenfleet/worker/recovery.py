"""What a worker is handed (`Delivery`), finding dead workers and taking over their jobs.

A worker is alive while its heartbeat hash (`keys.worker(name)`, WORKER_TTL_S)
exists. `claim_orphan_entries` moves pending jobs-stream entries away from
consumers whose hash is gone, in one script (claim_orphans.lua) that checks the
heartbeat and claims together, so a live worker's entries are never taken.
`WorkerQueue.claim_orphans` wraps it. The fleet view (live workers, queue stats) is
`tokenfleet.fleet`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from tokenfleet.fleet import text
from tokenfleet.keys import DEFAULT_TENANT, GROUP, Band, Keys, valid_job_id, valid_tenant
from tokenfleet.lua.calls import Candidate, ClaimOrphansCall


@dataclass(frozen=True)
class Delivery:
    """One jobs-stream entry handed to this worker.

    `job_id` is the entry's `job_id` field when it is present and a valid job id,
    else None (the client cannot be told). `payload` is None when the entry has
    no `payload` field or its data was deleted. `deliveries` counts how often the
    group handed it out (1 for a fresh read; each claim adds one). `lost` marks an
    entry whose data was deleted while pending: `claim_orphans` already took it off
    the pending list, so only `dead_letter` applies to it. `band` is the priority band
    whose stream it was read from (entry ids are per stream): the band the job waited in
    is the band it runs in. `tenant` is the entry's `tenant` field (written by
    submit.lua; `default` when absent or invalid).
    """

    entry_id: str
    job_id: str | None
    payload: bytes | None
    deliveries: int = 1
    lost: bool = False
    band: Band = field(kw_only=True)
    tenant: str = DEFAULT_TENANT

    @property
    def stream(self) -> str:
        return self.band.stream


def delivery(entry_id: Any, fields: dict[Any, Any] | None, deliveries: int, band: Band) -> Delivery:
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
        band=band,
        tenant=tenant if valid_tenant(tenant) else DEFAULT_TENANT,
    )


def claim_orphan_entries(
    client: redis.Redis,
    script: Any,
    keys: Keys,
    band: Band,
    worker: str,
    max_count: int,
    min_idle_ms: int,
) -> list[Delivery]:
    """Claim up to `max_count` entries idle ≥ `min_idle_ms` from dead consumers of the
    band's stream.

    `script` is tokenfleet.lua.CLAIM_ORPHANS_LUA registered on `client`. Raises ResponseError
    (NOGROUP / no such key) when the stream or group is missing."""
    if max_count <= 0:
        return []
    stream = band.stream
    consumers = [text(c["name"]) for c in client.xinfo_consumers(stream, GROUP)]
    others = [name for name in consumers if name != worker]
    if not others:
        return []
    call = ClaimOrphansCall(
        stream=stream,
        worker=worker,
        candidates=[Candidate(hash=keys.alive(name, band.partition), name=name) for name in others],
        min_idle_ms=min_idle_ms,
        most=max_count,
    )
    claimed = []
    for got in call.parse(script(keys=call.keys(), args=call.args())):
        if got.fields is not None:
            claimed.append(delivery(got.entry_id, got.fields, got.deliveries, band))
        else:  # its data was deleted: the script took it off the pending list
            lost = Delivery(got.entry_id, None, None, got.deliveries, lost=True, band=band)
            claimed.append(lost)
    return claimed
