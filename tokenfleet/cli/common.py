"""What every command shares: settings with flags on top, the error exit, common options."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from tokenfleet.config import Settings
from tokenfleet.keys import Keys

if TYPE_CHECKING:
    from tokenfleet.producer import Producer

RedisUrl = Annotated[
    str | None,
    typer.Option("--redis-url", help="Redis URL (default: $REDIS_URL or redis://127.0.0.1:6379/0)"),
]
Prefix = Annotated[str | None, typer.Option("--prefix", help="key prefix of the fleet")]
Model = Annotated[str | None, typer.Option("--model", help="model name (one jobs stream each)")]


def settings(redis_url: str | None = None, prefix: str | None = None) -> Settings:
    """Environment settings, with any flags given on the command line taking precedence."""
    overrides: dict[str, str] = {}
    if redis_url:
        overrides["redis_url"] = redis_url
    if prefix:
        overrides["prefix"] = prefix
    return Settings().model_copy(update=overrides)


def fail(message: str) -> typer.Exit:
    """Print `error: MESSAGE` to stderr; raise the result to exit with code 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def connect(redis_url: str | None, prefix: str | None) -> tuple[Settings, Any, Keys]:
    """Settings, a Redis client on their URL, and the fleet's keys."""
    import redis

    conf = settings(redis_url, prefix)
    return conf, redis.Redis.from_url(conf.redis_url), Keys(conf.prefix)


def connect_producer(redis_url: str | None, prefix: str | None) -> tuple[Settings, Producer]:
    """Settings and a `Producer` on them (their prefix and default queue cap)."""
    from tokenfleet.producer import Producer

    conf = settings(redis_url, prefix)
    return conf, Producer.from_url(conf.redis_url, prefix=conf.prefix, default_cap=conf.queue_cap)
