"""`tokenfleet gateway`: serve the OpenAI-compatible HTTP API.

Its flags and variables are `GatewaySettings`' (tokenfleet/config/gateway.py). API
keys come from `--api-key` (repeatable) and `$TOKENFLEET_API_KEYS` (comma-separated),
both; each is `KEY`, `KEY=TENANT` or `KEY=TENANT:PRIORITY` (gateway/auth.py), and a
bad one stops the start naming its position, never the key. Without a key the
gateway only binds a loopback address, unless `--insecure-no-auth` says otherwise.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

import typer

from tokenfleet.cli.options import fail, settings_command
from tokenfleet.config import GatewaySettings

if TYPE_CHECKING:
    from tokenfleet.gateway.auth import ApiKey


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def refuse_open_without_keys(settings: GatewaySettings) -> None:
    if not settings.api_keys and not is_loopback(settings.host) and not settings.insecure_no_auth:
        raise fail(
            f"refusing to serve {settings.host} without API keys: pass --api-key (or set "
            "$TOKENFLEET_API_KEYS), bind 127.0.0.1, or pass --insecure-no-auth"
        )


def banner(settings: GatewaySettings, keys: tuple[ApiKey, ...]) -> str:
    """Where it serves, for whom (never a key), and which fleet."""
    tenants = sorted({key.caller.tenant for key in keys})
    auth = (
        f"{len(settings.api_keys)} API key(s), tenants {', '.join(tenants)}" if keys else "no auth"
    )
    where = f"http://{settings.host}:{settings.port}"
    return f"tokenfleet gateway on {where} ({auth}; fleet prefix {settings.prefix})"


@settings_command(GatewaySettings)
def gateway(settings: GatewaySettings) -> None:
    """Serve OpenAI-compatible /v1/completions and /v1/chat/completions over the fleet."""
    import uvicorn

    from tokenfleet.gateway.app import create_app
    from tokenfleet.gateway.auth import parse_api_keys

    refuse_open_without_keys(settings)
    try:
        keys = parse_api_keys(settings.api_keys)
    except ValueError as exc:  # names the entry's position, never the key
        raise fail(f"--api-key / $TOKENFLEET_API_KEYS: {exc}") from None
    typer.echo(banner(settings, keys))
    # enough listen backlog for a burst of clients connecting at once
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        backlog=4096,
    )
