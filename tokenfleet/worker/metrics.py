"""Prometheus metrics of one worker, named the way vLLM and TGI users expect.

Served by `tokenfleet worker --metrics-port N` (prometheus-client, its own
registry: no global state). Gauges are refreshed from the engine after each
tick; counters and histograms are fed from each tick's outputs and each
finished job.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tokenfleet.keys import DEFAULT_TENANT
from tokenfleet.reasons import AdmissionReason, FinishReason
from tokenfleet.worker.engine import Engine, Finished, StepOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class WorkerMetrics:
    def __init__(self, worker: str, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("worker", "model")
        self._labels = {"worker": worker, "model": model}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        self.running = gauge(
            "tokenfleet_num_requests_running", "Sessions holding KV (prefill or decode)"
        )
        self.waiting = gauge("tokenfleet_num_requests_waiting", "Jobs waiting locally for room")
        self.kv_usage = gauge(
            "tokenfleet_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)"
        )
        self.kv_cached = gauge(
            "tokenfleet_kv_cache_cached_perc",
            "Fraction of KV blocks free but holding a cached prefix (reclaimable, 0-1)",
        )
        self.batch_size = gauge("tokenfleet_batch_size", "Decode sessions in the last tick")
        self.prefix_queries = Counter(
            "tokenfleet_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission",
            labels,
            registry=r,
        )
        self.prefix_hits = Counter(
            "tokenfleet_prefix_cache_hits",
            "Prompt tokens whose KV the prefix cache supplied",
            labels,
            registry=r,
        )
        self.prefix_evictions = Counter(
            "tokenfleet_prefix_cache_evictions",
            "Cached KV blocks reclaimed for new allocations",
            labels,
            registry=r,
        )
        self.prefix_recomputed = Counter(
            "tokenfleet_prefix_cache_recomputed",
            "Prefix cache hits' tokens the runner computed again (no cells held them)",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenfleet_prompt_tokens", "Prefill tokens computed", labels, registry=r
        )
        self.generation_tokens = Counter(
            "tokenfleet_generation_tokens", "Tokens generated (decode)", labels, registry=r
        )
        self.finished = Counter(
            "tokenfleet_request_success",
            "Finished jobs by finish reason",
            (*labels, "finished_reason"),
            registry=r,
        )
        self.tenant_finished = Counter(
            "tokenfleet_tenant_finished",
            "Finished jobs by tenant and finish reason",
            (*labels, "tenant", "finished_reason"),
            registry=r,
        )
        self.tenant_tokens = Counter(
            "tokenfleet_tenant_generation_tokens",
            "Tokens generated for each tenant's finished jobs",
            (*labels, "tenant"),
            registry=r,
        )
        self.rejections = Counter(
            "tokenfleet_admission_rejections",
            "Admission rejections by reason",
            (*labels, "reason"),
            registry=r,
        )
        self.ttft = Histogram(
            "tokenfleet_time_to_first_token_seconds",
            "Submit to first token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenfleet_inter_token_latency_seconds",
            "Time between two tokens of one job",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "tokenfleet_request_queue_time_seconds",
            "Submit to admission by a worker",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenfleet_e2e_request_latency_seconds",
            "Submit to finish",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        prefix = (self.prefix_queries, self.prefix_hits, self.prefix_evictions)
        for counter in (*prefix, self.prefix_recomputed):
            counter.labels(**self._labels)  # present from the first scrape, at 0
        for reason in FinishReason:
            self.finished.labels(**self._labels, finished_reason=str(reason))
        for admission in AdmissionReason:
            if not admission.accepted:
                self.rejections.labels(**self._labels, reason=str(admission))
        self._last_token_at: dict[str, float] = {}
        self._rejected_seen: dict[str, int] = {}
        self._prefix_seen = (0, 0, 0, 0)  # queries, hits, evictions, recomputed counted

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def observe_tick(self, engine: Engine, out: StepOutput) -> None:
        now = time.monotonic()
        lab = self._labels
        self.prompt_tokens.labels(**lab).inc(out.prefill_tokens)
        self.generation_tokens.labels(**lab).inc(len(out.tokens))
        for event in out.tokens:
            last = self._last_token_at.get(event.job_id)
            if last is not None:
                self.itl.labels(**lab).observe(now - last)
            self._last_token_at[event.job_id] = now
        self.batch_size.labels(**lab).set(out.decode_tokens)
        self.running.labels(**lab).set(len(engine.sessions))
        self.waiting.labels(**lab).set(len(engine.waiting))
        blocks = engine.blocks
        self.kv_usage.labels(**lab).set(blocks.num_in_use_blocks / max(1, blocks.num_blocks))
        self.kv_cached.labels(**lab).set(blocks.num_cached_blocks / max(1, blocks.num_blocks))
        stats = blocks.stats
        now_seen = (
            stats.queries_tokens,
            stats.hits_tokens,
            stats.evictions,
            stats.recomputed_tokens,
        )
        counters = (
            self.prefix_queries,
            self.prefix_hits,
            self.prefix_evictions,
            self.prefix_recomputed,
        )
        for counter, new, old in zip(counters, now_seen, self._prefix_seen, strict=True):
            if new > old:
                counter.labels(**lab).inc(new - old)
        self._prefix_seen = now_seen
        rejected = engine.telemetry().get("rejected_by_reason")
        if isinstance(rejected, dict):
            for reason, count in rejected.items():
                seen = self._rejected_seen.get(reason, 0)
                if isinstance(count, int) and count > seen:
                    self.rejections.labels(**lab, reason=reason).inc(count - seen)
                    self._rejected_seen[reason] = count

    def observe_finished(self, done: Finished, tenant: str = DEFAULT_TENANT) -> None:
        """A job's terminal outcome, once it is final (not an error about to be retried)."""
        lab = self._labels
        self._last_token_at.pop(done.job_id, None)
        reason = str(done.event.reason)
        self.finished.labels(**lab, finished_reason=reason).inc()
        self.tenant_finished.labels(**lab, tenant=tenant, finished_reason=reason).inc()
        tokens = done.event.usage.completion_tokens
        if tokens:
            self.tenant_tokens.labels(**lab, tenant=tenant).inc(tokens)
        timings = done.event.timings
        if timings.ttft_s is not None:
            self.ttft.labels(**lab).observe(max(0.0, timings.ttft_s))
        if timings.queued_s is not None:
            self.queue_time.labels(**lab).observe(max(0.0, timings.queued_s))
        if timings.total_s is not None:
            self.e2e.labels(**lab).observe(max(0.0, timings.total_s))
