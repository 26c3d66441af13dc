"""`tokenfleet worker`: its flags are `WorkerSettings`' (tokenfleet/config/worker.py);
`tokenfleet.worker.main.build_worker` builds the worker they describe, and this runs it."""

from __future__ import annotations

import logging
import signal
import sys

import typer

from tokenfleet.cli.options import fail, settings_command
from tokenfleet.config import WorkerSettings
from tokenfleet.errors import TokenfleetError


def leave_on_signals() -> None:
    """A signal while torch and the model load: nothing is held yet, so leave cleanly.
    The worker's own drain-then-stop handlers replace these once it runs."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))


@settings_command(WorkerSettings)
def worker(settings: WorkerSettings) -> None:
    """Serve jobs from the fleet's stream with one continuous-batching engine."""
    leave_on_signals()
    logging.basicConfig(
        level=logging.INFO if settings.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from tokenfleet.worker.main import build_worker

    try:
        runner = build_worker(settings)
    except TokenfleetError as exc:
        raise fail(str(exc)) from None
    runner.install_signal_handlers()
    raise typer.Exit(code=runner.run())
