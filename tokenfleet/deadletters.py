"""Reading the dead-letter stream and submitting dead-lettered jobs again.

Each dead letter is an entry of `keys.dead_letters()` with the fields
job_id, entry, stream, reason, message, worker, deliveries, at, payload
(written by `lua/dead_letter.lua`).
"""

from __future__ import annotations

from typing import Any

import redis

from tokenfleet.errors import ProtocolError, TokenfleetError
from tokenfleet.fleet import text
from tokenfleet.keys import DEFAULT_QUEUE_CAP, Keys
from tokenfleet.producer import Producer
from tokenfleet.protocol import decode_request


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    out = {text(k): text(v) for k, v in raw.items() if k not in (b"payload", "payload")}
    for name in ("job_id", "entry", "stream", "reason", "message", "worker", "deliveries", "at"):
        out.setdefault(name, "")
    return out


def list_dead_letters(client: redis.Redis, keys: Keys, count: int = 20) -> list[dict[str, Any]]:
    """The newest `count` dead letters (of every partition), without their payloads."""
    entries = [
        entry
        for p in keys.partitions_all
        for entry in client.xrevrange(keys.dead_letters(p), "+", "-", count=count)
    ]
    entries.sort(key=lambda e: _id_order(text(e[0])), reverse=True)
    return [{"id": text(entry_id), **_fields(raw)} for entry_id, raw in entries[:count]]


def _id_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _find(client: redis.Redis, keys: Keys, entry_id: str) -> tuple[str, Any]:
    """The dead-letter stream holding `entry_id`, and the entry (TokenfleetError if none)."""
    for p in keys.partitions_all:
        found = client.xrange(keys.dead_letters(p), entry_id, entry_id)
        if found:
            return keys.dead_letters(p), found[0]
    raise TokenfleetError(f"no dead letter {entry_id} in {keys.dead_letters()}")


def requeue_dead_letter(
    client: redis.Redis, keys: Keys, entry_id: str, *, default_cap: int = DEFAULT_QUEUE_CAP
) -> str:
    """Submit a dead-lettered job again under its own id and drop the dead letter.

    The job's old state, result and events are deleted first so it starts
    afresh; its payload must still decode (garbage entries cannot be requeued), and
    the job must not be live (a duplicate's job may still be queued or running).
    Raises QueueFull like any submit."""
    stream_of_letter, letter = _find(client, keys, entry_id)
    payload = letter[1].get(b"payload", b"")
    try:
        request = decode_request(payload)
    except ProtocolError as exc:
        raise TokenfleetError(f"dead letter {entry_id} cannot be requeued: {exc}") from None
    job = request.job_id
    stream, entry = client.hmget(keys.job(job), "stream", "entry")
    if stream and entry and client.xrange(stream, entry, entry):
        # e.g. a `rejected_duplicate` letter: the job itself is still queued or running;
        # wiping its state would destroy the live job's events and result.
        raise TokenfleetError(
            f"dead letter {entry_id} cannot be requeued: job {job} is still queued or "
            f"running (entry {text(entry)} of {text(stream)})"
        )
    client.delete(keys.job(job), keys.result(job), keys.events(job), keys.cancel(job))
    Producer(client, keys=keys, default_cap=default_cap).submit(request)
    client.xdel(stream_of_letter, entry_id)
    return job
