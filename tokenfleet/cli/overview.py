"""Commands about the fleet as a whole: `status`, `top`, `up`, `demo`."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from tokenfleet.cli.common import Prefix, RedisUrl, connect, settings
from tokenfleet.cli.options import load, option
from tokenfleet.config import WorkerSettings
from tokenfleet.keys import Keys


def demo(
    jobs: Annotated[int, typer.Option("--jobs", help="how many jobs to submit")] = 24,
    workers: Annotated[int, typer.Option("--workers", help="worker processes")] = 2,
    producers: Annotated[int, typer.Option("--producers", help="producer threads")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 160,
    live: Annotated[bool, typer.Option("--live/--no-live", help="live view or plain lines")] = True,
    redis_url: Annotated[
        str | None, typer.Option("--redis-url", help="use this Redis instead of an embedded one")
    ] = None,
    prefix: Prefix = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="what the workers serve (default: smollm2-135m-instruct when its wheel is"
            " installed, else tiny-random)",
        ),
    ] = None,
) -> None:
    """Run a whole fleet locally: embedded Redis, workers, producers, a live view."""
    from tokenfleet.demo import run_demo

    conf = settings(None, prefix)
    code = run_demo(
        redis_url=redis_url,
        prefix=conf.prefix,
        jobs=jobs,
        workers=workers,
        producers=max(1, min(producers, jobs)),
        max_new_tokens=max_new_tokens,
        live=live,
        model=model,
    )
    raise typer.Exit(code=code)


def _watch_status(client: Any, keys: Keys, *, full_screen: bool) -> None:
    """Redraw the status tables every second until Ctrl-C."""
    import time

    from rich.console import Console
    from rich.live import Live

    from tokenfleet.status import fleet_status, render_status

    view = render_status(fleet_status(client, keys))
    with Live(view, console=Console(), screen=full_screen) as screen:
        try:
            while True:
                time.sleep(1)
                screen.update(render_status(fleet_status(client, keys)))
        except KeyboardInterrupt:
            pass


def status(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="refresh every second")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Queue depth, waiting vs in flight, dead letters, and every live worker."""
    from rich.console import Console

    from tokenfleet.status import fleet_status, render_status

    _, client, keys = connect(redis_url, prefix)
    if as_json:
        typer.echo(json.dumps(fleet_status(client, keys)))
    elif watch:
        _watch_status(client, keys, full_screen=False)
    else:
        Console().print(render_status(fleet_status(client, keys)))


def top(redis_url: RedisUrl = None, prefix: Prefix = None) -> None:
    """Full-screen live view of the queues and the fleet (Ctrl-C to quit)."""
    _, client, keys = connect(redis_url, prefix)
    _watch_status(client, keys, full_screen=True)


def up(
    workers: Annotated[int, typer.Option("--workers", help="worker processes")] = 2,
    model: Annotated[str | None, option(WorkerSettings, "model")] = None,
    threads: Annotated[int, typer.Option("--threads", help="torch threads per worker")] = 1,
    embedded: Annotated[
        bool, typer.Option("--embedded", help="start an embedded Redis instead of --redis-url")
    ] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Run a local multi-process fleet without Docker; Ctrl-C drains it and exits."""
    import signal
    import threading

    from tokenfleet.local import LocalWorkers, redis_for

    conf = load(WorkerSettings, redis_url=redis_url, prefix=prefix, model=model)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    worker_args = ["--model", conf.model, "--threads", str(threads)]
    with redis_for(None if embedded else conf.redis_url) as (url, kind):
        fleet = LocalWorkers(url, conf.prefix, worker_args)
        names = fleet.start(workers, name_prefix="up")
        typer.echo(f"fleet up: {len(names)} worker(s) on {url} ({kind}); Ctrl-C drains and stops")
        while not stop.wait(0.5):
            if not fleet.alive():
                typer.echo("every worker has exited", err=True)
                break
        typer.echo("draining: in-flight jobs finish, the rest are handed back")
        codes = fleet.drain()
    failed = {name: code for name, code in codes.items() if code != 0}
    typer.echo(f"stopped {len(codes)} worker(s)" + (f"; failures: {failed}" if failed else ""))
    raise typer.Exit(code=1 if failed else 0)
