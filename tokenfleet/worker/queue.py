"""The Redis edge of one worker: read jobs, accept them, write each tick (events and
finishes), dead-letter, heartbeat, and claim the jobs of workers that died.

A model's queue is one stream per priority band (keys.bands): `pull` reads the
highest band first, with a fleet-wide starvation guard (pull.lua); every other call
acts on the stream its entry came from (`Delivery.stream`). A partitioned queue
(keys.py: P parts, each script call within one) is read one partition per pull, in
turn; a tick writes one tick.lua call per partition it holds jobs of.

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
from dataclasses import dataclass, field
from typing import Any

import hiredis
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, ResponseError
from redis.retry import Retry

from tokenfleet.errors import ProtocolError
from tokenfleet.keys import (
    BANDS,
    GROUP,
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
from tokenfleet.lua.calls import (
    AcceptCall,
    Accepted,
    AcceptEntry,
    DeadLetterCall,
    Finish,
    JobTarget,
    ProbeCall,
    PullBand,
    PullCall,
    RedeliverCall,
    RequeueCall,
    ScriptCall,
    Terminal,
    TickCall,
    TickJob,
    TickReply,
    TickVerdict,
    TokenWrite,
    Verdict,
    timestamp,
)
from tokenfleet.protocol import FinishEvent, JobResult, TokenEvent, decode_events, encode
from tokenfleet.redis_errors import RedisAccessError, is_missing_group
from tokenfleet.worker.recovery import Delivery, claim_orphan_entries, delivery

__all__ = [
    "Accepted",
    "Delivery",
    "PullAsk",
    "Replies",
    "RoundTrip",
    "TickReply",
    "TickVerdict",
    "TickWrite",
    "Verdict",
    "WorkerQueue",
]


@dataclass(frozen=True)
class TickWrite:
    """One held job's part of a tick: its new token events and, when it ended, the
    terminal pair. Every held job is in every flush tick (its ownership is checked
    there; `Outbox.in_tick`), and between flushes when it sends."""

    delivery: Delivery
    job_id: str
    events: list[TokenEvent]
    end: tuple[JobResult, FinishEvent] | None = None
    # durable mode: the indices a replica holds, and the acknowledged events to announce
    # now (tick.lua); -1: a plain tick, its events published as written
    durable: int = -1
    announce: list[TokenEvent] = field(default_factory=list)


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
        # The worker loop retries, then resyncs (worker/loop.py); the client must not: a
        # retried XREADGROUP whose first reply was lost leaves entries pending unseen.
        client.set_retry(Retry(NoBackoff(), 0))
        self.keys = keys
        self.worker = worker
        self.model = model
        # every partition's bands with their streams, highest first
        self.parts = [keys.bands(model, p) for p in keys.partitions_all]
        self.bands = [band for part in self.parts for band in part]
        self._band_of = {band.stream: band for band in self.bands}
        self._turn = 0  # the partition the next pull reads (round robin)
        # per partition, the highest band index that had entries waiting when it was last
        # pulled (len(BANDS): none, or not known yet): a pull of one partition takes no
        # band below one waiting in another (pull.lua's ceiling), so bands rank across
        # the whole queue, as of each partition's last pull
        self._top = [len(BANDS)] * len(self.parts)
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
        for band in self.bands:
            try:
                self.redis.xgroup_create(band.stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise

    def preflight(self) -> None:
        """Check that this worker's Redis user may run every command the worker sends
        (probe.lua, on throwaway keys); raises `RedisAccessError` naming those it may not."""
        probe = self.keys.probe(self.worker)
        call = ProbeCall(
            stream=f"{probe}:stream",
            hash=f"{probe}:hash",
            string=f"{probe}:string",
            zset=f"{probe}:zset",
            worker=self.worker,
            channel=self.keys.telemetry_channel(),
        )
        denied = call.parse(_run(self._probe, call))
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
        for _ in self.parts:  # each partition in turn, until one has entries
            part = self._next_part()
            got = self.parse_pull(_run(self._pull, self._pull_call(count, part=part)), part)
            if got:
                return got
        if block_ms is None:
            return []
        # Blocked on one partition's bands (a read across slots is refused on a cluster):
        # the next idle read waits on the next partition.
        wait = block_ms if block_ms == 0 else max(10, block_ms // len(self.parts))
        streams = dict.fromkeys((b.stream for b in self.parts[self._next_part()]), ">")
        reply = self.redis.xreadgroup(GROUP, self.worker, streams, 1, wait)
        return [
            delivery(entry_id, fields, 1, self._band_of[stream])
            for stream, entry_id, fields in _named(reply)
        ]

    def _next_part(self) -> int:
        part = self._turn
        self._turn = (part + 1) % len(self.parts)
        return part

    @property
    def streams(self) -> list[str]:
        return [band.stream for band in self.bands]

    def is_empty(self) -> bool:
        """No entry waits in any band (burst mode's exit test)."""
        return all(int(self.redis.xlen(stream)) == 0 for stream in self.streams)

    def ping(self) -> None:
        """Whether Redis answers (raises if not). On a cluster, the slot map is read again
        first: after a failover the slots of a node that died are served by another."""
        if isinstance(self.redis, RedisCluster):
            try:
                self.redis.nodes_manager.initialize()
            except RedisClusterException as exc:
                raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc
        self.redis.ping()

    def pull(self, count: int, pipe: Any, extra: int = 0, floor: Sequence[str] = ()) -> int:
        """Queue a read of up to `count` new entries (pull.lua) on `pipe`, plus up to
        `extra` more of the highest band alone, plus one of each band in `floor` that has
        entries waiting (bands this worker holds no job of), from the next partition in
        turn, whose number it returns; its reply goes to `parse_pull` with it. Loaded at
        start (`load_scripts`), like tick.lua."""
        part = self._next_part()
        _queue(pipe, self._pull.sha, self._pull_call(count, extra, floor, part))
        return part

    def _pull_call(
        self, count: int, extra: int = 0, floor: Sequence[str] = (), part: int = 0
    ) -> PullCall:
        bands = [
            PullBand(stream=b.stream, name=b.name, floor=b.name in floor) for b in self.parts[part]
        ]
        others = [top for p, top in enumerate(self._top) if p != part]
        return PullCall(
            worker=self.worker,
            bands=bands,
            pulls=self.keys.pulls(self.model, part),
            count=count,
            guard=self.guard,
            extra=extra,
            ceiling=min(others, default=len(BANDS)),
        )

    def parse_pull(self, reply: Any, part: int = 0) -> list[Delivery]:
        pulled, top = PullCall.parse_with_top(reply)
        if top is not None:
            self._top[part] = top
        return [delivery(got.entry_id, got.fields, 1, self.parts[part][got.band]) for got in pulled]

    def own_pending(self, count: int) -> list[Delivery]:
        """Entries pending to this worker (its own pending list), with their data.

        After a lost connection a read reply may have been lost in transit: its
        entries are pending to this worker but were never seen. Deliveries are
        reported as 2 (a read that was delivered once already); accept.lua's `emitted` says
        whether the caller resumes after tokens already published."""
        if count <= 0:
            return []
        found: list[Delivery] = []
        for part in self.parts:  # one partition a read: one slot on a cluster
            try:
                reply = self.redis.xreadgroup(
                    GROUP, self.worker, dict.fromkeys((b.stream for b in part), "0"), count
                )
            except ResponseError as exc:
                if not is_missing_group(exc):
                    raise
                self.ensure_group()
                continue
            found += [
                delivery(entry_id, fields, 2, self._band_of[stream])
                for stream, entry_id, fields in _named(reply)
            ]
        return found

    def accept(self, deliveries: Sequence[Delivery]) -> list[Accepted]:
        """Check entries against their jobs' state and mark the genuine ones running here
        (accept.lua), or put back those whose tenant is at its running limit. Every
        delivery must have a job id."""
        if not deliveries:
            return []
        k = self.keys
        verdicts: dict[int, Accepted] = {}
        for part, indexed in _by_partition(deliveries).items():  # one call a partition
            entries = []
            for _, d in indexed:
                assert d.job_id is not None, "accept() needs the entry's job id"
                queued, running = self._tenant_keys(d)
                entries.append(
                    AcceptEntry(
                        stream=d.stream,
                        hash=k.job(d.job_id),
                        cancel=k.cancel(d.job_id),
                        queued=queued,
                        running=running,
                        limits=k.tenant_limits(d.tenant, part),
                        default_limits=k.tenant_limits(None, part),
                        entry_id=d.entry_id,
                        job_id=d.job_id,
                    )
                )
            call = AcceptCall(worker=self.worker, now=timestamp(), entries=entries)
            for (i, _), got in zip(indexed, call.parse(_run(self._accept, call)), strict=True):
                verdicts[i] = got
        return [verdicts[i] for i in range(len(deliveries))]

    def _tenant_keys(self, d: Delivery) -> tuple[str, str]:
        """The tenant's queued and running sets (of the entry's partition), which every
        terminal write leaves."""
        part = d.band.partition
        return (
            self.keys.tenant_queued(d.tenant, self.model, part),
            self.keys.tenant_running(d.tenant, self.model, part),
        )

    def tick(self, writes: Sequence[TickWrite], pipe: Any) -> list[list[int]]:
        """Queue one tick's fenced writes for every held job on `pipe` (tick.lua): one call
        per partition the writes are of. Returns, per call in order, the indices of the
        writes it carries; its replies go to `parse_tick` with them."""
        order: list[list[int]] = []
        for indexed in _by_partition([w.delivery for w in writes]).values():
            order.append([i for i, _ in indexed])
            self._tick_call([writes[i] for i, _ in indexed], pipe)
        return order

    def _tick_call(self, writes: Sequence[TickWrite], pipe: Any) -> None:
        held = []
        for w in writes:
            end = None
            if w.end is not None:
                result, finish = w.end
                if result.job_id != w.job_id or finish.job_id != w.job_id:
                    raise ValueError(f"result and finish event must both be for job {w.job_id}")
                end = Finish(
                    reason=str(result.finish_reason),
                    result_data=encode(result),
                    finish_data=encode(finish),
                )
            tokens = [TokenWrite(index=e.index, data=encode(e)) for e in w.events]
            held.append(
                TickJob(
                    stream=w.delivery.stream,
                    cancel=self.keys.cancel(w.job_id),
                    entry_id=w.delivery.entry_id,
                    job=self._target(w.delivery, w.job_id),
                    tokens=tokens,
                    end=end,
                    durable=w.durable,
                    announce=b"".join(encode(e) for e in w.announce),
                )
            )
        # EVALSHA itself: a pipeline that runs a registered Script first sends SCRIPT
        # EXISTS, a second round trip per tick. The script is loaded at start
        # (`load_scripts`); after a Redis restart the reply is NoScriptError: load, resend.
        _queue(pipe, self._tick.sha, TickCall(worker=self.worker, now=timestamp(), held=held))

    def send(
        self,
        writes: Sequence[TickWrite],
        pull: PullAsk | None = None,
        heartbeat: dict[str, Any] | None = None,
        wait: tuple[int, int] | None = None,
    ) -> RoundTrip | None:
        """Send one tick's round trip without waiting: the fenced writes of every held
        job (tick.lua), a read for the engine (pull.lua), the heartbeat; None when there
        is nothing to send. Its replies are read with `RoundTrip.replies`, after the
        caller computed the next tick: Redis works meanwhile. `wait` (replicas, timeout
        ms), durable mode: the round trip ends with WAIT on every node it wrote to, and
        the replies say which writes a replica acknowledged."""
        reads = pull is not None and pull.reads
        if not writes and not reads and heartbeat is None:
            return None
        pipe = _stack(self.redis)
        order = self.tick(writes, pipe) if writes else []
        part = None
        if pull is not None and reads:
            part = self.pull(pull.count, pipe, pull.extra, pull.floor)
        if heartbeat is not None:
            self.heartbeat(heartbeat, pipe=pipe)
        trip = RoundTrip(self, in_flight(self.redis, pipe, wait), order, part)
        trip.wait_for = 0 if wait is None else wait[0]
        return trip

    def recovered(self, exc: Exception) -> bool:
        """Whether `exc` from a round trip was a Redis that lost its scripts or its
        group (restarted empty), now put right here; the caller retries next time."""
        if isinstance(exc, NoScriptError):
            self.load_scripts()
            return True
        if isinstance(exc, ResponseError) and str(exc).startswith(_CLUSTER_MOVES):
            # a cluster moved a slot (resharding, failover): learn the new map, resend
            self.redis.nodes_manager.initialize()
            return True
        if isinstance(exc, ResponseError) and is_missing_group(exc):
            self.ensure_group()
            return True
        return False

    def load_scripts(self) -> None:
        """(Re)load the pipelined scripts (tick.lua, pull.lua) into Redis's script cache
        (at start, after NOSCRIPT)."""
        self.redis.script_load(TICK_LUA)
        self.redis.script_load(PULL_LUA)

    @staticmethod
    def parse_tick(reply: Any) -> list[TickReply]:
        return TickCall.parse(reply)

    def _target(self, d: Delivery, job_id: str) -> JobTarget:
        """Where a job's terminal writes go (its result, state, replay stream, tenant
        sets) and its live channel."""
        queued, running = self._tenant_keys(d)
        k = self.keys
        return JobTarget(
            result=k.result(job_id),
            hash=k.job(job_id),
            events=k.events(job_id),
            queued=queued,
            running=running,
            channel=k.channel(job_id),
            job_id=job_id,
            publish=k.publish,
        )

    def emitted_tokens(self, job_id: str) -> list[int]:
        """Token ids already published for indices 0..k-1 (`emitted_events`)."""
        return [event.token_id for event in self.emitted_events(job_id)]

    def emitted_events(self, job_id: str) -> list[TokenEvent]:
        """Token events already published for indices 0..k-1, for a worker resuming the
        job (their ids, and their logprobs when the job asked for them).

        Reads the replay stream: the first event seen per index wins, the run stops
        at the first missing index, the finish event and unreadable entries are skipped."""
        by_index: dict[int, TokenEvent] = {}
        for _entry_id, fields in self.redis.xrange(self.keys.events(job_id), "-", "+"):
            data = (fields or {}).get(b"m")
            if not isinstance(data, bytes):
                continue
            try:
                events = decode_events(data)  # one, or a worker's coalesced ticks
            except ProtocolError:
                continue
            for event in events:
                if isinstance(event, TokenEvent) and event.job_id == job_id:
                    by_index.setdefault(event.index, event)
        emitted: list[TokenEvent] = []
        while len(emitted) in by_index:
            emitted.append(by_index[len(emitted)])
        return emitted

    # --- recovery -------------------------------------------------------------
    def claim_orphans(self, max_count: int, min_idle_ms: int = 1000) -> list[Delivery]:
        """Take over up to `max_count` entries of dead workers (heartbeat hash expired).

        Only entries idle ≥ `min_idle_ms` move, so of two workers racing for an
        orphan only the first gets it. `deliveries` is the count after this claim.
        An entry whose data was deleted while pending comes back `lost`, with
        payload None: dead-letter it. Dead consumers left with nothing pending are
        removed from the group. A live worker's entries are never claimed."""
        claimed: list[Delivery] = []
        for band in self.bands:  # the highest band's orphans first
            left = max_count - len(claimed)
            if left <= 0:
                break
            try:
                claimed += claim_orphan_entries(
                    self.redis, self._claim, self.keys, band, self.worker, left, min_idle_ms
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
        call = RedeliverCall(
            stream=d.stream, worker=self.worker, entry_id=d.entry_id, now=timestamp()
        )
        return call.parse(_run(self._redeliver, call))

    def requeue(self, d: Delivery) -> str | None:
        """Put a held job this worker cannot start back at the tail of its band, for any
        worker (requeue.lua). Returns the new entry id, or None with nothing written when
        the entry is no longer this worker's or the job's."""
        assert d.job_id is not None, "requeue() needs the entry's job id"
        queued, running = self._tenant_keys(d)
        call = RequeueCall(
            stream=d.stream,
            hash=self.keys.job(d.job_id),
            queued=queued,
            running=running,
            worker=self.worker,
            entry_id=d.entry_id,
            now=timestamp(),
            job_id=d.job_id,
        )
        return call.parse(_run(self._requeue, call))

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
        terminal = None
        if finish is not None and result is not None:
            if result.job_id != finish.job_id:
                raise ValueError("result and finish event are for different jobs")
            terminal = Terminal(
                job=self._target(delivery, finish.job_id),
                finish=Finish(
                    reason=str(result.finish_reason),
                    result_data=encode(result),
                    finish_data=encode(finish),
                ),
            )
        call = DeadLetterCall(
            stream=delivery.stream,
            dead_letters=self.keys.dead_letters(delivery.band.partition),
            worker=self.worker,
            entry_id=delivery.entry_id,
            now=timestamp(),
            job_id=delivery.job_id or "",
            reason=reason,
            message=message,
            deliveries=delivery.deliveries,
            payload=delivery.payload or b"",
            lost=delivery.lost,
            terminal=terminal,
        )
        return call.parse(_run(self._dead_letter, call))

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
        target = pipe if pipe is not None else _stack(self.redis)
        target.hset(key, mapping={name: json.dumps(value) for name, value in fields.items()})
        target.expire(key, WORKER_TTL_S)
        if self.keys.is_tagged:  # the flags claim_orphans.lua reads, one per partition
            for p in self.keys.partitions_all:
                target.set(self.keys.alive(self.worker, p), 1, ex=WORKER_TTL_S)
        target.zadd(self.keys.workers(), {self.worker: time.time()})
        target.publish(self.keys.telemetry_channel(), json.dumps(fields))
        if pipe is None:  # sent as a round trip is (a cluster pipeline refuses PUBLISH)
            in_flight(self.redis, target).replies()

    def leave(self) -> None:
        """Clean exit: drop the heartbeat now, so entries left pending are claimable at once."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.worker))
        if self.keys.is_tagged:
            for p in self.keys.partitions_all:
                pipe.delete(self.keys.alive(self.worker, p))
        pipe.zrem(self.keys.workers(), self.worker)
        pipe.execute()


@dataclass(frozen=True)
class PullAsk:
    """What a round trip reads for the engine (pull.lua): up to `count` new entries,
    highest band first, `extra` more of the top band alone (jobs that would preempt
    lower bands running here), and one entry of each band in `floor` that has some."""

    count: int
    extra: int = 0
    floor: tuple[str, ...] = ()

    @property
    def reads(self) -> bool:
        return self.count > 0 or self.extra > 0 or bool(self.floor)


@dataclass(frozen=True)
class Replies:
    """A round trip's replies, by name. `tick` is tick.lua's verdict per write, in the
    order sent (None: the round trip had no writes, or they failed and go out again);
    `pulled` the entries read; `failures` the errors the caller must raise. A Redis that
    lost its scripts or its group (restarted empty) is handled here: the scripts are
    loaded, the group created, and the writes or the read go out again next time."""

    tick: list[TickReply] | None
    pulled: list[Delivery]
    failures: list[Exception]
    # durable mode: per write, whether the WAIT of the node it went to saw enough replicas
    replicated: list[bool] | None = None


class RoundTrip:
    """One tick's pipeline, sent and not yet read (see `WorkerQueue.send`): `order`, the
    writes each tick.lua call carries (one call per partition); `part`, the partition
    its pull read (None: no pull)."""

    def __init__(
        self,
        queue: WorkerQueue,
        call: InFlight | NodesInFlight,
        order: list[list[int]],
        part: int | None,
    ) -> None:
        self._queue = queue
        self._call = call
        self._order = order
        self._part = part
        self.wait_for = 0  # replicas the round trip's WAIT asked for (0: no WAIT)

    def replies(self) -> Replies:
        """Wait for the replies and name them (see `Replies`). When one partition's tick
        call failed, `tick` is None: every write goes out again (tick.lua appends only
        what a stream lacks, and a finished job's second terminal write is refused)."""
        got = iter(self._call.replies())
        tick: list[TickReply] | None = None
        pulled: list[Delivery] = []
        failures: list[Exception] = []
        replicated: list[bool] | None = None
        if self._order:
            by_write: dict[int, TickReply] = {}
            acked: dict[int, bool] = {}
            for command, indices in enumerate(self._order):  # the tick calls come first
                reply = next(got)
                if isinstance(reply, Exception):
                    failures.append(reply)  # the writes stay in the sessions: sent again
                    continue
                for i, verdict in zip(indices, self._queue.parse_tick(reply), strict=True):
                    by_write[i] = verdict
                if self.wait_for > 0:  # durable mode: did this call's node's WAIT suffice
                    enough = self._call.replicas(command) >= self.wait_for
                    acked.update(dict.fromkeys(indices, enough))
            if len(by_write) == sum(len(indices) for indices in self._order):
                tick = [by_write[i] for i in range(len(by_write))]
                if self.wait_for > 0:
                    replicated = [acked[i] for i in range(len(acked))]
        if self._part is not None:
            reply = next(got)
            if isinstance(reply, Exception):
                failures.append(reply)  # nothing was read: the next round trip reads
            else:
                pulled = self._queue.parse_pull(reply, self._part)
        failures += [r for r in got if isinstance(r, Exception)]  # the heartbeat's
        failures = [f for f in failures if not self._queue.recovered(f)]
        return Replies(tick, pulled, failures, replicated)

    def abandon(self) -> None:
        """Give it up (its connection was lost): what it carried goes out again."""
        self._call.abandon()


class InFlight:
    """A pipeline sent on a connection of its own whose replies are read later, so the
    caller computes while Redis works (redis-py's `execute` sends and reads in one go).
    Read it with `replies()` or give it up with `abandon()`: either returns the
    connection to the pool."""

    def __init__(self, client: redis.Redis, pipe: Any, wait: tuple[int, int] | None = None) -> None:
        self.client = client
        self.commands: list[tuple[tuple[Any, ...], dict[str, Any]]] = list(pipe.command_stack)
        # durable mode: WAIT last, on the connection that wrote (it waits for its writes)
        self._waits = wait is not None
        if wait is not None:
            self.commands.append((("WAIT", *wait), {}))
        self.acked = 0  # replicas the WAIT counted
        pool = client.connection_pool
        self.conn = pool.get_connection()
        try:
            self.conn.send_packed_command(_packed(self.conn, [args for args, _ in self.commands]))
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
        if self._waits:
            got = out.pop()
            self.acked = got if isinstance(got, int) else 0
        return out

    def replicas(self, command: int) -> int:
        """Replicas the round trip's WAIT counted (after `replies`)."""
        return self.acked

    def abandon(self) -> None:
        self.conn.disconnect()
        self.client.connection_pool.release(self.conn)


_CLUSTER_MOVES = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")


def _packed(conn: Any, commands: list[tuple[Any, ...]]) -> list[bytes]:
    """A round trip's commands in RESP, one buffer: hiredis packs each command in one call,
    where redis-py's packer first encodes argument by argument in Python (30 µs against
    4 µs for one held job's tick and pull, measured; it grows with the jobs held). The
    same bytes for the str, bytes, int and float arguments the scripts and commands here
    take. A command named in two words (redis-py splits "CLIENT SETNAME", hiredis would
    not) or an argument hiredis refuses (a bytearray) goes through redis-py's packer."""
    if any(" " in str(args[0]) for args in commands):
        return list(conn.pack_commands(commands))
    try:
        return [b"".join([hiredis.pack_command(tuple(args)) for args in commands])]
    except TypeError:
        return list(conn.pack_commands(commands))


def _stack(client: Any) -> Any:
    """A pipeline to queue a round trip's commands on (never executed itself: `in_flight`
    sends them). On a cluster, a plain one of a node's client: redis-py's cluster
    pipeline refuses EVALSHA (redis-py#2914), and the commands are split per node anyway."""
    if isinstance(client, RedisCluster):
        return client.get_default_node().redis_connection.pipeline(transaction=False)
    return client.pipeline(transaction=False)


def in_flight(
    client: Any, pipe: Any, wait: tuple[int, int] | None = None
) -> InFlight | NodesInFlight:
    """Send `pipe`'s commands now, to read their replies later: on one connection, or on
    a cluster one per node serving them (`wait`: each ending with WAIT replicas timeout)."""
    if isinstance(client, RedisCluster):
        return NodesInFlight(client, pipe, wait)
    return InFlight(client, pipe, wait)


@dataclass(frozen=True)
class _Commands:
    """A pipeline's part, as InFlight reads one."""

    command_stack: list[tuple[tuple[Any, ...], dict[str, Any]]]


class NodesInFlight:
    """A round trip on a Redis Cluster: the pipeline's commands split by the primary
    serving each one's slot (every script call's keys are in one slot: keys.py), sent to
    every node at once, one connection each; the replies come back in the pipeline's
    order. A reply of a slot that moved is a MOVED error (`WorkerQueue.recovered`)."""

    def __init__(
        self, client: RedisCluster, pipe: Any, wait: tuple[int, int] | None = None
    ) -> None:
        commands = list(pipe.command_stack)
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i, (args, _) in enumerate(commands):
            node = _node_of(client, args)
            by_node.setdefault(node.name, []).append(i)
            nodes[node.name] = node
        self.size = len(commands)
        self.parts: list[tuple[list[int], InFlight]] = []
        self._part_of: dict[int, InFlight] = {}
        try:
            for name, indices in by_node.items():
                part = _Commands([commands[i] for i in indices])
                sent = InFlight(nodes[name].redis_connection, part, wait)
                self.parts.append((indices, sent))
                self._part_of.update(dict.fromkeys(indices, sent))
        except BaseException:
            self.abandon()
            raise

    def replies(self) -> list[Any]:
        out: list[Any] = [None] * self.size
        for n, (indices, part) in enumerate(self.parts):
            try:
                got = part.replies()
            except BaseException:
                for _, rest in self.parts[n + 1 :]:  # their connections go back too
                    rest.abandon()
                raise
            for i, reply in zip(indices, got, strict=True):
                out[i] = reply
        return out

    def replicas(self, command: int) -> int:
        """Replicas the WAIT of the node that served command `command` counted."""
        return self._part_of[command].acked

    def abandon(self) -> None:
        for _, part in self.parts:
            part.abandon()


def _node_of(client: RedisCluster, args: tuple[Any, ...]) -> Any:
    """The primary a command goes to: its keys' slot's (a script call's first key), any
    for a command without keys (PUBLISH reaches every node of a cluster)."""
    name = str(args[0]).upper()
    if name in ("EVALSHA", "EVAL"):
        if int(args[2]) == 0:
            return client.get_default_node()
        slot = client.keyslot(args[3])
    elif name == "PUBLISH":
        return client.get_default_node()
    else:
        slot = client.determine_slot(*args)
    return client.nodes_manager.get_node_from_slot(slot)


def _by_partition(deliveries: Sequence[Delivery]) -> dict[int, list[tuple[int, Delivery]]]:
    """Deliveries by the partition their stream is of, each with its index, in order."""
    out: dict[int, list[tuple[int, Delivery]]] = {}
    for i, d in enumerate(deliveries):
        out.setdefault(d.band.partition, []).append((i, d))
    return out


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _named(reply: Any) -> list[tuple[str, Any, Any]]:
    """XREADGROUP's entries with the stream each came from: (stream, id, fields)."""
    if isinstance(reply, dict):
        pairs = [(name, entries) for name, nested in reply.items() for entries in nested]
    else:
        pairs = [(name, entries) for name, entries in reply or []]
    return [(_str(name), e[0], e[1]) for name, entries in pairs for e in entries]


def _run(script: Any, call: ScriptCall) -> Any:
    """Run a registered script with a call's keys and arguments."""
    return script(keys=call.keys(), args=call.args())


def _queue(pipe: Any, sha: str, call: ScriptCall) -> None:
    """Queue a loaded script's call on `pipe` by EVALSHA (see `tick`)."""
    script_keys = call.keys()
    pipe.evalsha(sha, len(script_keys), *script_keys, *call.args())
