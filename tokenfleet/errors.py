"""Named exceptions a user of tokenfleet can meet.

Internal invariants use `assert`; everything a caller can trigger by input,
load or timing raises one of these.
"""

from __future__ import annotations


class TokenfleetError(Exception):
    """Base class of every error tokenfleet raises on purpose."""


class ProtocolError(TokenfleetError):
    """A payload could not be decoded into a valid message.

    `reason` is a stable lowercase string (see `protocol.DecodeReason`);
    `job_id` is set when the job id could still be read, so the job's client
    can be told.
    """

    def __init__(self, reason: str, message: str, job_id: str | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.job_id = job_id


class QueueFull(TokenfleetError):
    """The jobs stream already holds `cap` accepted, unfinished jobs: back off and retry."""

    def __init__(self, depth: int, cap: int, stream: str) -> None:
        super().__init__(f"queue {stream} is full: {depth} jobs waiting or running, cap {cap}")
        self.depth = depth
        self.cap = cap
        self.stream = stream


class TenantQueueFull(QueueFull):
    """The job's tenant already has `depth` jobs of this model queued, its limit `cap`
    (its `queued_share` of the queue cap): other tenants may still submit."""

    def __init__(self, tenant: str, depth: int, cap: int, stream: str) -> None:
        TokenfleetError.__init__(
            self,
            f"tenant {tenant!r} is at its queued-jobs limit on {stream}: "
            f"{depth} of its jobs waiting, limit {cap}",
        )
        self.depth = depth
        self.cap = cap
        self.stream = stream
        self.tenant = tenant


class NotReplicated(TokenfleetError):
    """A submit the primary accepted but fewer replicas than asked acknowledged in time
    (a producer with `wait_replicas`): the job is queued, but a failover now could lose
    it. Submitting the same id again is safe (idempotent) and waits again."""

    def __init__(self, job_id: str, acked: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(
            f"job {job_id}: queued on the primary, but {acked} of {wanted} replica(s) "
            f"acknowledged it within {timeout_ms} ms; submit the same id again"
        )
        self.job_id = job_id
        self.acked = acked
        self.wanted = wanted


class JobRejected(TokenfleetError):
    """The fleet refused the job (admission, invalid input); nothing was generated."""

    def __init__(self, job_id: str, reason: str, message: str) -> None:
        super().__init__(f"job {job_id} rejected ({reason}): {message}")
        self.job_id = job_id
        self.reason = reason
        self.message = message


class JobFailed(TokenfleetError):
    """The job ended with an error (engine failure, dead-lettered after retries)."""

    def __init__(self, job_id: str, reason: str, message: str) -> None:
        super().__init__(f"job {job_id} failed ({reason}): {message}")
        self.job_id = job_id
        self.reason = reason
        self.message = message


class JobTimeout(TokenfleetError):
    """Waiting for a job's events or result took longer than the caller allowed."""

    def __init__(self, job_id: str, timeout: float) -> None:
        super().__init__(f"job {job_id}: no result within {timeout:g}s")
        self.job_id = job_id
        self.timeout = timeout


class JobNotFound(TokenfleetError):
    """No job with this id is known to the fleet (never submitted, or its records expired)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} is not known (never submitted, or expired)")
        self.job_id = job_id


class JobLost(TokenfleetError):
    """The fleet lost the job's state while the caller followed it (e.g. Redis restarted
    without persistence): it will never finish. Submit it again."""

    def __init__(self, job_id: str, detail: str = "") -> None:
        message = f"job {job_id} was lost by the fleet (its state is gone from Redis)"
        super().__init__(f"{message}: {detail}" if detail else message)
        self.job_id = job_id


class ModelLoadError(TokenfleetError):
    """A model folder or preset could not be loaded (missing files, unsupported architecture)."""


class ModelConfigError(ModelLoadError, ValueError):
    """A model config is malformed or describes something this engine cannot run."""


class InvalidRequest(TokenfleetError, ValueError):
    """A request failed validation before reaching Redis; the message names the field."""


class RedisServerNotFound(TokenfleetError):
    """A local fleet (`tokenfleet demo`, `up --embedded`) runs the real redis-server, and
    it is not on PATH (or, for a local Redis Cluster, `redis-cli` is not: `binary`)."""

    def __init__(self, binary: str = "redis-server") -> None:
        package = "redis-tools" if binary == "redis-cli" else "redis-server"
        super().__init__(
            f"{binary} is not on PATH: install it (Debian/Ubuntu: apt-get install"
            f" {package}; macOS: brew install redis) or point --redis-url at a running Redis"
        )
        self.binary = binary


class InvalidRedisUrl(TokenfleetError, ValueError):
    """A Redis URL tokenfleet cannot connect with: an unknown scheme, or a cluster URL
    (`redis+cluster://`, `rediss+cluster://`) with no host, a bad port or a db other than
    0. The message names the part; it never repeats the URL (which may hold a password)."""
