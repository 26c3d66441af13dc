"""One typed call per Lua script: its KEYS and ARGV by name, in the script's order, and
its reply read back by name.

A call is a frozen, keyword-only dataclass. `KEYS` and `ARGV` list the script's slots as
paths into its fields (notation: tokenfleet/lua/layout.py), `keys()` and `args()` flatten
them, and `parse` reads the script's reply. The script's header names the same paths at
the same positions; tests/test_lua_contracts.py checks that the two agree. Callers pass
names, never positions:

    call = RedeliverCall(stream=d.stream, worker=name, entry_id=d.entry_id, now=timestamp())
    count = RedeliverCall.parse(script(keys=call.keys(), args=call.args()))

Replies arrive as bytes (clients with decode_responses=False) or str; `parse` takes both.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from tokenfleet.keys import (
    BANDS,
    DEAD_LETTERS_MAXLEN,
    EVENTS_MAXLEN,
    EVENTS_TTL_S,
    GROUP,
    JOB_STATE_TTL_S,
    RESULT_TTL_S,
)
from tokenfleet.lua.layout import ScriptArg, ScriptCall


def timestamp(at: float | None = None) -> str:
    """`now` as every script takes it: unix seconds, to the microsecond."""
    return f"{time.time() if at is None else at:.6f}"


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(flat: Any) -> dict[Any, Any]:
    """A stream entry's flat [f1, v1, f2, v2, ...] list as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


# --- submit.lua (producers) -------------------------------------------------------


class SubmitAnswer(NamedTuple):
    """submit.lua's reply: `verdict` ok | dup | full | tenant_full, with `entry_id` (ok,
    dup), `status` (dup: the job's), `held` and `limit` (full: the band's depth and cap;
    tenant_full: the tenant's queued jobs and its limit)."""

    verdict: str
    entry_id: str = ""
    status: str = ""
    held: int = 0
    limit: int = 0


@dataclass(frozen=True, kw_only=True)
class SubmitCall(ScriptCall):
    SCRIPT = "submit"
    KEYS = ("stream", "cap", "hash", "models", "queued", "limits", "default_limits", "tenants")
    ARGV = ("job_id", "payload", "default_cap", "now", "hash_ttl", "model", "tenant", "band")

    stream: str
    cap: str
    hash: str
    models: str
    queued: str
    limits: str
    default_limits: str
    tenants: str
    job_id: str
    payload: bytes | str
    default_cap: int
    now: str
    model: str
    tenant: str
    band: str
    hash_ttl: int = JOB_STATE_TTL_S

    @staticmethod
    def parse(reply: Any) -> SubmitAnswer:
        verdict = _str(reply[0])
        if verdict in ("full", "tenant_full"):
            return SubmitAnswer(verdict, held=int(reply[1]), limit=int(reply[2]))
        if verdict == "dup":
            return SubmitAnswer(verdict, _str(reply[1]), _str(reply[2]))
        assert verdict == "ok", f"unexpected submit.lua reply {reply!r}"
        return SubmitAnswer(verdict, _str(reply[1]))


# --- the terminal block: tick.lua and dead_letter.lua -----------------------------


@dataclass(frozen=True, kw_only=True)
class JobTarget:
    """Where one job's writes go: its keys, its live channel and its id (owned_entry.lua's
    terminal_writes takes these by the same names)."""

    result: str  # keys.result(job_id)
    hash: str  # keys.job(job_id)
    events: str  # keys.events(job_id)
    queued: str  # keys.tenant_queued(tenant, model)
    running: str  # keys.tenant_running(tenant, model)
    channel: str  # keys.channel(job_id): a channel, not a key
    job_id: str
    publish: str = "PUBLISH"  # keys.publish: SPUBLISH for a shard channel (a cluster)


@dataclass(frozen=True, kw_only=True)
class Finish:
    """What a job ends with."""

    reason: str  # str(result.finish_reason)
    result_data: bytes  # encode(JobResult)
    finish_data: bytes  # encode(FinishEvent)


@dataclass(frozen=True, kw_only=True)
class Retention:
    """How long a job's terminal writes are kept."""

    result_ttl: int = RESULT_TTL_S
    hash_ttl: int = JOB_STATE_TTL_S
    maxlen: int = EVENTS_MAXLEN  # replay stream, approximate
    events_ttl: int = EVENTS_TTL_S


@dataclass(frozen=True, kw_only=True)
class Terminal:
    """A job's terminal writes, whole (dead_letter.lua's optional block)."""

    job: JobTarget
    finish: Finish
    retention: Retention = field(default_factory=Retention)


# --- tick.lua ---------------------------------------------------------------------


class TickVerdict(StrEnum):
    """What tick.lua says of one held job (see the script)."""

    OK = "ok"
    CANCEL = "cancel"
    DONE = "done"
    LOST = "lost"
    GAP = "gap"


@dataclass(frozen=True)
class TickReply:
    verdict: TickVerdict
    next_index: int  # indices the job's replay stream holds now


@dataclass(frozen=True, kw_only=True)
class TokenWrite:
    index: int
    data: bytes  # encode(TokenEvent)


@dataclass(frozen=True, kw_only=True)
class TickJob:
    """One held job's part of a tick: its delivery, its new token events, and its
    finish when it ends this tick."""

    stream: str  # the jobs stream its entry came from
    cancel: str  # keys.cancel(job_id)
    entry_id: str
    job: JobTarget
    tokens: list[TokenWrite]
    end: Finish | None = None
    # durable mode (a fleet with replicas): the indices a replica holds, and the events
    # that became durable since the last announce (published now); -1: a plain tick
    durable: int = -1
    announce: bytes = b""

    @property
    def count(self) -> int:
        return len(self.tokens)

    @property
    def ends(self) -> bool:
        return self.end is not None


@dataclass(frozen=True, kw_only=True)
class TickCall(ScriptCall):
    SCRIPT = "tick"
    KEYS = (
        "held[].stream",
        "held[].job.hash",
        "held[].job.events",
        "held[].job.result",
        "held[].cancel",
        "held[].job.queued",
        "held[].job.running",
    )
    ARGV = (
        "group",
        "worker",
        "no_entry",
        "now",
        "retention.maxlen",
        "retention.events_ttl",
        "retention.result_ttl",
        "retention.hash_ttl",
        "n",
        "held[].entry_id",
        "held[].job.job_id",
        "held[].job.channel",
        "held[].job.publish",
        "held[].durable",
        "held[].announce",
        "held[].count",
        "held[].ends",
        "held[].tokens[].index",
        "held[].tokens[].data",
        "held[].end?.reason",
        "held[].end?.result_data",
        "held[].end?.finish_data",
    )

    worker: str
    now: str
    held: list[TickJob]
    group: str = GROUP
    retention: Retention = field(default_factory=Retention)
    no_entry: str = ""  # ARGV[3]: the entry ids are per job

    @property
    def n(self) -> int:
        return len(self.held)

    @staticmethod
    def parse(reply: Any) -> list[TickReply]:
        return [TickReply(TickVerdict(_str(v)), int(n)) for v, n in reply]


# --- accept.lua -------------------------------------------------------------------


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


@dataclass(frozen=True, kw_only=True)
class AcceptEntry:
    stream: str  # the jobs stream it was read from
    hash: str  # keys.job(job_id)
    cancel: str  # keys.cancel(job_id)
    queued: str  # keys.tenant_queued(tenant, model)
    running: str  # keys.tenant_running(tenant, model)
    limits: str  # keys.tenant_limits(tenant)
    default_limits: str  # keys.tenant_limits(None)
    entry_id: str
    job_id: str


@dataclass(frozen=True, kw_only=True)
class AcceptCall(ScriptCall):
    SCRIPT = "accept"
    KEYS = (
        "entries[].stream",
        "entries[].hash",
        "entries[].cancel",
        "entries[].queued",
        "entries[].running",
        "entries[].limits",
        "entries[].default_limits",
    )
    ARGV = ("group", "worker", "no_entry", "now", "entries[].entry_id", "entries[].job_id")

    worker: str
    now: str
    entries: list[AcceptEntry]
    group: str = GROUP
    no_entry: str = ""  # ARGV[3]: the entry ids are per entry

    @staticmethod
    def parse(reply: Any) -> list[Accepted]:
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


# --- pull.lua ---------------------------------------------------------------------


class Pulled(NamedTuple):
    """One entry pull.lua read: its band's index (0 = highest), id and fields."""

    band: int
    entry_id: str
    fields: dict[Any, Any]


@dataclass(frozen=True, kw_only=True)
class PullBand:
    stream: str  # keys.jobs(model, band)
    name: str  # the band
    floor: bool = False  # take one of it if one waits, room or not (worker/bands.py)


@dataclass(frozen=True, kw_only=True)
class PullCall(ScriptCall):
    SCRIPT = "pull"
    KEYS = ("bands[].stream", "pulls")
    ARGV = (
        "group",
        "worker",
        "count",
        "guard",
        "bands[].name",
        "extra",
        "bands[].floor",
        "ceiling",
    )

    worker: str
    bands: list[PullBand]  # every band of the model, highest first
    pulls: str  # keys.pulls(model): the starvation guard's counts
    count: int
    guard: int  # keys.STARVATION_GUARD
    extra: int = 0
    # the lowest band index taken by rank (a higher band waits in another partition);
    # len(BANDS): none held back
    ceiling: int = len(BANDS)
    group: str = GROUP

    @staticmethod
    def parse(reply: Any) -> list[Pulled]:
        return PullCall.parse_with_top(reply)[0]

    @staticmethod
    def parse_with_top(reply: Any) -> tuple[list[Pulled], int | None]:
        """The entries pulled, and the highest band index still waiting in the partition
        (None: not looked at all the bands)."""
        pulled, top = reply if reply else ([], None)
        entries = [Pulled(int(b), _str(entry), _fields(flat)) for b, entry, flat in pulled or []]
        return entries, None if top is None else int(top)


# --- claim_orphans.lua ------------------------------------------------------------


class Claimed(NamedTuple):
    """One entry claim_orphans.lua took: its delivery count after the claim, and its
    fields, or None when its data was deleted while pending (taken off the list)."""

    entry_id: str
    deliveries: int
    fields: dict[Any, Any] | None


@dataclass(frozen=True, kw_only=True)
class Candidate:
    hash: str  # keys.worker(name): gone when the worker is presumed dead
    name: str  # its consumer name


@dataclass(frozen=True, kw_only=True)
class ClaimOrphansCall(ScriptCall):
    SCRIPT = "claim_orphans"
    KEYS = ("stream", "candidates[].hash")
    ARGV = ("group", "worker", "min_idle_ms", "most", "candidates[].name")

    stream: str
    worker: str
    candidates: list[Candidate]
    min_idle_ms: int
    most: int
    group: str = GROUP

    @staticmethod
    def parse(reply: Any) -> list[Claimed]:
        return [
            Claimed(_str(entry), int(deliveries), _fields(flat) if flat else None)
            for entry, deliveries, flat in reply
        ]


# --- the other scripts on an owned entry ------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DeadLetterCall(ScriptCall):
    SCRIPT = "dead_letter"
    KEYS = (
        "stream",
        "dead_letters",
        "terminal?.job.result",
        "terminal?.job.hash",
        "terminal?.job.events",
        "terminal?.job.queued",
        "terminal?.job.running",
    )
    ARGV = (
        "group",
        "worker",
        "entry_id",
        "now",
        "job_id",
        "reason",
        "message",
        "deliveries",
        "payload",
        "maxlen",
        "lost",
        "terminal?.finish.result_data",
        "terminal?.retention.result_ttl",
        "terminal?.finish.reason",
        "terminal?.retention.hash_ttl",
        "terminal?.finish.finish_data",
        "terminal?.retention.maxlen",
        "terminal?.retention.events_ttl",
        "terminal?.job.channel",
        "terminal?.job.job_id",
        "terminal?.job.publish",
    )

    stream: str
    dead_letters: str  # keys.dead_letters()
    worker: str
    entry_id: str
    now: str
    job_id: str  # '' when unknown
    reason: str
    message: str
    deliveries: int
    payload: bytes  # b'' when unknown
    lost: bool = False  # Delivery.lost
    terminal: Terminal | None = None
    maxlen: int = DEAD_LETTERS_MAXLEN
    group: str = GROUP

    @staticmethod
    def parse(reply: Any) -> bool:
        return bool(reply)


@dataclass(frozen=True, kw_only=True)
class RedeliverCall(ScriptCall):
    SCRIPT = "redeliver"
    KEYS = ("stream",)
    ARGV = ("group", "worker", "entry_id", "now")

    stream: str
    worker: str
    entry_id: str
    now: str
    group: str = GROUP

    @staticmethod
    def parse(reply: Any) -> int | None:
        return None if reply is None else int(reply)


@dataclass(frozen=True, kw_only=True)
class RequeueCall(ScriptCall):
    SCRIPT = "requeue"
    KEYS = ("stream", "hash", "queued", "running")
    ARGV = ("group", "worker", "entry_id", "now", "job_id")

    stream: str
    hash: str  # keys.job(job_id)
    queued: str  # keys.tenant_queued(tenant, model)
    running: str  # keys.tenant_running(tenant, model)
    worker: str
    entry_id: str
    now: str
    job_id: str
    group: str = GROUP

    @staticmethod
    def parse(reply: Any) -> str | None:
        return _str(reply) if reply else None


# --- probe.lua, lease.lua ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ProbeCall(ScriptCall):
    SCRIPT = "probe"
    KEYS = ("stream", "hash", "string", "zset")
    ARGV = ("group", "worker", "channel")

    stream: str
    hash: str
    string: str
    zset: str
    worker: str
    channel: str  # a channel under the prefix (keys.telemetry_channel())
    group: str = GROUP

    @staticmethod
    def parse(reply: Any) -> list[str]:
        return [_str(name) for name in reply]


@dataclass(frozen=True, kw_only=True)
class LeaseCall(ScriptCall):
    SCRIPT = "lease"
    KEYS = ("lease",)
    ARGV = ("owner", "ms", "action")

    lease: str  # P batch:ID:lease
    owner: str
    ms: int
    action: Literal["take", "release"]

    @staticmethod
    def parse(reply: Any) -> bool:
        return bool(reply)


CALLS: Mapping[str, type[ScriptCall]] = MappingProxyType(
    {
        call.SCRIPT: call
        for call in (
            SubmitCall,
            AcceptCall,
            TickCall,
            DeadLetterCall,
            RedeliverCall,
            RequeueCall,
            PullCall,
            ClaimOrphansCall,
            ProbeCall,
            LeaseCall,
        )
    }
)

__all__ = [
    "CALLS",
    "AcceptCall",
    "AcceptEntry",
    "Accepted",
    "Candidate",
    "ClaimOrphansCall",
    "Claimed",
    "DeadLetterCall",
    "Finish",
    "JobTarget",
    "LeaseCall",
    "ProbeCall",
    "PullBand",
    "PullCall",
    "Pulled",
    "RedeliverCall",
    "RequeueCall",
    "Retention",
    "ScriptArg",
    "ScriptCall",
    "SubmitAnswer",
    "SubmitCall",
    "Terminal",
    "TickCall",
    "TickJob",
    "TickReply",
    "TickVerdict",
    "TokenWrite",
    "Verdict",
    "timestamp",
]
