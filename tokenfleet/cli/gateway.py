"""`tokenfleet gateway`: serve the OpenAI-compatible HTTP API.

API keys come from `--api-key` (repeatable) and `$TOKENFLEET_API_KEYS`
(comma-separated), read here at the edge; each is `KEY`, `KEY=TENANT` or
`KEY=TENANT:PRIORITY` (gateway/auth.py), and a bad one stops the start naming its
position, never the key. The limits (queue timeout, body size,
connections, keep-alive) default to `Settings` (`$TOKENFLEET_GATEWAY_*`); a flag
given takes precedence. Without a key the gateway only binds a
loopback address, unless `--insecure-no-auth` says otherwise.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Annotated, Any

import typer

from tokenfleet.cli.common import Prefix, RedisUrl, fail, settings

API_KEYS_ENV = "TOKENFLEET_API_KEYS"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def api_keys_from(flags: list[str] | None, env: str | None) -> tuple[str, ...]:
    keys = [k.strip() for k in (flags or [])]
    keys += [k.strip() for k in (env or "").split(",")]
    return tuple(dict.fromkeys(k for k in keys if k))


def gateway(
    host: Annotated[str, typer.Option("--host", help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port")] = 8000,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            help="accepted bearer token: KEY, KEY=TENANT or KEY=TENANT:PRIORITY (priority: "
            f"interactive, default or batch); repeatable; also ${API_KEYS_ENV}, comma-separated",
        ),
    ] = None,
    insecure_no_auth: Annotated[
        bool,
        typer.Option("--insecure-no-auth", help="allow a non-loopback --host without API keys"),
    ] = False,
    retry_after: Annotated[
        int, typer.Option("--retry-after", help="Retry-After seconds of a 429 (queue full)")
    ] = 1,
    default_max_tokens: Annotated[
        int, typer.Option("--default-max-tokens", help="chat requests that name no max_tokens")
    ] = 256,
    job_timeout: Annotated[
        float | None,
        typer.Option("--job-timeout", help="deadline of every job, seconds after submit"),
    ] = None,
    queue_timeout: Annotated[
        float | None,
        typer.Option(
            "--queue-timeout",
            help="503 + Retry-After when no worker started a job within S seconds; 0 = wait "
            "forever (default 30; $TOKENFLEET_GATEWAY_QUEUE_TIMEOUT)",
        ),
    ] = None,
    max_body_bytes: Annotated[
        int | None,
        typer.Option(
            "--max-body-bytes",
            help="413 for a bigger request body "
            "(default 4 MiB; $TOKENFLEET_GATEWAY_MAX_BODY_BYTES)",
        ),
    ] = None,
    redis_connections: Annotated[
        int | None,
        typer.Option(
            "--redis-connections",
            help="command connections to Redis; requests wait for one "
            "(default 64; $TOKENFLEET_GATEWAY_REDIS_CONNECTIONS)",
        ),
    ] = None,
    pubsub_connections: Annotated[
        int | None,
        typer.Option(
            "--pubsub-connections",
            help="pub/sub connections every stream shares "
            "(default 2; $TOKENFLEET_GATEWAY_PUBSUB_CONNECTIONS)",
        ),
    ] = None,
    keepalive: Annotated[
        float | None,
        typer.Option(
            "--keepalive",
            help="an SSE keep-alive comment after S seconds without an event "
            "(default 15; $TOKENFLEET_GATEWAY_KEEPALIVE)",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level")] = "info",
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Serve OpenAI-compatible /v1/completions and /v1/chat/completions over the fleet."""
    import uvicorn

    from tokenfleet.gateway.app import create_app
    from tokenfleet.gateway.service import GatewayConfig

    keys = api_keys_from(api_key, os.environ.get(API_KEYS_ENV))
    if not keys and not is_loopback(host) and not insecure_no_auth:
        raise fail(
            f"refusing to serve {host} without API keys: pass --api-key (or set "
            f"${API_KEYS_ENV}), bind 127.0.0.1, or pass --insecure-no-auth"
        )
    overrides: dict[str, Any] = {}
    if queue_timeout is not None:
        overrides["queue_timeout_s"] = queue_timeout or None
    for field, flag in (
        ("max_body_bytes", max_body_bytes),
        ("redis_connections", redis_connections),
        ("pubsub_connections", pubsub_connections),
        ("keepalive_s", keepalive),
    ):
        if flag is not None:
            overrides[field] = flag
    try:
        config = GatewayConfig.from_settings(
            settings(redis_url, prefix),
            api_keys=keys,
            retry_after_s=retry_after,
            default_max_tokens=default_max_tokens,
            job_timeout_s=job_timeout,
            **overrides,
        )
    except ValueError as exc:  # pydantic's ValidationError (bad $TOKENFLEET_*) is one too
        raise fail(str(exc)) from None
    tenants = sorted({key.caller.tenant for key in config.parsed_keys})
    auth = f"{len(keys)} API key(s), tenants {', '.join(tenants)}" if keys else "no auth"
    typer.echo(f"tokenfleet gateway on http://{host}:{port} ({auth}; fleet prefix {config.prefix})")
    # enough listen backlog for a burst of clients connecting at once
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level, backlog=4096)
