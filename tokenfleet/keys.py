"""Every Redis key and channel tokenfleet uses, with its lifetime beside it.

No other module builds key strings. All keys live under one prefix (default
``tokenfleet:``) so several fleets can share a Redis. A job may name a model:
each model has its own jobs stream (``<prefix>jobs:<model>``; jobs that name
none go to ``<prefix>jobs:default``), so a mixed fleet routes by model without
a key migration. Each model's queue has three priority bands, one stream each:
``jobs:<model>@interactive``, ``jobs:<model>`` (the default band, the stream a
fleet had before bands existed) and ``jobs:<model>@batch``; workers pull the
highest band first (lua/pull.lua).

Every job belongs to a tenant (``default`` unless it names one). A tenant's queued
and running jobs of a model are sorted sets of job ids, so their limits are checked
in the same script that adds or starts the job, and a job counted twice is counted once.

Partitions (Redis Cluster): every script call touches the keys of ONE hash slot, so a
fleet that spreads over a cluster splits each model's queue into `partitions` P. A job
lives in partition `crc32(job id) mod P` (`partition_of`: its id says where, so an
idempotent resubmit finds it), and every key a script touches for it carries the
partition's hash tag ``{pN}``: the band streams and their cap and guard counts, the
job's own keys, its tenant's sets and limits, the dead letters. With P = 1 on a single
Redis (the default) no key has a tag: the names are those of a fleet before partitions
(``tagged`` forces tags with P = 1, for a cluster). The registries scripts write (models,
tenants) and what operators set for every partition (caps, tenant limits) have one copy
per partition; readers take partition 0's or the union (`partitions_all`).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Literal, get_args

DEFAULT_PREFIX = "tokenfleet:"
DEFAULT_MODEL = "default"

# Lifetimes, in seconds.
JOB_STATE_TTL_S = 7 * 24 * 3600  # job hash: refreshed on submit and finish; bounds idempotency
RESULT_TTL_S = 24 * 3600  # stored result, from finish
EVENTS_TTL_S = 24 * 3600  # per-job replay stream: set by its first event and by the finish
EVENTS_MAXLEN = 10_000  # replay stream entries kept (≥ MAX_NEW_TOKENS + 1)
CANCEL_TTL_S = 24 * 3600  # cancel flag
WORKER_TTL_S = 5  # worker hash = heartbeat: a worker silent this long is presumed dead
DEAD_LETTERS_MAXLEN = 100_000  # dead-letter stream, approximately trimmed (oldest go first)
RESPONSE_TTL_S = 24 * 3600  # a stored Responses API response, from when it is stored

# No ":" in job ids: per-job keys append ":suffix" to the id, so ids can't collide.
JOB_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
_JOB_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def valid_job_id(job_id: str) -> bool:
    return _JOB_ID_RE.fullmatch(job_id) is not None


def _checked(job_id: str) -> str:
    if not valid_job_id(job_id):
        raise ValueError(f"invalid job id {job_id!r}: it must match {JOB_ID_PATTERN}")
    return job_id


DEFAULT_QUEUE_CAP = 1000  # a jobs stream's cap until one is set; `$TOKENFLEET_QUEUE_CAP`
GROUP = "workers"  # the one consumer group every worker of a jobs stream joins

# The priority bands, highest first: the one place they are named. A job names one
# (`GenerationRequest.priority`); each is a jobs stream of its own (`Keys.bands`), and
# its place here is its rank (0 pulls, starts and preempts first). A new band goes in
# this Literal; the gateway's service_tier mapping (openai/models.py) says who asks for it.
Priority = Literal["interactive", "default", "batch"]
BANDS: tuple[Priority, ...] = get_args(Priority)
DEFAULT_BAND: Priority = "default"
# A band waiting while this many jobs were pulled from higher bands gets the next pull
# (lua/pull.lua): under a saturating higher band, each waiting band below still gets
# at least one pull in STARVATION_GUARD + 1.
STARVATION_GUARD = 16

DEFAULT_TENANT = "default"
TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
_TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Band:
    """One priority band of one model's queue: what a job asks for (`name`), where it
    stands (`rank`, its place in BANDS: 0 first) and the stream its jobs wait in (of
    queue partition `partition`)."""

    name: Priority
    rank: int
    stream: str
    partition: int = 0


def band_rank(name: str) -> int:
    """A band's rank; ValueError naming the bands for any other name."""
    if name not in BANDS:
        raise ValueError(f"unknown priority band {name!r}: one of {', '.join(BANDS)}")
    return BANDS.index(name)


def valid_tenant(name: str) -> bool:
    return _TENANT_RE.fullmatch(name) is not None


def _tenant(name: str) -> str:
    if not valid_tenant(name):
        raise ValueError(f"invalid tenant {name!r}: it must match {TENANT_PATTERN}")
    return name


MAX_PARTITIONS = 1024  # queue partitions of a fleet (one hash tag each)


@dataclass(frozen=True)
class Keys:
    """Key names for one fleet. `prefix` usually ends with ':'. `partitions`: how many
    parts each model's queue is split into (module docstring); `tagged`: hash-tag the
    partitioned keys even with one partition (a fleet on Redis Cluster)."""

    prefix: str = DEFAULT_PREFIX
    partitions: int = 1
    tagged: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be in 1..{MAX_PARTITIONS}, got {self.partitions}")
        if self.is_tagged and ("{" in self.prefix or "}" in self.prefix):
            raise ValueError(f"a partitioned fleet's prefix may not hold braces: {self.prefix!r}")

    @property
    def is_tagged(self) -> bool:
        """Whether partitioned keys carry a hash tag (a partitioned or clustered fleet)."""
        return self.tagged or self.partitions > 1

    def partition_of(self, job_id: str) -> int:
        """The queue partition a job lives in: crc32 (IEEE, zlib's) of its id's UTF-8
        bytes, mod `partitions`: any client in any language computes the same."""
        if self.partitions == 1:
            return 0
        return zlib.crc32(_checked(job_id).encode()) % self.partitions

    @property
    def partitions_all(self) -> range:
        return range(self.partitions)

    def _at(self, partition: int) -> str:
        """The prefix of partition `partition`'s keys: `<prefix>{pN}:` when tagged."""
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition {partition} is not in 0..{self.partitions - 1}")
        return f"{self.prefix}{{p{partition}}}:" if self.is_tagged else self.prefix

    def _of_job(self, job_id: str) -> str:
        return self._at(self.partition_of(job_id))

    # --- the queue -------------------------------------------------------
    def jobs(self, model: str | None = None, band: str = DEFAULT_BAND, partition: int = 0) -> str:
        """Stream of accepted, unfinished jobs of one priority band (of one partition). No
        TTL; never trimmed (XLEN = that band's depth). The default band has no suffix."""
        band_rank(band)  # a known band, or a named error
        base = f"{self._at(partition)}jobs:{model or DEFAULT_MODEL}"
        return base if band == DEFAULT_BAND else f"{base}@{band}"

    def bands(self, model: str | None = None, partition: int = 0) -> tuple[Band, ...]:
        """The model's bands (of one partition) with their jobs streams, highest first
        (the order workers pull in)."""
        return tuple(
            Band(name, rank, self.jobs(model, name, partition), partition)
            for rank, name in enumerate(BANDS)
        )

    def queue_cap(self, model: str | None = None, partition: int = 0) -> str:
        """String: the cap of each of the model's bands, shared by every producer (one
        copy per partition, each the cap of that partition's streams). No TTL; absent =
        default."""
        return f"{self.jobs(model, partition=partition)}:cap"

    def pulls(self, model: str | None = None, partition: int = 0) -> str:
        """Hash: band -> jobs pulled from higher bands while it waited (the starvation
        guard's count, lua/pull.lua; per partition). No TTL."""
        return f"{self._at(partition)}pulls:{model or DEFAULT_MODEL}"

    def models(self, partition: int = 0) -> str:
        """Set of model names that have had a jobs stream (per partition). No TTL."""
        return f"{self._at(partition)}models"

    # --- one job: all in its partition -------------------------------------
    def job(self, job_id: str) -> str:
        """Hash: status, stream, entry id, submitted_at, worker, finish reason. JOB_STATE_TTL_S."""
        return f"{self._of_job(job_id)}job:{_checked(job_id)}"

    def events(self, job_id: str) -> str:
        """Stream: the job's events (msgpack in field 'm'), for replay. EVENTS_TTL_S."""
        return f"{self.job(job_id)}:events"

    def channel(self, job_id: str) -> str:
        """Pub/sub channel: the same events, live (at most once). On a cluster (`tagged`)
        a shard channel (`sharded`): SPUBLISH / SSUBSCRIBE, served by its slot's node."""
        return f"{self.job(job_id)}:live"

    @property
    def sharded(self) -> bool:
        """Whether job channels are shard channels (Redis 7's sharded pub/sub): on a
        cluster, where a plain PUBLISH is broadcast to every node of the cluster."""
        return self.tagged

    @property
    def publish(self) -> str:
        """The command that publishes on a job channel: SPUBLISH when `sharded`."""
        return "SPUBLISH" if self.sharded else "PUBLISH"

    def result(self, job_id: str) -> str:
        """String: msgpack JobResult. RESULT_TTL_S."""
        return f"{self.job(job_id)}:result"

    def cancel(self, job_id: str) -> str:
        """String flag '1': the client asked to cancel. CANCEL_TTL_S."""
        return f"{self.job(job_id)}:cancel"

    # --- tenants -----------------------------------------------------------
    def tenant_queued(self, tenant: str, model: str | None = None, partition: int = 0) -> str:
        """Sorted set: the tenant's jobs of `model` waiting in a stream (id -> submit
        time), of one partition. Added by submit.lua, removed when a worker starts the
        job. No TTL."""
        return f"{self._at(partition)}tenant:{_tenant(tenant)}:queued:{model or DEFAULT_MODEL}"

    def tenant_running(self, tenant: str, model: str | None = None, partition: int = 0) -> str:
        """Sorted set: the tenant's jobs of `model` a worker has started and not finished
        (id -> start time), of one partition. Added by accept.lua, removed by the job's
        terminal write. No TTL."""
        return f"{self._at(partition)}tenant:{_tenant(tenant)}:running:{model or DEFAULT_MODEL}"

    def tenant_limits(self, tenant: str | None = None, partition: int = 0) -> str:
        """Hash: a tenant's limits (`queued_share`, `max_running`); None = the limits of
        every tenant without its own (`tenant:*:limits`). One copy per partition. No TTL;
        set by operators."""
        name = "*" if tenant is None else _tenant(tenant)
        return f"{self._at(partition)}tenant:{name}:limits"

    def tenants(self, partition: int = 0) -> str:
        """Set of tenant names that have submitted a job or been given limits (per
        partition). No TTL."""
        return f"{self._at(partition)}tenants"

    # --- the fleet -------------------------------------------------------
    def worker(self, name: str) -> str:
        """Hash: one worker's identity, budgets and telemetry. WORKER_TTL_S (its heartbeat)."""
        return f"{self.prefix}worker:{name}"

    def workers(self) -> str:
        """Sorted set: worker name → last heartbeat (unix s). No TTL; stale names are pruned."""
        return f"{self.prefix}workers"

    def probe(self, worker: str) -> str:
        """Prefix of the throwaway keys a worker's start-up permission check uses (deleted
        by the same script; EXPIRE 10 s on the ones that could outlive it)."""
        return f"{self._at(0)}probe:{worker}"  # one slot: probe.lua's keys together

    def telemetry_channel(self) -> str:
        """Pub/sub channel: every worker's telemetry, about once a second (JSON)."""
        return f"{self.prefix}telemetry"

    def dead_letters(self, partition: int = 0) -> str:
        """Stream: jobs/entries that could not be served, with the reason (per partition).
        ~DEAD_LETTERS_MAXLEN."""
        return f"{self._at(partition)}dead"

    def alive(self, worker: str, partition: int = 0) -> str:
        """A worker's heartbeat as claim_orphans.lua reads it: the worker hash itself, or,
        in a tagged fleet (where a script may touch one slot only), a flag per partition
        the heartbeat refreshes with it. WORKER_TTL_S."""
        if not self.is_tagged:
            return self.worker(worker)
        return f"{self._at(partition)}alive:{worker}"

    # --- the Batch API's files and batches (batch/store.py) -----------------
    # Ids are the store's (`file_…`, `batch_…`) or what a client asked for: unchecked, so
    # an id that cannot exist is simply not found. None of these keys has a TTL.
    def file(self, file_id: str) -> str:
        """Hash: `doc`, the file object (JSON, with its owning tenant). Deleted with the file."""
        return f"{self.prefix}file:{file_id}"

    def file_content(self, file_id: str) -> str:
        """String: the file's bytes (at most the gateway's max_file_bytes)."""
        return f"{self.file(file_id)}:content"

    def files(self, tenant: str | None = None) -> str:
        """Sorted set: file ids by creation time, of every tenant (None) or of `tenant`."""
        if tenant is None:
            return f"{self.prefix}files"
        return f"{self.prefix}files:by-tenant:{tenant}"

    def batch(self, batch_id: str) -> str:
        """Hash: `doc`, the batch object (JSON, with the driver's `tokenfleet_*` fields), and
        `cancel` ("1" once a cancel was asked for)."""
        return f"{self.prefix}batch:{batch_id}"

    def batch_results(self, batch_id: str) -> str:
        """Hash: line index -> its output or error line (JSON), as lines end. Deleted when
        the batch ends (its lines are in its output and error files then)."""
        return f"{self.batch(batch_id)}:results"

    def batch_lease(self, batch_id: str) -> str:
        """String: the gateway driving the batch (lua/lease.lua). PX the store's lease
        (batch/store.py LEASE_MS, `GatewayConfig.batch_lease_s`), renewed by its driver."""
        return f"{self.batch(batch_id)}:lease"

    def batches(self, tenant: str | None = None) -> str:
        """Sorted set: batch ids by creation time, of every tenant (None) or of `tenant`."""
        if tenant is None:
            return f"{self.prefix}batches"
        return f"{self.prefix}batches:by-tenant:{tenant}"

    def open_batches(self) -> str:
        """Set: the batches not finished yet (what every gateway's driver looks at)."""
        return f"{self.prefix}batches:open"

    # --- the Responses API's stored responses (gateway/response_store.py) ------------
    def response(self, response_id: str) -> str:
        """String: a finished response (JSON: the Response object, the conversation it
        ended, its owning tenant). EX `GatewayConfig.response_ttl_s` (RESPONSE_TTL_S by
        default), from when it was stored; ids are the store's (`resp_JOBID`)."""
        return f"{self.prefix}response:{response_id}"
