"""Tenants: the limits operators give them, and what each has queued and running.

Every job belongs to a tenant (`GenerationRequest.tenant`, `default` unless it names
one). The keys (keys.py): `tenant:<name>:limits`, a hash with `queued_share` and
`max_running`; `tenant:*:limits`, the same fields for every tenant without its own;
`tenant:<name>:queued:<model>` and `tenant:<name>:running:<model>`, sorted sets of the
tenant's job ids; `tenants`, the set of tenant names seen.

The scripts enforce the limits: submit.lua refuses a job (`TenantQueueFull`) when its
tenant already has max(1, floor(queued_share × cap)) jobs of the model queued, the cap
being the model's (each band's) queue cap; accept.lua puts a job back at the tail of its
band when its tenant already runs `max_running` jobs of the model fleet-wide. Each field
falls back to the `*` hash on its own, and a value that is not a number counts as unset,
as the scripts read them.

The same hash holds one setting that is not a limit: `cache_group`. Cached prompt blocks
(prefix caching) are shared only between jobs of one *cache scope*, by default the
tenant's own: a cache hit is visible (faster first token, `cached_tokens` in usage), so a
tenant that could hit another's blocks could test whether any prompt it guesses was sent
recently. Tenants an operator gives the same `cache_group` share their cached blocks (for
tenants that are one organisation); a group in the `*` hash puts every tenant without its
own in it. accept.lua hands the worker the group with each job it starts (the scope's rule:
kv/prefix.py `cache_scope`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.fleet import text
from tokenfleet.keys import DEFAULT_TENANT, Keys, valid_tenant

QUEUED_SHARE = "queued_share"
MAX_RUNNING = "max_running"
CACHE_GROUP = "cache_group"
FIELDS = (QUEUED_SHARE, MAX_RUNNING, CACHE_GROUP)  # of a limits hash, in `_parse` order
DEFAULTS = "*"  # the name that stands for the default limits (`tokenfleet tenants set '*'`)


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits and its cache group; None = nothing from this source."""

    queued_share: float | None = None  # in (0, 1]: its share of each model's queue cap
    max_running: int | None = None  # ≥ 1: its sessions of a model running fleet-wide
    cache_group: str | None = None  # tenants of one group share cached prompt blocks

    @property
    def empty(self) -> bool:
        return self.queued_share is None and self.max_running is None and not self.cache_group

    def over(self, fallback: TenantLimits) -> TenantLimits:
        """These limits, each unset field taken from `fallback` (a tenant's own over `*`)."""
        return TenantLimits(
            queued_share=fallback.queued_share if self.queued_share is None else self.queued_share,
            max_running=fallback.max_running if self.max_running is None else self.max_running,
            cache_group=self.cache_group or fallback.cache_group,
        )

    def queued_limit(self, cap: int) -> int | None:
        """How many jobs of a model whose queue cap is `cap` the tenant may have queued, as
        submit.lua computes it; None: no limit."""
        if self.queued_share is None:
            return None
        return max(1, math.floor(self.queued_share * cap))

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {
            QUEUED_SHARE: self.queued_share,
            MAX_RUNNING: self.max_running,
            CACHE_GROUP: self.cache_group,
        }


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's jobs of one model: waiting in a stream, and started and not finished."""

    queued: int = 0
    running: int = 0


def validate_limits(
    queued_share: float | None, max_running: int | None, cache_group: str | None = None
) -> None:
    """Raise ValueError naming the field unless each given limit is in its range."""
    if cache_group is not None and not valid_tenant(cache_group):
        raise ValueError(
            f"cache_group must be a name like a tenant's (letters, digits, '.', '_', '-'), "
            f"got {cache_group!r}"
        )
    if queued_share is not None and not (
        isinstance(queued_share, int | float)
        and not isinstance(queued_share, bool)
        and math.isfinite(queued_share)
        and 0 < queued_share <= 1
    ):
        raise ValueError(
            f"queued_share must be a number in (0, 1] (a share of the queue cap), "
            f"got {queued_share!r}"
        )
    if max_running is not None and not (
        isinstance(max_running, int) and not isinstance(max_running, bool) and max_running >= 1
    ):
        raise ValueError(f"max_running must be an integer ≥ 1, got {max_running!r}")


def _number(raw: Any) -> float | None:
    """A hash value as the scripts' `tonumber` reads it; None when it is not a number."""
    if raw is None:
        return None
    try:
        value = float(text(raw))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _parse(share: Any, running: Any, group: Any = None) -> TenantLimits:
    """Limits from the raw HMGET values of `FIELDS`. A fractional `max_running` is
    rounded up: the script waits while running ≥ it. An empty group is no group."""
    most = _number(running)
    return TenantLimits(
        _number(share), None if most is None else math.ceil(most), text(group) if group else None
    )


def set_limits(
    client: redis.Redis,
    keys: Keys,
    tenant: str | None,
    *,
    queued_share: float | None = None,
    max_running: int | None = None,
    cache_group: str | None = None,
    clear: bool = False,
) -> TenantLimits:
    """Set a tenant's limits (None: the `*` default limits); fields not given are left as
    they are. `clear=True` first deletes the tenant's limits hash, so afterwards it has
    only the fields given here (none: it falls back to `*` entirely); the delete and
    the writes are one round trip, not one transaction. A named tenant joins the set of
    tenants, so `tokenfleet tenants` lists it before its first job. Returns the
    tenant's own limits as Redis now holds them."""
    validate_limits(queued_share, max_running, cache_group)
    if not clear and queued_share is None and max_running is None and cache_group is None:
        raise ValueError("nothing to set: give queued_share, max_running, cache_group or clear")
    key = keys.tenant_limits(tenant)  # raises ValueError for an invalid name
    copies = [keys.tenant_limits(tenant, p) for p in keys.partitions_all]  # scripts read theirs
    fields: dict[str, str] = {}
    if queued_share is not None:
        fields[QUEUED_SHARE] = repr(float(queued_share))
    if max_running is not None:
        fields[MAX_RUNNING] = str(max_running)
    if cache_group is not None:
        fields[CACHE_GROUP] = cache_group
    pipe = client.pipeline(transaction=False)
    for copy in copies:
        if clear:
            pipe.delete(copy)
        if fields:
            pipe.hset(copy, mapping=fields)
    if tenant is not None:
        pipe.sadd(keys.tenants(), tenant)
    pipe.hmget(key, *FIELDS)
    return _parse(*pipe.execute()[-1])


def get_limits(client: redis.Redis, keys: Keys, tenant: str | None) -> TenantLimits:
    """The limits the scripts apply to `tenant`: its own hash, each field falling back to
    the `*` hash (None: the `*` limits alone)."""
    pipe = client.pipeline(transaction=False)
    pipe.hmget(keys.tenant_limits(tenant), *FIELDS)
    pipe.hmget(keys.tenant_limits(None), *FIELDS)
    own, defaults = pipe.execute()
    return _parse(*own).over(_parse(*defaults))


def tenant_names(client: redis.Redis, keys: Keys) -> list[str]:
    """Every tenant name seen, sorted (a member that is not a valid name is skipped)."""
    pipe = client.pipeline(transaction=False)
    for p in keys.partitions_all:  # submit.lua adds to its partition's copy
        pipe.smembers(keys.tenants(p))
    return valid_names({name for members in pipe.execute() for name in members})


def valid_names(members: Iterable[Any]) -> list[str]:
    """The valid tenant names of an SMEMBERS reply of `keys.tenants()`, sorted."""
    return sorted(name for name in map(text, members) if valid_tenant(name))


# ---- usage (the requests and the decoding serve the sync and asyncio clients alike) -----


def pipeline_usage(pipe: Any, keys: Keys, names: Sequence[str], models: Sequence[str]) -> None:
    """Queue the ZCARDs of every tenant's queued and running sets of every model (in
    every partition) on `pipe` (a sync or an asyncio pipeline); `decode_usage` reads the
    replies."""
    for model in models:
        for name in names:
            for p in keys.partitions_all:
                pipe.zcard(keys.tenant_queued(name, model, p))
                pipe.zcard(keys.tenant_running(name, model, p))


def decode_usage(
    names: Sequence[str], models: Sequence[str], replies: Sequence[Any], partitions: int = 1
) -> dict[str, dict[str, TenantUsage]]:
    """Model -> tenant -> usage from the replies to `pipeline_usage`, in its order (the
    partitions' counts added)."""
    out: dict[str, dict[str, TenantUsage]] = {}
    i = 0
    for model in models:
        by_tenant = out.setdefault(model, {})
        for name in names:
            part = replies[i : i + 2 * partitions]
            by_tenant[name] = TenantUsage(
                queued=sum(int(r) for r in part[::2]), running=sum(int(r) for r in part[1::2])
            )
            i += 2 * partitions
    return out


# ---- the operator's view ---------------------------------------------------------------


@dataclass(frozen=True)
class TenantView:
    name: str
    own: TenantLimits  # its own limits hash
    limits: TenantLimits  # what the scripts apply: its own, each field falling back to `*`
    usage: Mapping[str, TenantUsage]  # by model


@dataclass(frozen=True)
class TenantsReport:
    defaults: TenantLimits  # the `*` hash
    tenants: Mapping[str, TenantView]  # by name, sorted

    @property
    def notable(self) -> bool:
        """Whether there is anything to show beyond one tenant with no limits: a tenant
        other than `default`, or any limits set."""
        return (
            any(name != DEFAULT_TENANT for name in self.tenants)
            or not self.defaults.empty
            or any(not view.own.empty for view in self.tenants.values())
        )


def read_tenants(client: redis.Redis, keys: Keys, models: Iterable[str]) -> TenantsReport:
    """Every tenant seen, with its limits and its usage of each of `models`, and the `*`
    limits: SMEMBERS, then one pipelined round trip (HMGETs and ZCARDs)."""
    names, wanted = tenant_names(client, keys), list(models)
    pipe = client.pipeline(transaction=False)
    pipe.hmget(keys.tenant_limits(None), *FIELDS)
    for name in names:
        pipe.hmget(keys.tenant_limits(name), *FIELDS)
    pipeline_usage(pipe, keys, names, wanted)
    replies = pipe.execute()
    defaults = _parse(*replies[0])
    usage = decode_usage(names, wanted, replies[1 + len(names) :], keys.partitions)
    tenants = {}
    for i, name in enumerate(names):
        own = _parse(*replies[1 + i])
        tenants[name] = TenantView(
            name=name,
            own=own,
            limits=own.over(defaults),
            usage={model: usage[model][name] for model in wanted},
        )
    return TenantsReport(defaults=defaults, tenants=tenants)
