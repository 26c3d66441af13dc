"""The gateway's settings: what its app runs with, and what `tokenfleet gateway` adds.

`GatewayConfig` is what `create_app` takes (tests build it directly; it reads no
environment). `GatewaySettings` is the same fields read from flags over
`$TOKENFLEET_GATEWAY_*` (and `$TOKENFLEET_API_KEYS`), plus where to listen.
docs/http.md lists the flags and variables.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from tokenfleet.config.common import Env, Flag, FleetConfig, Settings

MiB = 1024 * 1024


class GatewayConfig(FleetConfig):
    """How one gateway runs; validated once, here."""

    api_keys: Annotated[
        tuple[str, ...],
        Env("TOKENFLEET_API_KEYS", merged=True),
        Flag("--api-key"),
        Field(
            description="accepted bearer token: KEY, KEY=TENANT or KEY=TENANT:PRIORITY "
            "(priority: interactive, default or batch); repeatable; none: no auth, every "
            "request tenant 'default'"
        ),
    ] = ()
    retry_after_s: Annotated[
        int,
        Flag("--retry-after"),
        Field(ge=0, description="Retry-After seconds of a 429 (queue full)"),
    ] = 1
    wait_replicas: Annotated[
        int,
        Env("TOKENFLEET_WAIT_REPLICAS"),
        Flag("--wait-replicas"),
        Field(
            ge=0,
            le=16,
            description="durable submits, for a Redis with replicas: a request's job is "
            "acknowledged only once this many replicas hold it (else 503, Retry-After); 0: off",
        ),
    ] = 0
    default_max_tokens: Annotated[
        int,
        Flag("--default-max-tokens"),
        Field(ge=1, description="chat requests that name no max_tokens"),
    ] = 256
    job_timeout_s: Annotated[
        float | None,
        Flag("--job-timeout"),
        Field(gt=0, description="deadline of every job, seconds after submit"),
    ] = None
    queue_timeout_s: Annotated[
        float | None,
        Env("TOKENFLEET_GATEWAY_QUEUE_TIMEOUT"),
        Flag("--queue-timeout"),
        Field(
            ge=0,
            description="503 + Retry-After when no worker started a job within S seconds "
            "(it is cancelled); 0 = wait forever",
        ),
    ] = 30.0
    max_body_bytes: Annotated[
        int,
        Env("TOKENFLEET_GATEWAY_MAX_BODY_BYTES"),
        Flag("--max-body-bytes"),
        Field(ge=1024, description="413 for a bigger request body, unread"),
    ] = 4 * MiB
    redis_connections: Annotated[
        int,
        Env("TOKENFLEET_GATEWAY_REDIS_CONNECTIONS"),
        Flag("--redis-connections"),
        Field(ge=2, description="command connections to Redis; requests wait for one"),
    ] = 64
    pubsub_connections: Annotated[
        int,
        Env("TOKENFLEET_GATEWAY_PUBSUB_CONNECTIONS"),
        Flag("--pubsub-connections"),
        Field(ge=1, description="pub/sub connections every stream's events share"),
    ] = 2
    keepalive_s: Annotated[
        float,
        Env("TOKENFLEET_GATEWAY_KEEPALIVE"),
        Flag("--keepalive"),
        Field(gt=0, description="an SSE keep-alive comment after S seconds without an event"),
    ] = 15.0
    max_file_bytes: Annotated[
        int,
        Env("TOKENFLEET_GATEWAY_MAX_FILE_BYTES"),
        Field(ge=1, description="one /v1/files upload (kept in Redis)"),
    ] = 32 * MiB
    batches: Annotated[
        bool, Field(description="drive /v1/batches from this gateway (any replica may)")
    ] = True
    batch_max_in_flight: Annotated[
        int,
        Env("TOKENFLEET_GATEWAY_BATCH_MAX_IN_FLIGHT"),
        Field(ge=1, description="jobs one batch has out at once"),
    ] = 64
    batch_queue_share: Annotated[
        float,
        Field(gt=0, le=1, description="a batch submits only while its queue is under this share"),
    ] = 0.5
    batch_lease_s: Annotated[
        float,
        Env("TOKENFLEET_GATEWAY_BATCH_LEASE_S"),
        Field(gt=0, description="a batch whose gateway died is picked up after this long"),
    ] = 15.0
    fleet_cache_s: Annotated[
        float, Field(ge=0, description="how long a read of the workers' heartbeats is reused")
    ] = 1.0
    redis_wait_s: Annotated[
        float, Field(gt=0, description="how long a command waits for a pooled connection")
    ] = 30.0
    redis_outage_s: Annotated[
        float, Field(ge=0, description="how long a stream outlives a Redis outage")
    ] = 60.0
    cancel_retry_s: Annotated[
        float, Field(ge=0, description="how long a cancel that failed on Redis is retried")
    ] = 300.0
    response_ttl_s: Annotated[
        int,
        Env("TOKENFLEET_GATEWAY_RESPONSE_TTL_S"),
        Field(ge=1, description="how long a stored /v1/responses response is kept"),
    ] = 24 * 3600  # keys.RESPONSE_TTL_S (not imported: `--help` stays fast)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _each_key_once(cls, entries: Any) -> Any:
        """Entries stripped, empty ones dropped, repeats once (flags first, then the
        variable's). Each is parsed where it is used (`gateway.auth.parse_api_keys`, when
        the app is built: a bad one stops the start naming its position, never its key)."""
        if isinstance(entries, str):
            entries = entries.split(",")
        if not isinstance(entries, list | tuple):
            return entries  # the tuple type refuses it
        stripped = (e.strip() if isinstance(e, str) else e for e in entries)
        return tuple(dict.fromkeys(e for e in stripped if e != ""))

    @field_validator("default_max_tokens")
    @classmethod
    def _fits_a_job(cls, tokens: int) -> int:
        from tokenfleet.protocol import MAX_NEW_TOKENS  # not at import: `--help` stays fast

        if tokens > MAX_NEW_TOKENS:
            raise ValueError(f"at most {MAX_NEW_TOKENS} (a job's max_new_tokens)")
        return tokens

    @field_validator("queue_timeout_s")
    @classmethod
    def _zero_is_forever(cls, seconds: float | None) -> float | None:
        return seconds or None


class GatewaySettings(Settings, GatewayConfig):
    """`tokenfleet gateway`: a `GatewayConfig` from flags over the environment, and
    where to listen. Without API keys it binds only a loopback address, unless
    `insecure_no_auth`."""

    model_config = Settings.model_config

    host: Annotated[str, Flag("--host"), Field(description="address to bind")] = "127.0.0.1"
    port: Annotated[int, Flag("--port"), Field(description="TCP port")] = 8000
    insecure_no_auth: Annotated[
        bool,
        Flag("--insecure-no-auth"),
        Field(description="allow a non-loopback --host without API keys"),
    ] = False
    log_level: Annotated[str, Flag("--log-level"), Field(description="uvicorn log level")] = "info"
