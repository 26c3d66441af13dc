"""The Redis edge of one worker: read jobs, accept them, write each tick (events and
finishes), dead-letter, heartbeat, and claim the jobs of workers that died.

A model's queue is one stream per priority band (keys.bands): `pull` reads the
highest band first, with a fleet-wide starvation guard (pull.lua); every other call
acts on the stream its entry came from (`Delivery.stream`).

Ownership is the rule everything here keeps: a jobs-stream entry belongs to the
consumer it is pending to (`XPENDING`). `tick` and `dead_letter` write for a job
only while this worker owns its entry, in the same Lua script that acks and
deletes it, so each job gets exactly one terminal event even when two workers race.
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
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

import redis
from redis.exceptions import ResponseError

from tokenfleet.errors import ProtocolError
from tokenfleet.fleet import is_missing_group
from tokenfleet.keys import (
    BANDS,
    DEAD_LETTERS_MAXLEN,
    EVENTS_MAXLEN,
    EVENTS_TTL_S,
    GROUP,
    JOB_STATE_TTL_S,
    RESULT_TTL_S,
    STARVATION_GUARD,
    WORKER_TTL_S,
    Keys,
)
from tokenfleet.lua import (
    ACCEPT_LUA,
    CLAIM_ORPHANS_LUA,
    DEAD_LETTER_LUA,
    PROBE_LUA,
    PULL_LUA,
    REDELIVER_LUA,
    REQUEUE_LUA,
    TICK_LUA,
)
from tokenfleet.protocol import FinishEvent, JobResult, TokenEvent, decode_event, encode
from tokenfleet.worker.errors import RedisAccessError
from tokenfleet.worker.recovery import Delivery, claim_orphan_entries, delivery

__all__ = [
    "Accepted",
    "Delivery",
    "InFlight",
    "TickReply",
    "TickVerdict",
    "TickWrite",
    "Verdict",
    "WorkerQueue",
]

ScriptArg = str | bytes | int | float


class Verdict(StrEnum):
    """What accept.lua says of an entry just read or claimed."""

    OK = "ok"  # the job's own entry: it is this worker's to serve
    DEFERRED = "deferred"  # its tenant is at max_running: put back at its band's tail
    UNSUBMITTED = "unsubmitted"  # no state for the job: never submitted (or expired)
    DUPLICATE = "duplicate"  # the job's state records another entry
    FINISHED = "finished"  # the job ended already
    LOST = "lost"  # the entry is not pending to this worker (claimed while it was away)


class Accepted(NamedTuple):
    """accept.lua's answer for one entry: its verdict, whether its client asked to cancel,
    and, for OK: when the job was submitted (unix s; None when unknown), how many token
    indices its replay stream holds already (a job put back or claimed resumes after
    them), and its tenant's cache group (None: the tenant's cache is its own)."""

    verdict: Verdict
    cancelled: bool
    submitted_at: float | None = None
    emitted: int = 0
    cache_group: str | None = None


class TickVerdict(StrEnum):
    """What tick.lua says of one held job (see the script)."""

    OK = "ok"
    CANCEL = "cancel"
    DONE = "done"
    LOST = "lost"
    GAP = "gap"


@dataclass(frozen=True)
class TickWrite:
    """One held job's part of a tick: its new token events and, when it ended, the
    terminal pair. Every held job is in every tick (its ownership is checked)."""

    delivery: Delivery
    job_id: str
    events: list[TokenEvent]
    end: tuple[JobResult, FinishEvent] | None = None


@dataclass(frozen=True)
class TickReply:
    verdict: TickVerdict
    next_index: int  # indices the job's replay stream holds now


class WorkerQueue:
    """The jobs streams (one per priority band) of one model, as seen by the worker
    named `worker`.

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
        self.stream = keys.jobs(model)  # the default band's
        self.streams = keys.bands(model)  # every band's, highest first
        self.guard = STARVATION_GUARD
        self._pull = client.register_script(PULL_LUA)
        self._dead_letter = client.register_script(DEAD_LETTER_LUA)
        self._redeliver = client.register_script(REDELIVER_LUA)
        self._requeue = client.register_script(REQUEUE_LUA)
        self._accept = client.register_script(ACCEPT_LUA)
        self._tick = client.register_script(TICK_LUA)
        self._probe = client.register_script(PROBE_LUA)
        self._claim = client.register_script(CLAIM_ORPHANS_LUA)

    # --- pull -------------------------------------------------------------
    def ensure_group(self) -> None:
        """Create every band's stream and its group (from id 0, so earlier jobs are
        served). Idempotent; call at start and after a NOGROUP error (Redis restarted
        empty)."""
        for stream in self.streams:
            try:
                self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise

    def preflight(self) -> None:
        """Check that this worker's Redis user may run every command the worker sends
        (probe.lua, on throwaway keys); raises `RedisAccessError` naming those it may not."""
        probe = self.keys.probe(self.worker)
        script_keys = [f"{probe}:stream", f"{probe}:hash", f"{probe}:string", f"{probe}:zset"]
        args = [GROUP, self.worker, self.keys.telemetry_channel()]
        denied = [_str(name) for name in self._probe(keys=script_keys, args=args)]
        if not denied:
            self.load_scripts()
        if denied:
            raise RedisAccessError(
                "the worker's redis user may not run: "
                + ", ".join(denied)
                + " (see docs/operations.md, 'Least privilege')"
            )

    def read(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to `count` new entries, highest band first (pull.lua); when there are none,
        waits up to `block_ms` for the first (None: no wait; 0: wait forever, as Redis
        reads BLOCK 0) — that wait may return one entry per band. count <= 0 returns []
        without a call. A missing group is recreated and the read retried once."""
        if count <= 0:
            return []
        try:
            return self._read(count, block_ms)
        except ResponseError as exc:
            if not is_missing_group(exc):
                raise
            self.ensure_group()
            return self._read(count, block_ms)

    def _read(self, count: int, block_ms: int | None) -> list[Delivery]:
        got = self.parse_pull(self._pull(keys=self._pull_keys(), args=self._pull_args(count)))
        if got or block_ms is None:
            return got
        streams = {stream: ">" for stream in self.streams}
        reply = self.redis.xreadgroup(GROUP, self.worker, streams, 1, block_ms)
        return [delivery(entry_id, fields, 1, stream) for stream, entry_id, fields in _named(reply)]

    def pull(self, count: int, pipe: Any, extra: int = 0, floor: Sequence[str] = ()) -> None:
        """Queue a read of up to `count` new entries (pull.lua) on `pipe`, plus up to
        `extra` more of the highest band alone, plus one of each band in `floor` that has
        entries waiting (bands this worker holds no job of); its reply goes to
        `parse_pull`. Loaded at start (`load_scripts`), like tick.lua."""
        script_keys = self._pull_keys()
        args = self._pull_args(count, extra, floor)
        pipe.evalsha(self._pull.sha, len(script_keys), *script_keys, *args)

    def _pull_keys(self) -> list[str]:
        return [*self.streams, self.keys.pulls(self.model)]

    def _pull_args(self, count: int, extra: int = 0, floor: Sequence[str] = ()) -> list[ScriptArg]:
        flags = ["1" if band in floor else "0" for band in BANDS]
        return [GROUP, self.worker, count, self.guard, *BANDS, extra, *flags]

    def parse_pull(self, reply: Any) -> list[Delivery]:
        out = []
        for band, entry_id, flat in reply or []:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            out.append(delivery(entry_id, fields, 1, self.streams[int(band)]))
        return out

    def own_pending(self, count: int) -> list[Delivery]:
        """Entries pending to this worker (its own pending list), with their data.

        After a lost connection a read reply may have been lost in transit: its
        entries are pending to this worker but were never seen. Deliveries are
        reported as 2 (a read that was delivered once already); accept.lua's `emitted` says
        whether the caller resumes after tokens already published."""
        if count <= 0:
            return []
        try:
            reply = self.redis.xreadgroup(
                GROUP, self.worker, dict.fromkeys(self.streams, "0"), count
            )
        except ResponseError as exc:
            if not is_missing_group(exc):
                raise
            self.ensure_group()
            return []
        return [delivery(entry_id, fields, 2, stream) for stream, entry_id, fields in _named(reply)]

    def accept(self, deliveries: Sequence[Delivery]) -> list[Accepted]:
        """Check entries against their jobs' state and mark the genuine ones running here
        (accept.lua), or put back those whose tenant is at its running limit. Every
        delivery must have a job id."""
        if not deliveries:
            return []
        k = self.keys
        script_keys: list[str] = []
        args: list[ScriptArg] = [GROUP, self.worker, "", f"{time.time():.6f}"]
        for d in deliveries:
            assert d.job_id is not None, "accept() needs the entry's job id"
            script_keys += [d.stream, k.job(d.job_id), k.cancel(d.job_id)]
            script_keys += self._tenant_keys(d)
            script_keys += [k.tenant_limits(d.tenant), k.tenant_limits(None)]
            args += [d.entry_id, d.job_id]
        reply = self._accept(keys=script_keys, args=args)
        return [
            Accepted(
                Verdict(_str(verdict)),
                bool(int(flag)),
                float(at) if at else None,
                int(emitted) if emitted else 0,
                _str(group) if group else None,
            )
            for verdict, flag, at, emitted, group in reply
        ]

    def _tenant_keys(self, d: Delivery) -> list[str]:
        """The tenant's queued and running sets, which every terminal write leaves."""
        return [
            self.keys.tenant_queued(d.tenant, self.model),
            self.keys.tenant_running(d.tenant, self.model),
        ]

    def tick(self, writes: Sequence[TickWrite], pipe: Any) -> None:
        """Queue one tick's fenced writes for every held job on `pipe` (tick.lua); the
        pipeline's reply for it goes to `parse_tick`."""
        script_keys: list[str] = []
        args: list[ScriptArg] = [
            GROUP,
            self.worker,
            "",
            f"{time.time():.6f}",
            EVENTS_MAXLEN,
            EVENTS_TTL_S,
            RESULT_TTL_S,
            JOB_STATE_TTL_S,
            len(writes),
        ]
        for w in writes:
            k = self.keys
            d = w.delivery
            script_keys += [d.stream, k.job(w.job_id), k.events(w.job_id), k.result(w.job_id)]
            script_keys += [k.cancel(w.job_id), *self._tenant_keys(d)]
            args += [d.entry_id, w.job_id, k.channel(w.job_id), len(w.events)]
            args.append("0" if w.end is None else "1")
            for event in w.events:
                args += [event.index, encode(event)]
            if w.end is not None:
                result, finish = w.end
                if result.job_id != w.job_id or finish.job_id != w.job_id:
                    raise ValueError(f"result and finish event must both be for job {w.job_id}")
                args += [str(result.finish_reason), encode(result), encode(finish)]
        # EVALSHA itself: a pipeline that runs a registered Script first sends SCRIPT
        # EXISTS, a second round trip per tick. The script is loaded at start
        # (`load_scripts`); after a Redis restart the reply is NoScriptError: load, resend.
        pipe.evalsha(self._tick.sha, len(script_keys), *script_keys, *args)

    def load_scripts(self) -> None:
        """(Re)load the pipelined scripts (tick.lua, pull.lua) into Redis's script cache
        (at start, after NOSCRIPT)."""
        self.redis.script_load(TICK_LUA)
        self.redis.script_load(PULL_LUA)

    @staticmethod
    def parse_tick(reply: Any) -> list[TickReply]:
        return [TickReply(TickVerdict(_str(v)), int(n)) for v, n in reply]

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
        claimed: list[Delivery] = []
        for stream in self.streams:  # the highest band's orphans first
            left = max_count - len(claimed)
            if left <= 0:
                break
            try:
                claimed += claim_orphan_entries(
                    self.redis, self._claim, self.keys, stream, self.worker, left, min_idle_ms
                )
            except ResponseError as exc:
                if not is_missing_group(exc):
                    raise
                self.ensure_group()
        return claimed

    def redeliver(self, d: Delivery) -> int | None:
        """Count one more delivery of an entry this worker keeps (an in-process retry).

        Returns the new delivery count, or None when the entry is no longer this
        worker's (claimed, finished) or its data was deleted (redeliver.lua)."""
        count = self._redeliver(keys=[d.stream], args=self._common_args(d.entry_id))
        return None if count is None else int(count)

    def requeue(self, d: Delivery) -> str | None:
        """Put a held job this worker cannot start back at the tail of its band, for any
        worker (requeue.lua). Returns the new entry id, or None with nothing written when
        the entry is no longer this worker's or the job's."""
        assert d.job_id is not None, "requeue() needs the entry's job id"
        script_keys = [d.stream, self.keys.job(d.job_id), *self._tenant_keys(d)]
        again = self._requeue(keys=script_keys, args=[*self._common_args(d.entry_id), d.job_id])
        return _str(again) if again else None

    # --- terminal writes ----------------------------------------------------
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
        the client then gets them as the job's terminal event. True when done; False,
        with nothing written, when the entry is not this worker's."""
        if (finish is None) != (result is None):
            raise ValueError("give both finish and result, or neither")
        script_keys = [delivery.stream, self.keys.dead_letters()]
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
            script_keys += [*self._terminal_keys(finish.job_id), *self._tenant_keys(delivery)]
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
            finish.job_id,
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
        # Not a transaction: when Redis is out of memory the HSET is refused, but the
        # EXPIRE still keeps the hash (and so this worker's jobs) alive.
        target = pipe if pipe is not None else self.redis.pipeline(transaction=False)
        target.hset(key, mapping={name: json.dumps(value) for name, value in fields.items()})
        target.expire(key, WORKER_TTL_S)
        target.zadd(self.keys.workers(), {self.worker: time.time()})
        target.publish(self.keys.telemetry_channel(), json.dumps(fields))
        if pipe is None:
            target.execute(raise_on_error=False)

    def leave(self) -> None:
        """Clean exit: drop the heartbeat now, so entries left pending are claimable at once."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.worker(self.worker))
        pipe.zrem(self.keys.workers(), self.worker)
        pipe.execute()


class InFlight:
    """A pipeline sent on a connection of its own whose replies are read later, so the
    caller computes while Redis works (redis-py's `execute` sends and reads in one go).
    Read it with `replies()` or give it up with `abandon()`: either returns the
    connection to the pool."""

    def __init__(self, client: redis.Redis, pipe: Any) -> None:
        self.client = client
        self.commands: list[tuple[tuple[Any, ...], dict[str, Any]]] = list(pipe.command_stack)
        pool = client.connection_pool
        self.conn = pool.get_connection()
        try:
            self.conn.send_packed_command(
                self.conn.pack_commands([args for args, _ in self.commands])
            )
        except BaseException:
            self.abandon()
            raise

    def replies(self) -> list[Any]:
        """Every command's reply in order; a command's error is its reply (not raised)."""
        out: list[Any] = []
        try:
            for args, options in self.commands:
                try:
                    out.append(self.client.parse_response(self.conn, args[0], **options))
                except ResponseError as exc:
                    out.append(exc)
        except BaseException:
            self.conn.disconnect()  # a reply left unread would desynchronise the socket
            raise
        finally:
            self.client.connection_pool.release(self.conn)
        return out

    def abandon(self) -> None:
        self.conn.disconnect()
        self.client.connection_pool.release(self.conn)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _named(reply: Any) -> list[tuple[str, Any, Any]]:
    """XREADGROUP's entries with the stream each came from: (stream, id, fields)."""
    if isinstance(reply, dict):
        pairs = [(name, entries) for name, nested in reply.items() for entries in nested]
    else:
        pairs = [(name, entries) for name, entries in reply or []]
    return [(_str(name), e[0], e[1]) for name, entries in pairs for e in entries]


def entries_of(reply: Any) -> list[tuple[Any, Any]]:
    """XREADGROUP's entries: RESP2 [[name, entries]], RESP3 {name: [entries]}."""
    if isinstance(reply, dict):
        return [entry for nested in reply.values() for entries in nested for entry in entries]
    return [entry for _name, entries in reply or [] for entry in entries]
