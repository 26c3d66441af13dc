"""Prometheus endpoints scraped after real jobs: a worker's counters match what it did, and
the worker and the gateway export vLLM's names for the signals autoscalers and routers
read (`vllm:num_requests_running` -> `tokenfleet_num_requests_running`, ...), each name
with one meaning (docs/operations.md, "Autoscaling")."""

from __future__ import annotations

import signal
import urllib.request

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.gateway import ServedGateway
from tests.helpers.support import KEYS, wait_for
from tests.helpers.workers import Fleet
from tokenfleet.errors import JobRejected
from tokenfleet.gateway import GatewayConfig
from tokenfleet.gateway.metrics import LATENCY_BUCKETS as GATEWAY_BUCKETS
from tokenfleet.keys import BANDS
from tokenfleet.local import free_port
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest
from tokenfleet.worker.metrics import LATENCY_BUCKETS as WORKER_BUCKETS
from tokenfleet.worker.queue import WorkerQueue

# vLLM's names (without `vllm:`) for what autoscalers and routers read
VLLM_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
VLLM_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in ("worker", "model"))
            )
            samples[(sample.name, labels)] = sample.value
    return samples


Labelled = dict[tuple[str, frozenset[tuple[str, str]]], float]


def labelled(text: str) -> Labelled:
    """Every sample of a Prometheus page with all its labels: (name, labels) -> value."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def one(samples: Labelled, name: str, **labels: str) -> float:
    """The value of the one sample of `name` with exactly `labels`."""
    return samples[(name, frozenset(labels.items()))]


def test_metrics_count_what_the_worker_served(fleet: Fleet, r: redis.Redis) -> None:
    port = free_port()
    worker = fleet.start("metrics-worker", "--metrics-port", str(port), burst=False)
    fleet.wait_alive(worker)
    producer = Producer(r)
    requests = [
        GenerationRequest(
            job_id=f"m{i}",
            prompt_ids=list(range(1, 4 + i)),
            max_new_tokens=5 + i,
            ignore_eos=True,
            tenant="acme" if i < 3 else "default",
        )
        for i in range(4)
    ]
    requests.append(GenerationRequest(job_id="too-long", prompt_ids=[1] * 10, max_new_tokens=5000))
    handles = [producer.submit(request) for request in requests[:4]]
    results = [handle.result(timeout=60) for handle in handles]
    r.xadd(
        Producer(r).keys.jobs(), {"job_id": "too-long", "payload": b"\x00garbage"}
    )  # dead letter, not a metric
    prompt_tokens = sum(res.usage.prompt_tokens for res in results)
    generated = sum(res.usage.completion_tokens for res in results)

    def counted() -> bool:
        m = scrape(port)
        return m.get(("tokenfleet_request_success_total", (("finished_reason", "length"),))) == 4

    wait_for(counted, 30, "4 finished jobs in the metrics")
    m = scrape(port)
    assert m[("tokenfleet_generation_tokens_total", ())] == generated
    assert m[("tokenfleet_prompt_tokens_total", ())] == prompt_tokens
    assert m[("tokenfleet_request_success_total", (("finished_reason", "stop"),))] == 0
    acme = (("finished_reason", "length"), ("tenant", "acme"))
    assert m[("tokenfleet_tenant_finished_total", acme)] == 3
    assert m[("tokenfleet_tenant_generation_tokens_total", (("tenant", "acme"),))] == 5 + 6 + 7
    assert m[("tokenfleet_tenant_generation_tokens_total", (("tenant", "default"),))] == 8
    assert m[("tokenfleet_time_to_first_token_seconds_count", ())] == 4
    assert m[("tokenfleet_e2e_request_latency_seconds_count", ())] == 4
    assert m[("tokenfleet_request_queue_time_seconds_count", ())] == 4
    assert m[("tokenfleet_inter_token_latency_seconds_count", ())] == generated - 4
    assert m[("tokenfleet_num_requests_running", ())] == 0
    assert m[("tokenfleet_num_requests_waiting", ())] == 0
    assert m[("tokenfleet_kv_cache_usage_perc", ())] == 0.0
    # vLLM's six names, one series each, labelled by worker and model
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        page = labelled(response.read().decode())
    mine = {"worker": "metrics-worker", "model": "default"}
    for name in VLLM_GAUGES:
        assert [k for k in page if k[0] == f"tokenfleet_{name}"] == [
            (f"tokenfleet_{name}", frozenset(mine.items()))
        ]
    sums = {n: one(page, f"tokenfleet_{n}_sum", **mine) for n in VLLM_HISTOGRAMS}
    for name in VLLM_HISTOGRAMS:
        assert one(page, f"tokenfleet_{name}_count", **mine) == 4
    # per job: queued (submit -> admitted) <= first token <= end, so the sums are ordered
    assert 0 < sums["request_queue_time_seconds"] <= sums["time_to_first_token_seconds"]
    assert sums["time_to_first_token_seconds"] <= sums["e2e_request_latency_seconds"]
    # every prompt was looked up in the prefix cache; none fills a block, so no hits
    assert m[("tokenfleet_prefix_cache_queries_total", ())] == prompt_tokens
    assert m[("tokenfleet_prefix_cache_hits_total", ())] == 0
    # two jobs, one after the other, sharing 40 prompt tokens: 2 full blocks of 16 hit
    shared = list(range(10, 50))
    for i in range(2):
        producer.submit(prompt_ids=[*shared, 60 + i], max_new_tokens=2, job_id=f"p{i}").result(
            timeout=60
        )
    hits = ("tokenfleet_prefix_cache_hits_total", ())
    wait_for(lambda: scrape(port).get(hits) == 32, 30, "32 prefix-cache hit tokens")
    page_now = scrape(port)
    assert page_now[("tokenfleet_prefix_cache_queries_total", ())] == prompt_tokens + 82
    # the torch runner serves every hit from the pool: none computed again
    assert page_now[("tokenfleet_prefix_cache_recomputed_total", ())] == 0
    # beyond the model's context length (2048): refused by the worker's admission
    too_long = producer.submit(prompt_ids=[1] * 10, max_new_tokens=8000, job_id="never-fits")
    with pytest.raises(JobRejected, match="context length"):
        too_long.result(timeout=60)
    rejected = ("tokenfleet_admission_rejections_total", (("reason", "rejected_invalid"),))
    wait_for(lambda: scrape(port).get(rejected) == 1, 30, "the rejection in the metrics")
    assert worker.proc.poll() is None


def gateway_page(http: httpx.Client) -> Labelled:
    reply = http.get("/metrics")
    assert reply.status_code == 200
    return labelled(reply.text)


def test_the_gateway_exports_vllm_names_for_its_requests_and_the_fleet(
    fleet: Fleet, r: redis.Redis, redis_url: str
) -> None:
    worker = fleet.start("gw-metrics-worker", burst=False)
    fleet.wait_alive(worker)
    gateway = ServedGateway(GatewayConfig(redis_url=redis_url, batches=False, fleet_cache_s=0.0))
    default = {"model": "default"}
    body = {"model": "default", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            assert http.post("/v1/completions", json=body).status_code == 200
            # a stream whose job no worker can start yet: waiting, not running
            worker.signal(signal.SIGSTOP)
            try:
                long = {**body, "max_tokens": 1500, "stream": True}
                with http.stream("POST", "/v1/completions", json=long) as reply:
                    assert reply.status_code == 200
                    page = gateway_page(http)
                    assert one(page, "tokenfleet_gateway_num_requests_waiting", **default) == 1
                    assert one(page, "tokenfleet_gateway_num_requests_running", **default) == 0
                    worker.signal(signal.SIGCONT)

                    def streaming() -> bool:  # its first token came: running
                        now = gateway_page(http)
                        running = one(now, "tokenfleet_gateway_num_requests_running", **default)
                        waiting = one(now, "tokenfleet_gateway_num_requests_waiting", **default)
                        return (running, waiting) == (1, 0)

                    wait_for(streaming, 30, "the streamed request to count as running")
                    lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]" and len(lines) > 2
            finally:
                worker.signal(signal.SIGCONT)
            page = gateway_page(http)
            for name in ("num_requests_waiting", "num_requests_running"):
                assert one(page, f"tokenfleet_gateway_{name}", **default) == 0
            for name in VLLM_HISTOGRAMS:
                assert one(page, f"tokenfleet_gateway_{name}_count", **default) == 2
            sums = {n: one(page, f"tokenfleet_gateway_{n}_sum", **default) for n in VLLM_HISTOGRAMS}
            # the stream's job queued while its worker was stopped: a real wait, and it ends
            # before the request does (arrival -> last token as the gateway saw it)
            assert 0 < sums["request_queue_time_seconds"] < sums["e2e_request_latency_seconds"]
            assert sums["time_to_first_token_seconds"] < sums["e2e_request_latency_seconds"]

            # n = 2: one request, two jobs (a queue time each, one end-to-end latency); then
            # a stream whose client hangs up: its job is cancelled, no end-to-end latency
            assert http.post("/v1/completions", json={**body, "n": 2}).status_code == 200
            with http.stream("POST", "/v1/completions", json=long) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        break
            cancelled = "tokenfleet_gateway_client_cancellations_total"

            def hung_up() -> bool:
                now = gateway_page(http)
                # the counter's sample exists only once the cancel was counted
                seen = now.get((cancelled, frozenset(default.items())), 0)
                return seen == 1 and all(
                    one(now, f"tokenfleet_gateway_{n}", **default) == 0
                    for n in ("num_requests_waiting", "num_requests_running")
                )

            wait_for(hung_up, 30, "the hung-up request to leave the gauges")
            counts = {
                n: one(gateway_page(http), f"tokenfleet_gateway_{n}_count", **default)
                for n in VLLM_HISTOGRAMS
            }
            assert counts == {
                "time_to_first_token_seconds": 4,
                "e2e_request_latency_seconds": 3,
                "request_queue_time_seconds": 4,
            }

            # fleet-wide, from Redis: a model with no worker of its own, jobs in its batch
            # band, one of them held by a worker (pending) whose heartbeat says what it runs
            producer = Producer(r)
            for i in range(3):
                producer.submit(prompt="x", job_id=f"idle-{i}", model="idle", priority="batch")
            holder = WorkerQueue(r, KEYS, "holder", model="idle")
            holder.ensure_group()
            assert len(holder.read(1)) == 1
            holder.heartbeat(
                {"model": "idle", "active": 1, "kv_used_bytes": 1024, "kv_budget_bytes": 4096}
            )
            page = gateway_page(http)
            idle = {"model": "idle"}
            assert one(page, "tokenfleet_queue_depth", band="batch", **idle) == 3
            assert one(page, "tokenfleet_fleet_num_requests_waiting", band="batch", **idle) == 2
            for band in BANDS:  # one series per model and band, as queue_depth has
                assert (
                    "tokenfleet_fleet_num_requests_waiting",
                    frozenset({"model": "default", "band": band}.items()),
                ) in page
            assert one(page, "tokenfleet_fleet_num_requests_running", **idle) == 1
            assert one(page, "tokenfleet_fleet_kv_cache_usage_perc", **idle) == 0.25

            def default_idle() -> bool:  # the real worker's heartbeat, once its jobs ended
                now = gateway_page(http)
                return (
                    one(now, "tokenfleet_fleet_num_requests_running", **default) == 0
                    and one(now, "tokenfleet_fleet_kv_cache_usage_perc", **default) == 0.0
                    and one(now, "tokenfleet_fleet_num_requests_waiting", band="default", **default)
                    == 0
                )

            wait_for(default_idle, 30, "the default model's fleet gauges at rest")
    finally:
        gateway.stop()
    # no name is exported by both a worker and the gateway: each means one thing
    names = {name for name, _labels in page}
    assert not any(n.startswith(tuple(f"tokenfleet_{v}" for v in VLLM_GAUGES)) for n in names)
    assert not any(n.startswith(tuple(f"tokenfleet_{v}" for v in VLLM_HISTOGRAMS)) for n in names)


def test_gateway_and_worker_latency_histograms_share_their_buckets() -> None:
    assert GATEWAY_BUCKETS == WORKER_BUCKETS
