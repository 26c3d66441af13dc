"""What most tests use: the default prefix's keys, condition waits, `tokenfleet` as a
process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tokenfleet.keys import Keys

__all__ = ["KEYS", "ROOT", "run_cli", "wait_for"]

ROOT = Path(__file__).resolve().parents[2]  # the repository
KEYS = Keys()  # the default prefix: where `Producer(r)`, the `fleet` fixture's workers and a
# gateway without a prefix of its own read and write


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run `tokenfleet ARGS` as its own process; wide output so Rich doesn't wrap lines."""
    env = {**(env or os.environ), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def wait_for(
    predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition"
) -> None:
    """Poll `predicate` until it is truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
