"""Priorities and tenants at the gateway and in batches.

API keys name a tenant and a default priority (`KEY`, `KEY=TENANT`,
`KEY=TENANT:PRIORITY`); a request's `service_tier` / `priority` pick its band; the job
lands in that band's stream with the key's tenant (read back from the stream entry, no
worker needed); a tenant at its queued limit (submit.lua, for real) is a 429 naming it;
/v1/batches and `tokenfleet batch run` submit at batch priority under their tenant and
count the batch band for backpressure. One test runs a real worker for the
`service_tier` echo.

Tests without a worker each run on a prefix of their own (no live worker there, so jobs
just queue) and never flush: the module's worker keeps its state on the default prefix.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.helpers.gateway import GatewayEnv, ServedGateway, gateway_env, jsonl
from tests.helpers.support import wait_for
from tokenfleet.batch.format import parse_input, to_request
from tokenfleet.batch.offline import Progress, run_batch
from tokenfleet.gateway import GatewayConfig, create_app
from tokenfleet.gateway.auth import ApiKey, Caller, parse_api_key, parse_api_keys
from tokenfleet.keys import Keys
from tokenfleet.local import RedisServer
from tokenfleet.openai.models import ChatCompletionRequest, CompletionRequest
from tokenfleet.openai.render import Renderer
from tokenfleet.producer import Producer
from tokenfleet.protocol import FinishEvent, GenerationRequest, Usage, decode_request
from tokenfleet.reasons import FinishReason

KEYS_CONFIG = ("k-plain", "k-acme=acme", "k-bulk=acme:batch", "k-vip=vip:interactive")
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# ---- key syntax (pure) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "token", "tenant", "priority"),
    [
        ("secret", "secret", "default", "default"),
        ("secret=acme", "secret", "acme", "default"),
        ("secret=acme:batch", "secret", "acme", "batch"),
        ("secret=team.a-1_x:interactive", "secret", "team.a-1_x", "interactive"),
        ("padded===default", "padded==", "default", "default"),  # '=' in a key: name a tenant
    ],
)
def test_key_entries_name_a_tenant_and_a_default_priority(
    entry: str, token: str, tenant: str, priority: str
) -> None:
    key = parse_api_key(entry)
    assert key == ApiKey(token, Caller(tenant, priority))  # type: ignore[arg-type]
    assert token not in repr(key)  # a key is never shown


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("=acme", "the key is empty"),
        ("s3cr3t-token==", "no tenant after '='"),
        ("s3cr3t-token=", "no tenant after '='"),
        ("s3cr3t-token=:batch", "no tenant after '='"),
        ("s3cr3t-token=bad tenant", "tenant 'bad tenant' does not match"),
        ("s3cr3t-token=" + "t" * 65, "does not match"),
        ("s3cr3t-token=acme:urgent", "priority 'urgent' is not one of interactive, default"),
        ("s3cr3t-token=acme:", "priority '' is not one of"),
    ],
)
def test_a_bad_key_entry_is_a_startup_error_naming_its_position(entry: str, words: str) -> None:
    with pytest.raises(ValueError, match="API key entry #2") as bad:
        create_app(GatewayConfig(api_keys=("fine", entry)))
    assert words in str(bad.value)
    assert "s3cr3t" not in str(bad.value)


def test_one_key_with_two_grants_is_refused_and_repeats_are_one() -> None:
    with pytest.raises(ValueError, match="entry #2: the same key is given earlier"):
        parse_api_keys(("k=acme", "k=other"))
    assert parse_api_keys(("k", "k=default:default")) == (ApiKey("k"),)
    assert parse_api_keys(GatewayConfig(api_keys=KEYS_CONFIG).api_keys)[2] == ApiKey(
        "k-bulk", Caller("acme", "batch")
    )


def test_the_gateway_command_refuses_a_bad_entry_without_echoing_the_key() -> None:
    import typer
    from typer.testing import CliRunner

    from tokenfleet.cli.gateway import gateway

    app = typer.Typer()
    app.command()(gateway)
    env = {"TOKENFLEET_API_KEYS": "good=acme,hunter2=acme:asap"}
    refused = CliRunner().invoke(app, ["--api-key", "flagged"], env=env)
    assert refused.exit_code == 2
    assert "API key entry #3" in refused.output  # the flag's key is #1, then the env's
    assert "priority 'asap'" in refused.output
    assert "hunter2" not in refused.output


# ---- service_tier / priority (pure) ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "under_default_key", "under_batch_key"),
    [
        ({}, "default", "batch"),
        ({"service_tier": "auto"}, "default", "batch"),
        ({"service_tier": "default"}, "default", "batch"),
        ({"service_tier": "priority"}, "interactive", "interactive"),
        ({"service_tier": "flex"}, "batch", "batch"),
        ({"priority": -5}, "interactive", "interactive"),
        ({"priority": 0}, "default", "batch"),
        ({"priority": 3}, "batch", "batch"),
        ({"service_tier": "flex", "priority": 1}, "batch", "batch"),  # agreeing: fine
        ({"service_tier": "auto", "priority": 0}, "default", "batch"),
    ],
)
def test_service_tier_and_priority_pick_the_band(
    fields: dict[str, Any], under_default_key: str, under_batch_key: str
) -> None:
    for model in (CompletionRequest, ChatCompletionRequest):
        base = {"model": "default", "prompt": "x"} if model is CompletionRequest else CHAT
        parsed = model.model_validate({**base, **fields})
        assert parsed.band("default") == under_default_key
        assert parsed.band("batch") == under_batch_key


def test_the_band_is_echoed_as_openai_names_the_tier() -> None:
    finish = FinishEvent(job_id="j1", reason=FinishReason.STOP, usage=Usage())
    for tier in ("default", "priority", "flex"):
        out = Renderer("chat", "j1", "default", 0, tier)
        assert out.body("hi", finish).model_dump()["service_tier"] == tier
        chunks = [out.opening(), out.delta("hi"), out.closing(finish, include_usage=True)]
        events = [
            json.loads(line.removeprefix(b"data: "))
            for chunk in chunks
            for line in chunk.split(b"\n\n")
            if line.startswith(b"data: {")
        ]
        assert len(events) == 4 and {e["service_tier"] for e in events} == {tier}


def test_batch_lines_become_batch_band_jobs_of_the_batch_tenant() -> None:
    line = chat_line("c1", service_tier="priority")  # a line's own tier is not the batch's
    [parsed] = parse_input(jsonl([line]), "/v1/chat/completions")
    job = to_request("batch_x", parsed, None, tenant="acme")
    assert (job.priority, job.tenant, job.job_id) == ("batch", "acme", "batch_x-0")
    assert to_request("batch_x", parsed, None).tenant == "default"
    assert to_request("batch_x", parsed, None, priority="default").priority == "default"


# ---- against a real Redis, no worker -----------------------------------------------------


@pytest.fixture
def keys() -> Keys:
    """A prefix of the test's own: no live worker there, nothing left by other tests."""
    return Keys(f"prio-{uuid.uuid4().hex[:8]}:")


@pytest.fixture
def rc(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the session's Redis that never flushes it (the module's worker lives
    there too)."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@contextlib.contextmanager
def served(url: str, keys: Keys, **config: Any) -> Iterator[ServedGateway]:
    gateway = ServedGateway(
        GatewayConfig(redis_url=url, prefix=keys.prefix, fleet_cache_s=0.0, **config)
    )
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture
def gateway(redis_server: RedisServer, keys: Keys) -> Iterator[ServedGateway]:
    """A gateway with KEYS_CONFIG's keys on the test's prefix; it drives no batches."""
    with served(redis_server.url, keys, api_keys=KEYS_CONFIG, batches=False) as gw:
        yield gw


def post(
    gateway: ServedGateway, body: dict[str, Any], key: str | None = "k-plain"
) -> tuple[int, str | None, dict[str, Any] | None]:
    """A streamed chat request: (status, its job id, None) once the job is accepted (the
    connection is then closed, which cancels the job but leaves its stream entry to a
    worker that never comes), or (status, None, the error body) when refused."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"{gateway.url}/v1/chat/completions"
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url, json={**body, "stream": True}, headers=headers) as reply,
    ):
        if reply.status_code == 200:
            return 200, reply.headers["x-tokenfleet-job-id"], None
        return reply.status_code, None, json.loads(reply.read())


def queued(r: redis.Redis, keys: Keys, band: str) -> dict[str, GenerationRequest]:
    """The jobs waiting in the default model's `band` stream, by id, as workers read them."""
    entries = r.xrange(keys.jobs(None, band))
    return {f[b"job_id"].decode(): decode_request(f[b"payload"]) for _, f in entries}


def band_of(r: redis.Redis, keys: Keys, job_id: str) -> tuple[str, GenerationRequest]:
    found = []
    for band in ("interactive", "default", "batch"):
        jobs = queued(r, keys, band)
        if job_id in jobs:
            found.append((band, jobs[job_id]))
    assert len(found) == 1, f"{job_id} is in {len(found)} bands"
    return found[0]


def test_flex_lands_in_the_batch_band_with_the_keys_tenant(
    gateway: ServedGateway, rc: redis.Redis, keys: Keys
) -> None:
    status, job_id, _ = post(gateway, {**CHAT, "service_tier": "flex"}, key="k-acme")
    assert status == 200 and job_id is not None
    band, job = band_of(rc, keys, job_id)
    assert (band, job.priority, job.tenant) == ("batch", "batch", "acme")
    assert rc.hget(keys.job(job_id), "tenant") == b"acme"

    status, job_id, _ = post(gateway, CHAT, key="k-acme")  # no tier: the key's default
    assert job_id is not None
    assert band_of(rc, keys, job_id)[0] == "default"


def test_a_negative_priority_is_interactive(
    gateway: ServedGateway, rc: redis.Redis, keys: Keys
) -> None:
    _, job_id, _ = post(gateway, {**CHAT, "priority": -1})
    assert job_id is not None
    band, job = band_of(rc, keys, job_id)
    assert (band, job.priority, job.tenant) == ("interactive", "interactive", "default")
    _, job_id, _ = post(gateway, {**CHAT, "priority": 7})
    assert job_id is not None and band_of(rc, keys, job_id)[0] == "batch"


def test_a_batch_key_sends_default_tier_requests_to_the_batch_band(
    gateway: ServedGateway, rc: redis.Redis, keys: Keys
) -> None:
    asked = {
        "default": "batch",
        "auto": "batch",
        "priority": "interactive",  # a request may still ask for more
        "flex": "batch",
    }
    for tier, band in asked.items():
        _, job_id, _ = post(gateway, {**CHAT, "service_tier": tier}, key="k-bulk")
        assert job_id is not None
        assert band_of(rc, keys, job_id) == (band, queued(rc, keys, band)[job_id])
        assert queued(rc, keys, band)[job_id].tenant == "acme"
    _, job_id, _ = post(gateway, {**CHAT, "priority": 0}, key="k-bulk")
    assert job_id is not None and band_of(rc, keys, job_id)[0] == "batch"
    _, job_id, _ = post(gateway, CHAT, key="k-vip")
    assert job_id is not None and band_of(rc, keys, job_id)[1].tenant == "vip"
    assert band_of(rc, keys, job_id)[0] == "interactive"


def test_conflicting_or_unknown_fields_are_400_and_nothing_is_queued(
    gateway: ServedGateway, rc: redis.Redis, keys: Keys
) -> None:
    cases = [
        ({"service_tier": "flex", "priority": -1}, "priority", "ask for different priorities"),
        ({"service_tier": "priority", "priority": 0}, "priority", "ask for different"),
        ({"service_tier": "default", "priority": 2}, "priority", "give one of them"),
        ({"service_tier": "scale"}, "service_tier", "'auto', 'default', 'priority' or 'flex'"),
        ({"priority": "high"}, "priority", "valid integer"),
        ({"tenant": "other"}, "tenant", "not permitted"),  # the key's tenant only
    ]
    for fields, param, words in cases:
        status, _, body = post(gateway, {**CHAT, **fields})
        assert status == 400 and body is not None, fields
        error = body["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), error
        assert words in error["message"], error
    assert all(rc.xlen(band.stream) == 0 for band in keys.bands())


def test_a_tenant_at_its_limit_is_429_naming_it_and_others_still_get_in(
    gateway: ServedGateway, rc: redis.Redis, keys: Keys
) -> None:
    """submit.lua's tenant limit, for real: a queued_share of 1% of a cap of 100 lets
    acme queue one job of the model (both acme keys count), not two."""
    Producer(rc, keys=keys).set_queue_cap(100)
    rc.hset(keys.tenant_limits("acme"), "queued_share", "0.01")
    assert post(gateway, CHAT, key="k-acme")[0] == 200
    status, _, body = post(gateway, {**CHAT, "service_tier": "flex"}, key="k-bulk")
    assert status == 429 and body is not None
    error = body["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "tenant_queue_full")
    assert "tenant 'acme'" in error["message"] and "limit 1" in error["message"]
    assert post(gateway, CHAT, key="k-plain")[0] == 200  # the fleet is not full
    assert post(gateway, CHAT, key="k-vip")[0] == 200
    counted = (
        'tokenfleet_gateway_tenant_queue_full_rejections_total{model="default",tenant="acme"} 1.0'
    )
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    assert counted in metrics
    assert 'tokenfleet_gateway_queue_full_rejections_total{model="default"}' not in metrics


def test_a_full_band_is_still_queue_full(
    gateway: ServedGateway, rc: redis.Redis, keys: Keys
) -> None:
    """Each band has the cap: a full batch band refuses flex work (`queue_full`, not the
    tenant's code) while interactive work still gets in."""
    Producer(rc, keys=keys).set_queue_cap(1)
    assert post(gateway, {**CHAT, "service_tier": "flex"})[0] == 200
    status, _, body = post(gateway, {**CHAT, "service_tier": "flex"})
    assert status == 429 and body is not None and body["error"]["code"] == "queue_full"
    assert post(gateway, {**CHAT, "service_tier": "priority"})[0] == 200


def test_without_keys_every_request_is_the_default_tenant(
    redis_server: RedisServer, rc: redis.Redis, keys: Keys
) -> None:
    with served(redis_server.url, keys, batches=False) as gateway:
        _, job_id, _ = post(gateway, {**CHAT, "service_tier": "flex"}, key=None)
    assert job_id is not None
    band, job = band_of(rc, keys, job_id)
    assert (band, job.tenant) == ("batch", "default")


# ---- batches ---------------------------------------------------------------------------


def chat_line(custom_id: str, **extra: Any) -> dict[str, Any]:
    body = {**CHAT, "temperature": 0, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_a_batch_runs_at_batch_priority_for_its_creators_tenant(
    redis_server: RedisServer, rc: redis.Redis, keys: Keys
) -> None:
    """The driver counts the batch band against queue_share, not the default band: with
    a cap of 4 and the default band holding 2 (half), it still submits 2 lines."""
    producer = Producer(rc, keys=keys)
    producer.set_queue_cap(4)
    for i in range(2):
        producer.submit(prompt="interactive work", max_new_tokens=4, job_id=f"direct-{i}")
    with served(redis_server.url, keys, api_keys=KEYS_CONFIG) as gateway:
        client = gateway.client("k-acme")
        upload = client.files.create(
            file=("in.jsonl", jsonl([chat_line(f"b{i}") for i in range(5)])), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(lambda: rc.xlen(keys.jobs(None, "batch")) == 2, 30, "two lines submitted")
        public = client.batches.retrieve(batch.id)
    assert public.status == "in_progress"
    assert not any(k.startswith("tokenfleet_") for k in public.model_dump())
    jobs = queued(rc, keys, "batch")
    assert sorted(jobs) == [f"{batch.id}-0", f"{batch.id}-1"]
    assert {(j.priority, j.tenant) for j in jobs.values()} == {("batch", "acme")}
    assert producer.depth() == 2  # nothing of the batch in the default band


class _Stop(Exception):
    pass


def test_batch_run_submits_at_its_priority_for_its_tenant(
    rc: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """`run_batch` with no worker: stopped after its first round of submits, its jobs
    are in the band it was given (batch unless told), under its tenant."""
    producer = Producer(rc, keys=keys)

    def stop(_: Progress) -> None:
        raise _Stop

    for options, band, tenant in (
        ({}, "batch", "default"),
        ({"tenant": "acme", "priority": "interactive"}, "interactive", "acme"),
    ):
        source = tmp_path / f"{band}-in.jsonl"  # job ids come from the file's content
        source.write_bytes(jsonl([chat_line(f"{band}{i}") for i in range(3)]))
        with pytest.raises(_Stop):
            run_batch(producer, source, tmp_path / f"{band}.jsonl", on_progress=stop, **options)
        jobs = queued(rc, keys, band)
        assert len(jobs) == 3
        assert {(j.priority, j.tenant) for j in jobs.values()} == {(band, tenant)}
    assert producer.depth() == 0


def test_batch_run_refuses_a_bad_tenant_or_priority() -> None:
    from typer.testing import CliRunner

    from tokenfleet.cli import app

    source = Path(__file__)  # exists; never read
    for flags, words in (
        (["--tenant", "no spaces"], "--tenant 'no spaces' does not match"),
        (["--priority", "urgent"], "--priority 'urgent' is not one of"),
    ):
        args = ["batch", "run", str(source), "-o", "/dev/null", *flags]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert words in result.output


# ---- with a worker: the tier echoed ----------------------------------------------------


worker_env = gateway_env([("prio-w", [])])


def test_responses_name_the_tier_the_job_ran_at(worker_env: GatewayEnv) -> None:
    client = worker_env.gateway.client()
    messages = [{"role": "user", "content": "hi"}]
    # ignore_eos: the random model's unseeded first token may be its end-of-sequence
    whole = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=4,
        service_tier="flex",
        extra_body={"ignore_eos": True},
    )
    assert whole.service_tier == "flex"
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=4,
            stream=True,
            extra_body={"priority": -1},
        )
    )
    assert chunks and {c.service_tier for c in chunks} == {"priority"}
    plain = client.chat.completions.create(model="default", messages=messages, max_tokens=2)
    assert plain.service_tier == "default"
