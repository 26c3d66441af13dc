"""`tokenfleet tenants`: every tenant's limits and usage; `tokenfleet tenants set`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tokenfleet.cli.common import Prefix, RedisUrl, connect, fail

app = typer.Typer(
    help="List every tenant: its queued and running jobs per model and its limits; "
    "`set` changes the limits.",
    invoke_without_command=True,
)


@app.callback()
def tenants(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """List every tenant: its jobs of each model queued and running, and its limits."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console

    from tokenfleet.status import read_tenants_snapshot, render_tenants

    _, client, keys = connect(redis_url, prefix)
    snapshot = read_tenants_snapshot(client, keys)
    if as_json:
        typer.echo(json.dumps(snapshot))
        return
    Console().print(render_tenants(snapshot))
    if not snapshot["tenants"]:
        typer.echo("no tenant has submitted a job or been given limits yet")


@app.command("set")
def set_(
    name: Annotated[str, typer.Argument(help="the tenant; '*' = the default limits")],
    queued_share: Annotated[
        float | None,
        typer.Option(
            "--queued-share",
            help="in (0, 1]: the tenant may have max(1, floor(share × cap)) jobs of a model queued",
        ),
    ] = None,
    max_running: Annotated[
        int | None,
        typer.Option("--max-running", help="≥ 1: its jobs of a model running fleet-wide"),
    ] = None,
    cache_group: Annotated[
        str | None,
        typer.Option(
            "--cache-group",
            help="tenants given one group share cached prompt blocks (prefix caching); "
            "by default a tenant's are its own. Share only between tenants that may "
            "learn which prompts the others sent",
        ),
    ] = None,
    clear: Annotated[
        bool,
        typer.Option(
            "--clear", help="delete its limits first (alone: it falls back to the defaults)"
        ),
    ] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Set a tenant's limits (or the defaults, NAME '*'); fields not given stay as they are."""
    from tokenfleet.tenants import DEFAULTS, get_limits, set_limits

    tenant = None if name == DEFAULTS else name
    _, client, keys = connect(redis_url, prefix)
    try:
        own = set_limits(
            client,
            keys,
            tenant,
            queued_share=queued_share,
            max_running=max_running,
            cache_group=cache_group,
            clear=clear,
        )
    except ValueError as exc:
        raise fail(str(exc)) from None
    applied = get_limits(client, keys, tenant)

    def shown(value: float | None, inherited: bool) -> str:
        return "-" if value is None else f"{value:g}" + (" (from *)" if inherited else "")

    typer.echo(
        f"{keys.tenant_limits(tenant)}: queued_share "
        f"{shown(applied.queued_share, own.queued_share is None)}, max_running "
        f"{shown(applied.max_running, own.max_running is None)}, cache_group "
        f"{applied.cache_group or '-'}"
        + (" (from *)" if applied.cache_group and not own.cache_group else "")
    )
