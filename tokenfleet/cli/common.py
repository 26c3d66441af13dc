"""What every command shares: settings with flags on top, the error exit, common options."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from tokenfleet.cli.options import fail, load, option
from tokenfleet.config import Settings
from tokenfleet.keys import Keys

if TYPE_CHECKING:
    from tokenfleet.producer import Producer

__all__ = ["Model", "Prefix", "RedisUrl", "connect", "connect_producer", "fail", "settings"]

RedisUrl = Annotated[str | None, option(Settings, "redis_url")]
Prefix = Annotated[str | None, option(Settings, "prefix")]
Model = Annotated[str | None, typer.Option("--model", help="model name (one jobs stream each)")]


def settings(redis_url: str | None = None, prefix: str | None = None) -> Settings:
    """The environment's settings, with any flags given on the command line on top."""
    return load(Settings, redis_url=redis_url, prefix=prefix)


def connect(redis_url: str | None, prefix: str | None) -> tuple[Settings, Any, Keys]:
    """Settings, a Redis client on their URL, and the fleet's keys."""
    from tokenfleet.connect import connect as connect_redis

    conf = settings(redis_url, prefix)
    return conf, connect_redis(conf.redis_url), conf.keys()


def connect_producer(redis_url: str | None, prefix: str | None) -> tuple[Settings, Producer]:
    """Settings and a `Producer` on them (their prefix and default queue cap)."""
    from tokenfleet.producer import Producer

    conf = settings(redis_url, prefix)
    producer = Producer.from_url(
        conf.redis_url, prefix=conf.prefix, partitions=conf.partitions, default_cap=conf.queue_cap
    )
    return conf, producer
