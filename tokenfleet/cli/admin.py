"""Operator tools: `acl` (a Redis ACL file for the fleet) and `bench` (bench/ scripts)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tokenfleet.cli.common import Prefix, fail, settings

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"  # in a source checkout only


def bench(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="engine | e2e | gateway | submit")],
) -> None:
    """Run a benchmark from the source checkout's bench/ (extra options are passed on)."""
    import runpy

    script = BENCH_DIR / f"{name}.py"
    if not script.is_file():
        raise fail(f"no benchmark {script} (benchmarks ship with the source checkout)")
    sys.argv = [str(script), *ctx.args]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


def acl(
    prefix: Prefix = None,
    clear: Annotated[
        bool,
        typer.Option("--clear", help="write given passwords as >text, not #sha256"),
    ] = False,
) -> None:
    """Print a Redis ACL file: one user per role (producer, worker, gateway, operator),
    each confined to the fleet's prefix with only the commands it sends.

    A role's password comes from $TOKENFLEET_REDIS_<ROLE>_PASSWORD (written as its
    SHA-256); without one the role gets the placeholder >change-me-<role>. Load the
    file with `redis-server --aclfile FILE`. See docs/operations.md, "Least privilege"."""
    import os

    from tokenfleet.acl import PASSWORD_ENV, render_acl_file

    conf = settings(None, prefix)
    passwords = {name: os.environ[env] for name, env in PASSWORD_ENV.items() if os.environ.get(env)}
    try:
        text = render_acl_file(conf.prefix, passwords, hashed=not clear)
    except ValueError as exc:
        raise fail(str(exc)) from None
    sys.stdout.write(text)
