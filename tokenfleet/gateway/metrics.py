"""Prometheus metrics of one gateway, on its own registry (so several apps can share a
process, as the tests do), and the ASGI middleware that counts requests.

Besides its own counters the gateway exports fleet-wide gauges read from Redis at each
scrape (`GatewayMetrics.refresh_fleet`, two pipelined round trips plus the heartbeats the
gateway's fleet view caches: a scrape every few seconds costs Redis little): each model's
queue depth and waiting jobs per priority band, its running sessions and KV use, and each
tenant's queued and running jobs per model. Every gateway exports the same values, so
aggregate them with max(), not sum().

vLLM's names for the signals autoscalers and routers read (`vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`) appear here with
a prefix that says whose they are, so no name means two things: `tokenfleet_gateway_*`
(this gateway's requests: sum over gateways) and `tokenfleet_fleet_*` (the whole fleet,
from Redis: max over gateways). Workers export the same names under `tokenfleet_*`, per
worker (worker/metrics.py). docs/operations.md ("Autoscaling") lists them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.fleet import (
    FleetReader,
    FleetView,
    QueueStats,
    added,
    decode_band,
    queue_band,
    text,
    waiting_jobs,
)
from tokenfleet.keys import BANDS, DEFAULT_MODEL, Keys
from tokenfleet.protocol import FinishEvent
from tokenfleet.tenants import TenantUsage, decode_usage, pipeline_usage, valid_names

# Seconds from the request's arrival to its first token: queueing + prefill + one hop.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Whole requests and queue waits: the worker's LATENCY_BUCKETS (worker/metrics.py, which
# this module does not import: it pulls in the engine), so the two compare bucket by bucket.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120, 300)
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
        self.e2e = Histogram(
            "tokenfleet_gateway_e2e_request_latency_seconds",
            "request arrival to the end of its job (every job of a request with n > 1), as "
            "the gateway saw it; requests whose client left or that timed out in the queue "
            "are not observed",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "tokenfleet_gateway_request_queue_time_seconds",
            "a job of this gateway's requests: submit to its admission by a worker (the "
            "worker's measure, from the job's finish event)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.running = Gauge(
            "tokenfleet_gateway_num_requests_running",
            "requests this gateway is answering whose first token has come",
            ["model"],
            registry=self.registry,
        )
        self.waiting = Gauge(
            "tokenfleet_gateway_num_requests_waiting",
            "requests this gateway is answering with no token yet (their job queued, or in "
            "its first prefill)",
            ["model"],
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
        self.fleet_waiting = Gauge(
            "tokenfleet_fleet_num_requests_waiting",
            "jobs in a model's priority band no worker has pulled yet (XLEN - pending of "
            "its stream), fleet-wide, read from Redis at each scrape",
            ["model", "band"],
            registry=self.registry,
        )
        self.fleet_running = Gauge(
            "tokenfleet_fleet_num_requests_running",
            "sessions running on the live workers of a model (the `active` of their "
            "heartbeats), fleet-wide",
            ["model"],
            registry=self.registry,
        )
        self.fleet_kv_usage = Gauge(
            "tokenfleet_fleet_kv_cache_usage_perc",
            "fraction of the KV of a model's live workers in use (0-1; their heartbeats' "
            "kv_used_bytes over kv_budget_bytes), fleet-wide",
            ["model"],
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
        self,
        client: aredis.Redis,
        keys: Keys,
        fleet: FleetReader | None = None,
        timeout_s: float = FLEET_READ_TIMEOUT_S,
    ) -> bool:
        """Read the fleet-wide gauges from Redis for the scrape about to be rendered (the
        heartbeats through `fleet`, the gateway's cached view; read afresh without one).
        When Redis does not answer within `timeout_s` they are left out of the scrape
        (never reported stale), the error is counted and False is returned."""
        gauges = (
            self.queue_depth,
            self.fleet_waiting,
            self.fleet_running,
            self.fleet_kv_usage,
            self.tenant_queued,
            self.tenant_running,
        )
        reader = fleet if fleet is not None else FleetReader(client, keys, cache_s=0.0)
        try:
            async with asyncio.timeout(timeout_s):
                bands, usage = await read_fleet(client, keys)
                view = await reader.read()
        except (RedisError, TimeoutError):
            self.fleet_read_errors.inc()
            for gauge in gauges:
                gauge.clear()
            return False
        for gauge in gauges:  # no await from here on: a scrape sees one read whole
            gauge.clear()
        for (model, band), stats in bands.items():
            self.queue_depth.labels(model, band).set(stats["depth"])
            self.fleet_waiting.labels(model, band).set(waiting_jobs(stats))
        for model, (running, kv_usage) in served_load(view).items():
            self.fleet_running.labels(model).set(running)
            if kv_usage is not None:
                self.fleet_kv_usage.labels(model).set(kv_usage)
        for model, by_tenant in usage.items():
            for tenant, counts in by_tenant.items():
                self.tenant_queued.labels(tenant, model).set(counts.queued)
                self.tenant_running.labels(tenant, model).set(counts.running)
        return True

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def read_fleet(
    client: aredis.Redis, keys: Keys
) -> tuple[dict[tuple[str, str], QueueStats], dict[str, dict[str, TenantUsage]]]:
    """(model, band) -> its stream's stats (depth, pending), and model -> tenant -> usage,
    for every model that has had a jobs stream (and the default model) and every tenant
    seen: SMEMBERS of both sets, then every XLEN, XINFO GROUPS and ZCARD in one pipelined
    round trip."""
    pipe = client.pipeline(transaction=False)
    for p in keys.partitions_all:  # each partition's copy of the registries
        pipe.smembers(keys.models(p))
        pipe.smembers(keys.tenants(p))
    registries = await pipe.execute()
    models = sorted({text(m) for found in registries[::2] for m in found} | {DEFAULT_MODEL})
    names = valid_names({n for found in registries[1::2] for n in found})
    plan = [(model, band, p) for model in models for band in BANDS for p in keys.partitions_all]
    pipe = client.pipeline(transaction=False)
    for model, band, part in plan:
        queue_band(pipe, keys.jobs(model, band, part))
    pipeline_usage(pipe, keys, names, models)
    replies = await pipe.execute(raise_on_error=False)
    bands: dict[tuple[str, str], QueueStats] = {}
    for i, (model, band, _) in enumerate(plan):
        stats = decode_band(replies[2 * i], replies[2 * i + 1])
        known = bands.get((model, band))
        bands[(model, band)] = stats if known is None else added(known, stats)
    rest = replies[2 * len(plan) :]
    for reply in rest:  # (a missing stream or group is no error: decode_band says empty)
        if isinstance(reply, Exception):
            raise reply
    return bands, decode_usage(names, models, rest, keys.partitions)


def served_load(view: FleetView) -> dict[str, tuple[int, float | None]]:
    """Model -> (sessions running on its live workers, the fraction of their KV in use;
    None when no worker reports a KV budget), from the workers' heartbeats."""
    out: dict[str, tuple[int, float | None]] = {}
    for name, served in view.models.items():
        running = used = budget = 0
        for worker in served.workers:
            running += _count(worker.fields.get("active"))
            used += _count(worker.fields.get("kv_used_bytes"))
            budget += _count(worker.fields.get("kv_budget_bytes"))
        out[name] = (running, used / budget if budget else None)
    return out


def _count(value: object) -> int:
    """A heartbeat's count, or 0 when it is missing or not a count (never trusted blindly:
    the hash is JSON anyone with HSET could have written)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class RequestTally:
    """One request's metrics, labelled once by `model`: waiting from when its job was
    submitted, running from its first token, until `ended` (which every way a request
    closes calls: service.py's `close`, fanout.py's `_FanOut.close`)."""

    def __init__(self, metrics: GatewayMetrics, model: str, arrived: float) -> None:
        self.metrics = metrics
        self.model = model
        self.arrived = arrived  # time.monotonic() when the request came in
        self._children: tuple[Histogram, Counter, Counter] | None = None
        self._state: Gauge | None = metrics.waiting.labels(model)  # None once ended
        self._state.inc()

    def token(self, *, streamed: bool) -> None:
        if self._children is None:  # the first token
            m = self.metrics
            self._children = (
                m.ttft.labels(self.model),
                m.completion_tokens.labels(self.model),
                m.streamed_tokens.labels(self.model),
            )
            self._children[0].observe(time.monotonic() - self.arrived)
            if self._state is not None:
                self._state.dec()
                self._state = m.running.labels(self.model)
                self._state.inc()
        _, completion, stream = self._children
        completion.inc()
        if streamed:
            stream.inc()

    def ended(self, finishes: Sequence[FinishEvent | None], finished_at: float | None) -> None:
        """The request is over (a second call does nothing). `finishes`: the end of each of
        its jobs (None: it never came); `finished_at`: time.monotonic() when the last came.
        Each job admitted by a worker counts its queue time; the request counts its
        end-to-end latency when every job ended."""
        if self._state is None:
            return
        self._state.dec()
        self._state = None
        for finish in finishes:
            queued_s = None if finish is None else finish.timings.queued_s
            if queued_s is not None:
                self.metrics.queue_time.labels(self.model).observe(max(0.0, queued_s))
        if finishes and finished_at is not None and all(f is not None for f in finishes):
            self.metrics.e2e.labels(self.model).observe(max(0.0, finished_at - self.arrived))


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
