"""A worker's Prometheus endpoint, scraped after it served jobs: counters match what it did."""

from __future__ import annotations

import urllib.request

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.support import wait_for
from tests.helpers.workers import Fleet
from tokenfleet.errors import JobRejected
from tokenfleet.local import free_port
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest


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
    assert m[("tokenfleet_kv_cache_usage_perc", ())] == 0.0
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
    assert scrape(port)[("tokenfleet_prefix_cache_queries_total", ())] == prompt_tokens + 82
    # beyond the model's context length (2048): refused by the worker's admission
    too_long = producer.submit(prompt_ids=[1] * 10, max_new_tokens=8000, job_id="never-fits")
    with pytest.raises(JobRejected, match="context length"):
        too_long.result(timeout=60)
    rejected = ("tokenfleet_admission_rejections_total", (("reason", "rejected_invalid"),))
    wait_for(lambda: scrape(port).get(rejected) == 1, 30, "the rejection in the metrics")
    assert worker.proc.poll() is None
