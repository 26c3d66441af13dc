"""Prometheus metrics of one gateway, on its own registry (so several apps can share a
process, as the tests do), and the ASGI middleware that counts requests.

Besides its own counters the gateway exports fleet-wide gauges read from Redis at each
scrape (`GatewayMetrics.refresh_fleet`, two pipelined round trips: a scrape every few
seconds costs Redis little): each model's queue depth per priority band and each
tenant's queued and running jobs per model. Every gateway exports the same values, so
aggregate them with max(), not sum()."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.fleet import text
from tokenfleet.keys import BANDS, DEFAULT_MODEL, Keys
from tokenfleet.tenants import TenantUsage, decode_usage, pipeline_usage, valid_names

# Seconds from the request's arrival to its first token: queueing + prefill + one hop.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A scrape waits this long for the fleet gauges at most, then answers without them.
FLEET_READ_TIMEOUT_S = 2.0


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "tokenfleet_gateway_requests",
            "HTTP requests by route template and status code (499: client went away)",
            ["route", "status"],
            registry=self.registry,
        )
        self.streamed_tokens = Counter(
            "tokenfleet_gateway_streamed_tokens",
            "tokens sent to clients as server-sent events",
            ["model"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "tokenfleet_gateway_completion_tokens",
            "tokens generated for gateway requests (streamed or not)",
            ["model"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tokenfleet_gateway_time_to_first_token_seconds",
            "request arrival to the first token, as the gateway saw it",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.queue_full = Counter(
            "tokenfleet_gateway_queue_full_rejections",
            "requests refused with 429 because the model's jobs stream was at its cap",
            ["model"],
            registry=self.registry,
        )
        self.tenant_queue_full = Counter(
            "tokenfleet_gateway_tenant_queue_full_rejections",
            "requests refused with 429 because their tenant had its limit of queued jobs",
            ["model", "tenant"],
            registry=self.registry,
        )
        self.cancelled = Counter(
            "tokenfleet_gateway_client_cancellations",
            "jobs cancelled because their client disconnected before the end",
            ["model"],
            registry=self.registry,
        )

        self.queue_timeouts = Counter(
            "tokenfleet_gateway_queue_timeouts",
            "requests answered 503 because no worker started their job within the queue timeout",
            ["model"],
            registry=self.registry,
        )
        self.body_too_large = Counter(
            "tokenfleet_gateway_body_too_large",
            "requests refused with 413 because their body was over the limit",
            registry=self.registry,
        )
        self._gauges = {
            name: Gauge(f"tokenfleet_gateway_{name}", doc, registry=self.registry)
            for name, doc in (
                ("live_streams", "jobs being followed now (one per waiting or streaming request)"),
                ("pubsub_connections", "pub/sub connections up now (every stream shares them)"),
                ("pubsub_reconnects", "times a pub/sub connection was re-established"),
                ("cancel_retries", "cancels that failed on Redis and are being retried"),
            )
        }

        self.queue_depth = Gauge(
            "tokenfleet_queue_depth",
            "jobs accepted and unfinished in a model's priority band (XLEN of its stream), "
            "fleet-wide, read from Redis at each scrape",
            ["model", "band"],
            registry=self.registry,
        )
        self.tenant_queued = Gauge(
            "tokenfleet_tenant_queued",
            "a tenant's jobs of a model waiting in a jobs stream, fleet-wide",
            ["tenant", "model"],
            registry=self.registry,
        )
        self.tenant_running = Gauge(
            "tokenfleet_tenant_running",
            "a tenant's jobs of a model started by a worker and not finished, fleet-wide",
            ["tenant", "model"],
            registry=self.registry,
        )
        self.fleet_read_errors = Counter(
            "tokenfleet_gateway_fleet_read_errors",
            "scrapes that could not read the fleet-wide gauges from Redis (left out of them)",
            registry=self.registry,
        )

    def watch(self, name: str, read: Callable[[], float]) -> None:
        """Gauge `name` reads `read()` at each scrape."""
        self._gauges[name].set_function(read)

    async def refresh_fleet(
        self, client: aredis.Redis, keys: Keys, timeout_s: float = FLEET_READ_TIMEOUT_S
    ) -> bool:
        """Read the fleet-wide gauges from Redis for the scrape about to be rendered. When
        Redis does not answer within `timeout_s` they are left out of the scrape (never
        reported stale), the error is counted and False is returned."""
        fleet = (self.queue_depth, self.tenant_queued, self.tenant_running)
        try:
            async with asyncio.timeout(timeout_s):
                depths, usage = await read_fleet(client, keys)
        except (RedisError, TimeoutError):
            self.fleet_read_errors.inc()
            for gauge in fleet:
                gauge.clear()
            return False
        for gauge in fleet:  # no await from here on: a scrape sees one read whole
            gauge.clear()
        for (model, band), depth in depths.items():
            self.queue_depth.labels(model, band).set(depth)
        for model, by_tenant in usage.items():
            for tenant, counts in by_tenant.items():
                self.tenant_queued.labels(tenant, model).set(counts.queued)
                self.tenant_running.labels(tenant, model).set(counts.running)
        return True

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def read_fleet(
    client: aredis.Redis, keys: Keys
) -> tuple[dict[tuple[str, str], int], dict[str, dict[str, TenantUsage]]]:
    """(model, band) -> depth, and model -> tenant -> usage, for every model that has had
    a jobs stream (and the default model) and every tenant seen: SMEMBERS of both sets,
    then every XLEN and ZCARD in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.smembers(keys.models())
    pipe.smembers(keys.tenants())
    raw_models, raw_tenants = await pipe.execute()
    models = sorted({text(m) for m in raw_models} | {DEFAULT_MODEL})
    names = valid_names(raw_tenants)
    plan: list[tuple[str, str]] = [(model, band) for model in models for band in BANDS]
    pipe = client.pipeline(transaction=False)
    for model, band in plan:
        pipe.xlen(keys.jobs(model, band))
    pipeline_usage(pipe, keys, names, models)
    replies = await pipe.execute()
    depths = {where: int(depth) for where, depth in zip(plan, replies[: len(plan)], strict=True)}
    return depths, decode_usage(names, models, replies[len(plan) :])


class RequestTally:
    """One request's token metrics, labelled once by `model`."""

    def __init__(self, metrics: GatewayMetrics, model: str, arrived: float) -> None:
        self.metrics = metrics
        self.model = model
        self.arrived = arrived  # time.monotonic() when the request came in
        self._children: tuple[Histogram, Counter, Counter] | None = None

    def token(self, *, streamed: bool) -> None:
        if self._children is None:  # the first token
            m = self.metrics
            self._children = (
                m.ttft.labels(self.model),
                m.completion_tokens.labels(self.model),
                m.streamed_tokens.labels(self.model),
            )
            self._children[0].observe(time.monotonic() - self.arrived)
        _, completion, stream = self._children
        completion.inc()
        if streamed:
            stream.inc()


class RequestCounter:
    """Pure ASGI middleware: counts each HTTP request by route template and status.

    (Starlette's BaseHTTPMiddleware would sit between a streaming response and the
    client's disconnect; this only watches `http.response.start` go by.)"""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 499  # no response started: the client went away first

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if status == 499:  # failed before answering
                status = 500
            raise
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(template, str(status)).inc()
