"""The `tokenfleet` command line: one module per command group, registered here.

Settings and flags are read in these modules only: `options` builds each flag of
a settings field (tokenfleet/config/) from its declaration and puts the flags
given over the environment; each command hands the settings to the code that does
the work (`tokenfleet.worker.main.build_worker`, the producer, `tokenfleet.status`,
...). Heavy imports (torch, redis, the gateway) wait until a command runs, so
`tokenfleet --help` stays fast.
"""

from __future__ import annotations

import sys

import typer

from tokenfleet.cli import admin, batch, gateway, jobs, overview, tenants, worker

__all__ = ["app", "main"]

app = typer.Typer(
    name="tokenfleet",
    help="A fleet of continuous-batching LLM workers coordinated through Redis.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

# in the order `tokenfleet --help` lists them
app.command("queue-cap")(jobs.queue_cap)
app.command("submit")(jobs.submit)
app.command("worker")(worker.worker)
app.command("demo")(overview.demo)
app.command("status")(overview.status)
app.command("top")(overview.top)
app.command("up")(overview.up)
app.command("dead-letters")(jobs.dead_letters)
app.add_typer(tenants.app, name="tenants")
app.command("gateway")(gateway.gateway)
app.command(
    "bench",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)(admin.bench)
app.command("acl")(admin.acl)
app.add_typer(batch.app, name="batch")


def main() -> None:
    """The console entry point: run the app; an unreachable Redis, a Redis URL it cannot
    read, or no redis-server for a local fleet, is exit code 2."""
    import redis

    from tokenfleet.errors import InvalidRedisUrl, RedisServerNotFound

    try:
        app()
    except redis.ConnectionError as exc:
        typer.echo(f"error: cannot reach Redis ({exc})", err=True)
        sys.exit(2)
    except (InvalidRedisUrl, RedisServerNotFound) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
