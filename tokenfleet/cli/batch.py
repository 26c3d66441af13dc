"""`tokenfleet batch run`: an OpenAI batch file through the fleet, from the shell."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tokenfleet.cli.common import Prefix, RedisUrl, connect_producer, fail
from tokenfleet.keys import BANDS, DEFAULT_TENANT, TENANT_PATTERN, valid_tenant

if TYPE_CHECKING:
    pass

app = typer.Typer(help="OpenAI-style batch files, straight through a producer (no gateway).")


@app.command("run")
def run(
    source: Annotated[Path, typer.Argument(help="OpenAI batch input (JSONL)", exists=True)],
    output: Annotated[Path, typer.Option("--output", "-o", help="results (JSONL), appended")],
    endpoint: Annotated[
        str | None,
        typer.Option(
            help="/v1/chat/completions or /v1/completions (default: the first line's url)"
        ),
    ] = None,
    max_in_flight: Annotated[int, typer.Option("--max-in-flight", help="jobs out at once")] = 64,
    queue_share: Annotated[
        float, typer.Option("--queue-share", help="submit only under this share of the queue cap")
    ] = 0.5,
    tenant: Annotated[
        str, typer.Option("--tenant", help="whose jobs they are (the tenant's limits apply)")
    ] = DEFAULT_TENANT,
    priority: Annotated[
        str, typer.Option("--priority", help=f"the band the jobs wait in: {', '.join(BANDS)}")
    ] = "batch",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Run every request of SOURCE not yet in OUTPUT; Ctrl-C stops, running it again resumes."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from tokenfleet.batch.format import BatchInputError
    from tokenfleet.batch.offline import Progress as Counts
    from tokenfleet.batch.offline import run_batch

    if max_in_flight < 1 or not 0 < queue_share <= 1:
        raise fail("--max-in-flight must be >= 1 and --queue-share in (0, 1]")
    if not valid_tenant(tenant):
        raise fail(f"--tenant {tenant!r} does not match {TENANT_PATTERN}")
    if priority not in BANDS:
        raise fail(f"--priority {priority!r} is not one of {', '.join(BANDS)}")
    _, producer = connect_producer(redis_url, prefix)
    bar = Progress(
        TextColumn("[bold]batch[/]"),
        BarColumn(),
        TextColumn(
            "{task.completed}/{task.total} done · {task.fields[failed]} failed · "
            "{task.fields[in_flight]} in flight · {task.fields[tok_s]:.0f} tok/s"
        ),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=quiet,
    )
    with bar:
        task = bar.add_task("batch", total=None, failed=0, in_flight=0, tok_s=0.0)

        def show(p: Counts) -> None:
            bar.update(
                task,
                total=p.total,
                completed=p.done + p.failed,
                failed=p.failed,
                in_flight=p.in_flight,
                tok_s=p.tok_s,
            )

        try:
            counts = run_batch(
                producer,
                source,
                output,
                endpoint=endpoint,
                max_in_flight=max_in_flight,
                queue_share=queue_share,
                tenant=tenant,
                priority=priority,
                on_progress=show,
            )
        except BatchInputError as exc:
            raise fail(f"{source}: {exc}") from None
        except KeyboardInterrupt:
            typer.echo(f"stopped: run the same command again to resume ({output})", err=True)
            raise typer.Exit(130) from None
    typer.echo(f"{counts.done} done, {counts.failed} failed of {counts.total}: {output}")
    if counts.failed:
        raise typer.Exit(1)
