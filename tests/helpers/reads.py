"""One band's stats and one model's tenant usage, as tests ask for them: production reads
these for every band and model at once (`fleet.band_stats`, `tenants.read_tenants`)."""

from __future__ import annotations

import redis

from tokenfleet.fleet import QueueStats, band_stats
from tokenfleet.keys import DEFAULT_BAND, DEFAULT_MODEL, Keys
from tokenfleet.tenants import TenantUsage, read_tenants


def queue_stats(
    client: redis.Redis, keys: Keys, model: str | None = None, band: str = DEFAULT_BAND
) -> QueueStats:
    """How full one band's jobs stream of the model is (a missing stream is empty)."""
    name = model or DEFAULT_MODEL
    return band_stats(client, keys, [name], bands=(band,))[name][band]


def tenant_usage(
    client: redis.Redis, keys: Keys, model: str | None = None
) -> dict[str, TenantUsage]:
    """Every tenant seen and its jobs of `model` queued and running (zeros included)."""
    name = model or DEFAULT_MODEL
    report = read_tenants(client, keys, [name])
    return {tenant: view.usage[name] for tenant, view in report.tenants.items()}
