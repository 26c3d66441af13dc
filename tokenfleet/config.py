"""Settings read once at the edge (CLI, worker start-up), never deep in the code.

Environment: `TOKENFLEET_*` (e.g. `TOKENFLEET_PREFIX`, `TOKENFLEET_MODEL`,
`TOKENFLEET_GATEWAY_QUEUE_TIMEOUT`) and `REDIS_URL` (also `rediss://` and URLs
with a password). A command-line flag given takes precedence over its setting.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_", extra="ignore", frozen=True)

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("TOKENFLEET_REDIS_URL", "REDIS_URL"),
        description="redis:// or rediss:// URL, with password if any",
    )
    prefix: str = Field(default="tokenfleet:", min_length=1, max_length=64)
    # `tokenfleet worker`'s defaults for --model, --device and --dtype (`up` too);
    # load_model checks device and dtype when the worker starts
    model: str = Field(default="tiny-random", description="preset name or checkpoint folder")
    device: str = Field(default="auto", description="cpu, cuda, cuda:N; auto: cuda if available")
    dtype: str = Field(
        default="auto", description="auto (bfloat16 where native), float32, bfloat16 or float16"
    )
    quant: str | None = Field(default=None, description="int8 or int4 weights (CPU); none: dense")
    compile: bool | None = Field(
        default=None,
        description="compile the forward's row-wise parts; unset: only with --quant "
        "(where it was measured faster)",
    )
    prefix_cache: bool = Field(
        default=True, description="share full KV blocks between jobs with the same prefix"
    )
    queue_cap: int = Field(default=1000, ge=1, description="default jobs-stream cap")

    # the gateway (`tokenfleet gateway`; its flags take precedence): TOKENFLEET_GATEWAY_*
    gateway_queue_timeout: float = Field(
        default=30.0, ge=0, description="seconds a job may wait for a worker; 0 = forever"
    )
    gateway_max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    gateway_batch_max_in_flight: int = Field(default=64, ge=1, description="jobs per batch out")
    gateway_batch_lease_s: float = Field(
        default=15.0, gt=0, description="a batch whose gateway died is resumed after this"
    )
    gateway_max_file_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1, description="one /v1/files upload (stored in Redis)"
    )
    gateway_redis_connections: int = Field(default=64, ge=2, description="command pool size")
    gateway_pubsub_connections: int = Field(default=2, ge=1)
    gateway_keepalive: float = Field(default=15.0, gt=0, description="SSE keep-alive, seconds")
