"""What an operator wants to know about a fleet, read from Redis alone.

Everything here is also one `redis-cli` command away (docs/operations.md):
depth = XLEN of a jobs stream, in flight = pending of its group, waiting =
depth − in flight, dead letters = XLEN of the dead-letter stream, workers =
the live worker hashes.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from rich.console import Group
from rich.table import Table

from tokenfleet.fleet import live_workers, queue_stats, text
from tokenfleet.keys import DEFAULT_MODEL, DEFAULT_QUEUE_CAP, Keys


def fleet_status(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """A JSON-safe snapshot: every jobs stream, the dead letters, every live worker."""
    models = sorted({text(m) for m in client.smembers(keys.models())} | {DEFAULT_MODEL})
    queues = []
    for model in models:
        stats = queue_stats(client, keys, model)
        cap = client.get(keys.queue_cap(model))
        depth, pending = stats["depth"], stats["pending"]
        queues.append(
            {
                "model": model,
                "stream": keys.jobs(model),
                "depth": depth,
                "waiting": max(0, depth - pending),  # pending may count deleted entries
                "in_flight": pending,
                "lag": stats["lag"],
                "consumers": stats["consumers"],
                "cap": int(cap) if cap is not None else DEFAULT_QUEUE_CAP,
            }
        )
    return {
        "time": time.time(),
        "prefix": keys.prefix,
        "queues": queues,
        "dead_letters": int(client.xlen(keys.dead_letters())),
        "workers": live_workers(client, keys),
    }


def _mib(value: Any) -> str:
    return f"{(value or 0) / 2**20:,.1f}"


def render_status(status: dict[str, Any]) -> Group:
    """Two tables: the queues and the workers."""
    queues = Table(title=f"queues ({status['prefix']}*)   dead letters: {status['dead_letters']}")
    for column in ("model", "depth", "waiting", "in flight", "cap", "consumers"):
        queues.add_column(column, justify="left" if column == "model" else "right")
    for q in status["queues"]:
        queues.add_row(
            q["model"],
            str(q["depth"]),
            str(q["waiting"]),
            str(q["in_flight"]),
            str(q["cap"]),
            str(q["consumers"]),
        )
    workers = Table(title=f"workers ({len(status['workers'])} live)")
    columns = (
        "worker",
        "model",
        "status",
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
    return Group(queues, workers)


def _prefix_hit(worker: dict[str, Any]) -> str:
    """Prompt tokens found in the worker's prefix cache, as a share ('off' without it)."""
    if worker.get("prefix_cache") is False:
        return "off"
    rate = worker.get("prefix_cache_hit_rate")
    return "-" if not isinstance(rate, int | float) else f"{100 * rate:.0f}%"
