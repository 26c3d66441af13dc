"""What an operator wants to know about a fleet, read from Redis alone.

Everything here is also one `redis-cli` command away (docs/operations.md):
depth = XLEN of a jobs stream (one per model and priority band), in flight =
pending of its group, waiting = depth − in flight, dead letters = XLEN of the
dead-letter stream, workers = the live worker hashes, a tenant's queued and running
jobs = ZCARD of its sets, its limits = HGETALL of its limits hash.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tokenfleet.fleet import band_stats, live_workers, text
from tokenfleet.keys import BANDS, DEFAULT_BAND, DEFAULT_MODEL, DEFAULT_QUEUE_CAP, Keys
from tokenfleet.tenants import (
    CACHE_GROUP,
    DEFAULTS,
    MAX_RUNNING,
    QUEUED_SHARE,
    TenantsReport,
    read_tenants,
)

# The order of a model's entries in the JSON snapshot: the default band first (the
# stream a model had before bands existed, so a reader of the first entry sees what it
# saw before), then the others highest first. The table shows them highest first.
_SNAPSHOT_BANDS = (DEFAULT_BAND, *(band for band in BANDS if band != DEFAULT_BAND))


def fleet_models(client: redis.Redis, keys: Keys) -> list[str]:
    """Every model that has had a jobs stream, and the default model, sorted."""
    pipe = client.pipeline(transaction=False)
    for p in keys.partitions_all:  # submit.lua adds to its partition's copy
        pipe.smembers(keys.models(p))
    found = {text(m) for members in pipe.execute() for m in members}
    return sorted(found | {DEFAULT_MODEL})


def queue_caps(client: redis.Redis, keys: Keys, models: Iterable[str]) -> dict[str, int]:
    """Each model's queue cap (the cap of each of its bands), in one round trip."""
    wanted = list(models)
    pipe = client.pipeline(transaction=False)
    for model in wanted:
        pipe.get(keys.queue_cap(model))
    caps = pipe.execute()
    return {
        model: DEFAULT_QUEUE_CAP if cap is None else int(cap)
        for model, cap in zip(wanted, caps, strict=True)
    }


def tenants_snapshot(report: TenantsReport, caps: Mapping[str, int]) -> dict[str, Any]:
    """The JSON-safe tenants part of a snapshot: the `*` limits, and every tenant's own
    limits, the limits that apply to it (own over `*`) and its jobs of each model, with
    the queued limit that model's cap gives it (None: no limit)."""
    return {
        "tenant_defaults": report.defaults.as_dict(),
        "tenants": {
            name: {
                "limits": view.own.as_dict(),
                "effective": view.limits.as_dict(),
                "models": {
                    model: {
                        "queued": usage.queued,
                        "running": usage.running,
                        "queued_limit": view.limits.queued_limit(caps[model]),
                    }
                    for model, usage in view.usage.items()
                },
            }
            for name, view in report.tenants.items()
        },
    }


def read_tenants_snapshot(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """`tenants_snapshot` read from Redis: what `tokenfleet tenants --json` prints."""
    models = fleet_models(client, keys)
    return tenants_snapshot(read_tenants(client, keys, models), queue_caps(client, keys, models))


def fleet_status(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """A JSON-safe snapshot: every jobs stream (one entry per model and band, each with
    the model's cap), the dead letters, every live worker, and the tenants."""
    models = fleet_models(client, keys)
    caps = queue_caps(client, keys, models)
    stats = band_stats(client, keys, models, _SNAPSHOT_BANDS)
    queues = []
    for model in models:
        for band, band_queue in stats[model].items():
            depth, pending = band_queue["depth"], band_queue["pending"]
            queues.append(
                {
                    "model": model,
                    "band": band,
                    "stream": keys.jobs(model, band),
                    "depth": depth,
                    "waiting": max(0, depth - pending),  # pending may count deleted entries
                    "in_flight": pending,
                    "lag": band_queue["lag"],
                    "consumers": band_queue["consumers"],
                    "cap": caps[model],
                }
            )
    return {
        "time": time.time(),
        "prefix": keys.prefix,
        "queues": queues,
        "dead_letters": sum(int(client.xlen(keys.dead_letters(p))) for p in keys.partitions_all),
        "workers": live_workers(client, keys),
        **tenants_snapshot(read_tenants(client, keys, models), caps),
    }


def _mib(value: Any) -> str:
    return f"{(value or 0) / 2**20:,.1f}"


def render_status(status: dict[str, Any]) -> Group:
    """The queues table (a row per model and band), the tenants table when there is more
    than the default tenant without limits, and the workers table."""
    queues = Table(title=f"queues ({status['prefix']}*)   dead letters: {status['dead_letters']}")
    for column in ("model", "band", "depth", "waiting", "in flight", "cap", "consumers"):
        queues.add_column(column, justify="left" if column in ("model", "band") else "right")
    rank = {band: i for i, band in enumerate(BANDS)}
    for q in sorted(status["queues"], key=lambda q: (q["model"], rank.get(q.get("band"), 0))):
        queues.add_row(
            q["model"],
            str(q.get("band", DEFAULT_BAND)),
            str(q["depth"]),
            str(q["waiting"]),
            str(q["in_flight"]),
            str(q["cap"]),
            str(q["consumers"]),
        )
    tables: list[Table | Text] = [queues]
    if tenants_notable(status):
        tables.append(render_tenants(status))
    workers = Table(title=f"workers ({len(status['workers'])} live)")
    columns = (
        "worker",
        "model",
        "status",
        "engine",
        "active",
        "waiting",
        "batch",
        "occupancy",
        "KV MiB used/budget",
        "decode tok/s",
        "tick p50 ms",
        "prefix hit",
        "finished",
    )
    for column in columns:
        workers.add_column(
            column, justify="left" if column in ("worker", "model", "status") else "right"
        )
    for name, w in sorted(status["workers"].items()):
        finished = sum((w.get("finished_by_reason") or {}).values())
        workers.add_row(
            name,
            str(w.get("model", "?")),
            str(w.get("status", "?")),
            engine_summary(w),
            str(w.get("active", 0)),
            str(w.get("waiting", 0)),
            f"{w.get('batch_size_last', 0)}/{w.get('max_batch_size', '?')}",
            f"{100 * (w.get('occupancy_mean') or 0):.0f}%",
            f"{_mib(w.get('kv_used_bytes'))}/{_mib(w.get('kv_budget_bytes'))}",
            f"{w.get('decode_tokens_per_s') or 0:,.0f}",
            f"{w.get('tick_ms_p50') or 0:.1f}",
            _prefix_hit(w),
            str(finished),
        )
    tables.append(workers)
    whys = [
        f"{name}: {w['engine']['why']}"
        for name, w in sorted(status["workers"].items())
        if isinstance(w.get("engine"), dict) and w["engine"].get("why")
    ]
    if whys:
        tables.append(Text("engine plans (a default start): " + "; ".join(whys)))
    return Group(*tables)


def engine_summary(worker: Mapping[str, Any]) -> str:
    """How a worker runs its model, short: dtype (and the KV pool's, where it differs),
    the narrow format and its rows (a default start's plan), quant, compiled, CUDA graphs,
    deterministic; on llama.cpp, the file's type."""
    if worker.get("runner") == "llamacpp":
        repack = "" if worker.get("extra_bufts", True) else " no-repack"
        streams = f" {worker['kv_streams']} streams" if worker.get("kv_streams") else ""
        return f"llama.cpp {worker.get('source_quant') or '?'}{repack}{streams}"
    parts = [str(worker.get("dtype") or "?")]
    kv = worker.get("kv_dtype")
    if kv and kv != worker.get("dtype"):  # a pool in another dtype than the model's
        parts.append(f"kv:{kv}")
    plan = worker.get("engine")
    if isinstance(plan, dict) and plan.get("narrow"):
        parts.append(f"+{plan['narrow']}≤{plan.get('narrow_rows')}")
    if worker.get("quant"):
        parts.append(str(worker["quant"]))
    if worker.get("decode_path") == "native":
        parts.append("native")
    elif isinstance(plan, dict) and plan.get("decode_graph") and worker.get("compile_mode"):
        parts.append("graph")
    elif worker.get("compile_mode"):
        parts.append("compiled")
    if worker.get("cuda_graphs"):
        parts.append("cuda-graphs")
    if worker.get("deterministic"):
        parts.append("det")
    return " ".join(parts)


def _prefix_hit(worker: dict[str, Any]) -> str:
    """Prompt tokens found in the worker's prefix cache, as a share ('off' without it)."""
    if worker.get("prefix_cache") is False:
        return "off"
    rate = worker.get("prefix_cache_hit_rate")
    return "-" if not isinstance(rate, int | float) else f"{100 * rate:.0f}%"


# ---- tenants ------------------------------------------------------------------------


def tenants_notable(snapshot: Mapping[str, Any]) -> bool:
    """A tenant other than `default`, or any limits set (own or `*`)."""
    tenants: Mapping[str, Any] = snapshot.get("tenants") or {}
    limits = [snapshot.get("tenant_defaults") or {}] + [t["limits"] for t in tenants.values()]
    return any(name != "default" for name in tenants) or any(
        value is not None for entry in limits for value in entry.values()
    )


def _limit(tenant: Mapping[str, Any], field: str) -> str:
    """A limit's value, marked `(*)` when it comes from the default limits; `-` unset."""
    value = tenant["effective"][field]
    if value is None:
        return "-"
    shown = value if isinstance(value, str) else f"{value:g}"
    return shown + (" (*)" if tenant["limits"][field] is None else "")


def _defaults_line(defaults: Mapping[str, Any]) -> str:
    share, most = defaults.get(QUEUED_SHARE), defaults.get(MAX_RUNNING)
    group = defaults.get(CACHE_GROUP)
    if share is None and most is None and group is None:
        return "none"
    parts = [f"queued share {share:g}" if share is not None else "queued share -"]
    parts.append(f"max running {most}" if most is not None else "max running -")
    if group is not None:
        parts.append(f"cache group {group}")
    return ", ".join(parts)


def render_tenants(snapshot: Mapping[str, Any]) -> Table:
    """A row per tenant and model it has jobs of (a tenant with none: one row, model
    `-`): queued, running, and the limits that apply (`(*)`: from the defaults)."""
    defaults = _defaults_line(snapshot.get("tenant_defaults") or {})
    tenants: Mapping[str, Any] = snapshot.get("tenants") or {}
    table = Table(title=f"tenants ({len(tenants)})   defaults ({DEFAULTS}): {defaults}")
    columns = ("tenant", "model", "queued", "running", "queued limit", "queued share")
    for column in (*columns, "max running", "cache group"):
        table.add_column(column, justify="left" if column in ("tenant", "model") else "right")
    for name, tenant in sorted(tenants.items()):
        models: Mapping[str, Any] = tenant["models"]
        busy = {m: u for m, u in sorted(models.items()) if u["queued"] or u["running"]}
        rows = busy.items() if busy else [("-", {"queued": 0, "running": 0, "queued_limit": None})]
        for model, usage in rows:
            limit = usage["queued_limit"]
            table.add_row(
                name,
                model,
                str(usage["queued"]),
                str(usage["running"]),
                "-" if limit is None else str(limit),
                _limit(tenant, QUEUED_SHARE),
                _limit(tenant, MAX_RUNNING),
                _limit(tenant, CACHE_GROUP) if CACHE_GROUP in tenant["effective"] else "-",
            )
    return table
