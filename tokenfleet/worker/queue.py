"""The Redis edge of one worker: read jobs, mark them running, finish or dead-letter
them, heartbeat, and claim the jobs of workers that died.

Ownership is the rule everything here keeps: a jobs-stream entry belongs to the
consumer it is pending to (`XPENDING`). `finish` and `dead_letter` write only
while this worker owns the entry, in one Lua script that also acks and deletes
it, so each job gets exactly one terminal event even when two workers race.
`claim_orphans` moves entries only away from consumers whose heartbeat hash has
expired (checked in the same script), so a live worker's job is never stolen.

The client must return bytes (`decode_responses=False`): payloads are msgpack.
Methods that write take an optional pipeline (`pipe`): they queue their
commands on it and return None; the caller executes it (one round trip a tick).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, overload

import redis
from redis.exceptions import ResponseError

from tokenfleet.errors import ProtocolError
from tokenfleet.keys import (
    DEAD_LETTERS_MAXLEN,
    EVENTS_MAXLEN,
    EVENTS_TTL_S,
    GROUP,
    JOB_STATE_TTL_S,
    RESULT_TTL_S,
    WORKER_TTL_S,
    Keys,
)
from tokenfleet.protocol import FinishEvent, JobResult, TokenEvent, decode_event, encode
from tokenfleet.worker.recovery import (
    CLAIM_ORPHANS_LUA,
    Delivery,
    claim_orphan_entries,
    delivery,
    is_missing_group,
    live_workers,
    lua,
    queue_stats,
)

__all__ = ["Delivery", "WorkerQueue", "live_workers", "queue_stats"]

ScriptArg = str | bytes | int | float

_OWNED_ENTRY_LUA = lua("owned_entry.lua")  # shared functions, prepended to the next three
FINISH_LUA = _OWNED_ENTRY_LUA + lua("finish.lua")
DEAD_LETTER_LUA = _OWNED_ENTRY_LUA + lua("dead_letter.lua")
REDELIVER_LUA = _OWNED_ENTRY_LUA + lua("redeliver.lua")
MARK_RUNNING_LUA = lua("mark_running.lua")


class WorkerQueue:
    """The jobs stream of one model, as seen by the worker named `worker`.

    Worker names must be unique per process start: a restarted worker reusing
    an old name would be taken for alive, and nobody would claim its old entries.
    """

    def __init__(
        self, client: redis.Redis, keys: Keys, worker: str, model: str | None = None
    ) -> None:
        self.redis = client
        self.keys = keys
        self.worker = worker
        self.model = model
        self.stream = keys.jobs(model)
        self._finish = client.register_script(FINISH_LUA)
        self._dead_letter = client.register_script(DEAD_LETTER_LUA)
        self._redeliver = client.register_script(REDELIVER_LUA)
        self._mark_running = client.register_script(MARK_RUNNING_LUA)
        self._claim = client.register_script(CLAIM_ORPHANS_LUA)

    # --- pull -------------------------------------------------------------
    def ensure_group(self) -> None:
        """Create the stream and its group (from id 0, so earlier jobs are served).

        Idempotent; call at start and after a NOGROUP error (Redis restarted empty)."""
        try:
            self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if not str(exc).startswith("BUSYGROUP"):
                raise

    def read(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to `count` new entries; waits up to `block_ms` when none (None: no wait;
        0: wait forever, as Redis reads BLOCK 0). count <= 0 returns [] without a call.

        A missing group is recreated and the read retried once."""
        if count <= 0:
            return []
        streams = {self.stream: ">"}
        try:
            reply = self.redis.xreadgroup(GROUP, self.worker, streams, count, block_ms)
        except ResponseError as exc:
            if not is_missing_group(exc):
                raise
            self.ensure_group()
            reply = self.redis.xreadgroup(GROUP, self.worker, streams, count, block_ms)
        return [delivery(entry_id, fields, 1) for entry_id, fields in _entries(reply)]

    def own_pending(self, count: int) -> list[Delivery]:
        """Entries pending to this worker (its own pending list), with their data.

        After a lost connection a read reply may have been lost in transit: its
        entries are pending to this worker but were never seen. Deliveries are
        reported as 2 so the caller resumes from any tokens already emitted."""
        if count <= 0:
            return []
        try:
            reply = self.redis.xreadgroup(GROUP, self.worker, {self.stream: "0"}, count)
        except ResponseError as exc:
            if not is_missing_group(exc):
                raise
            self.ensure_group()
            return []
        return [delivery(entry_id, fields, 2) for entry_id, fields in _entries(reply)]

    def mark_running(self, job_ids: Sequence[str], pipe: Any = None) -> None:
        """Job hashes → status running on this worker (expired or finished ones untouched)."""
        if not job_ids:
            return
        script_keys = [self.keys.job(job_id) for job_id in job_ids]
        args = [self.worker, f"{time.time():.6f}"]
        self._mark_running(keys=script_keys, args=args, client=self.redis if pipe is None else pipe)

    def cancelled(self, job_ids: Sequence[str]) -> set[str]:
        """The jobs among `job_ids` whose client asked to cancel (one MGET)."""
        if not job_ids:
            return set()
        flags = self.redis.mget([self.keys.cancel(job_id) for job_id in job_ids])
        return {job_id for job_id, flag in zip(job_ids, flags, strict=True) if flag is not None}

    def emitted_tokens(self, job_id: str) -> list[int]:
        """Token ids already published for indices 0..k-1, for a worker resuming the job.

        Reads the replay stream: the first event seen per index wins, the run stops
        at the first missing index, the finish event and unreadable entries are skipped."""
        by_index: dict[int, int] = {}
        for _entry_id, fields in self.redis.xrange(self.keys.events(job_id), "-", "+"):
            data = (fields or {}).get(b"m")
            if not isinstance(data, bytes):
                continue
            try:
                event = decode_event(data)
            except ProtocolError:
                continue
            if isinstance(event, TokenEvent) and event.job_id == job_id:
                by_index.setdefault(event.index, event.token_id)
        tokens: list[int] = []
        while len(tokens) in by_index:
            tokens.append(by_index[len(tokens)])
        return tokens

    # --- recovery -------------------------------------------------------------
    def claim_orphans(self, max_count: int, min_idle_ms: int = 1000) -> list[Delivery]:
        """Take over up to `max_count` entries of dead workers (heartbeat hash expired).

        Only entries idle ≥ `min_idle_ms` move, so of two workers racing for an
        orphan only the first gets it. `deliveries` is the count after this claim.
        An entry whose data was deleted while pending comes back `lost`, with
        payload None: dead-letter it. Dead consumers left with nothing pending are
        removed from the group. A live worker's entries are never claimed."""
        try:
            return claim_orphan_entries(
                self.redis, self._claim, self.keys, self.stream, self.worker, max_count, min_idle_ms
            )
        except ResponseError as exc:
            if not is_missing_group(exc):
                raise
            self.ensure_group()
            return []

    def redeliver(self, entry_id: str) -> int | None:
        """Count one more delivery of an entry this worker keeps (an in-process retry).

        Returns the new delivery count, or None when the entry is no longer this
        worker's (claimed, finished) or its data was deleted (redeliver.lua)."""
        count = self._redeliver(keys=[self.stream], args=self._common_args(entry_id))
        return None if count is None else int(count)

    # --- terminal writes ----------------------------------------------------
    @overload
    def finish(
        self,
        entry_id: str,
        job_id: str,
        result: JobResult,
        finish: FinishEvent,
        *,
        pipe: None = None,
    ) -> bool: ...
    @overload
    def finish(
        self, entry_id: str, job_id: str, result: JobResult, finish: FinishEvent, *, pipe: Any
    ) -> None: ...
    def finish(
        self,
        entry_id: str,
        job_id: str,
        result: JobResult,
        finish: FinishEvent,
        *,
        pipe: Any = None,
    ) -> bool | None:
        """Store the result, send the finish event, ack + delete the entry (finish.lua).

        True when done; False, with nothing written, when this worker no longer owns
        the entry (another worker claimed it, or it was finished already). Pipelined:
        returns None and the pipeline's reply for it is 1 or 0."""
        if result.job_id != job_id or finish.job_id != job_id:
            raise ValueError(f"result and finish event must both be for job {job_id}")
        script_keys = [self.stream, *self._terminal_keys(job_id)]
        args = [*self._common_args(entry_id), *self._terminal_args(result, finish)]
        if pipe is not None:
            self._finish(keys=script_keys, args=args, client=pipe)
            return None
        return bool(self._finish(keys=script_keys, args=args))

    def dead_letter(
        self,
        delivery: Delivery,
        reason: str,
        message: str,
        *,
        finish: FinishEvent | None = None,
        result: JobResult | None = None,
    ) -> bool:
        """Record the entry in the dead-letter stream and ack + delete it (dead_letter.lua).

        Give `finish` and `result` (both, for the job id) when the job id is known:
        the client then gets them as the job's terminal event. Same ownership rule
        and reply as `finish` (True done; False not this worker's, nothing written)."""
        if (finish is None) != (result is None):
            raise ValueError("give both finish and result, or neither")
        script_keys = [self.stream, self.keys.dead_letters()]
        args: list[ScriptArg] = [
            *self._common_args(delivery.entry_id),
            delivery.job_id or "",
            reason,
            message,
            delivery.deliveries,
            delivery.payload or b"",
            DEAD_LETTERS_MAXLEN,
            "1" if delivery.lost else "0",
        ]
        if finish is not None and result is not None:
            if result.job_id != finish.job_id:
                raise ValueError("result and finish event are for different jobs")
            script_keys += self._terminal_keys(finish.job_id)
            args += self._terminal_args(result, finish)
        return bool(self._dead_letter(keys=script_keys, args=args))

    def _common_args(self, entry_id: str) -> list[ScriptArg]:
        return [GROUP, self.worker, entry_id, f"{time.time():.6f}"]

    def _terminal_keys(self, job_id: str) -> list[str]:
        return [self.keys.result(job_id), self.keys.job(job_id), self.keys.events(job_id)]

    def _terminal_args(self, result: JobResult, finish: FinishEvent) -> list[ScriptArg]:
        return [
            encode(result),
            RESULT_TTL_S,
            str(result.finish_reason),
            JOB_STATE_TTL_S,
            encode(finish),
            EVENTS_MAXLEN,
            EVENTS_TTL_S,
            self.keys.channel(finish.job_id),
        ]

    # --- heartbeat ------------------------------------------------------------
    def heartbeat(self, info: dict[str, Any], pipe: Any = None) -> None:
        """Refresh this worker's hash (its heartbeat, WORKER_TTL_S) and announce `info`.

        Every hash value is JSON (strings too, so they read back exactly); `info`
        must be JSON-serialisable and gains a `worker` field with this name. Also
        ZADDs the name to the workers set and PUBLISHes the JSON on the telemetry
        channel. Call it about once a second, before the first `read`."""
        fields = {"worker": self.worker, **info}
        key = self.keys.worker(self.worker)
        target = pipe if pipe is not None else self.redis.pipeline(transaction=True)
        target.hset(key, mapping={name: json.dumps(value) for name, value in fields.items()})
        target.expire(key, WORKER_TTL_S)
        target.zadd(self.keys.workers(), {self.worker: time.time()})
        target.publish(self.keys.telemetry_channel(), json.dumps(fields))
        if pipe is None:
            target.execute()

    def leave(self) -> None:
        """Clean exit: drop the heartbeat now, so entries left pending are claimable at once."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.worker(self.worker))
        pipe.zrem(self.keys.workers(), self.worker)
        pipe.execute()


def _entries(reply: Any) -> list[tuple[Any, Any]]:
    """XREADGROUP's entries: RESP2 [[name, entries]], RESP3 {name: [entries]}."""
    if isinstance(reply, dict):
        return [entry for nested in reply.values() for entries in nested for entry in entries]
    return [entry for _name, entries in reply or [] for entry in entries]
