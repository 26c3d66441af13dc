"""The gateway under load and at its limits, against a real redis-server, real worker
processes and uvicorn: many streams over a few pub/sub connections, client hang-ups,
the queue timeout, keep-alives while queued, the body limit, and a Redis restart.

One worker (`lim-w`, default prefix of the session's Redis) for the module. The
queue-timeout and keep-alive tests use fleet prefixes of their own where no worker
runs; the restart test runs its own redis-server (AOF on), worker and gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aredis

from tests.helpers.gateway import FleetEnv, ServedGateway, fleet_env, worker_info
from tests.helpers.support import KEYS, wait_for
from tests.helpers.workers import Fleet
from tokenfleet.gateway import GatewayConfig
from tokenfleet.gateway.app import CLIENT_NAME
from tokenfleet.gateway.subscriber import PUBSUB_CLIENT_NAME
from tokenfleet.keys import Keys
from tokenfleet.local import RedisServer
from tokenfleet.protocol import decode_result

Env = FleetEnv
env = fleet_env([("lim-w", ["--max-batch", "64", "--max-active", "128", "--max-waiting", "64"])])


def sse_data(lines: list[str]) -> list[Any]:
    """The JSON of every `data:` line, and "[DONE]" as itself."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def completion_body(max_tokens: int, *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "default",
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **extra,
    }


# ---- configuration ------------------------------------------------------------------


def test_limits_come_from_the_environment_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenfleet.cli.options import load
    from tokenfleet.config import GatewaySettings

    monkeypatch.setenv("TOKENFLEET_GATEWAY_QUEUE_TIMEOUT", "7.5")
    monkeypatch.setenv("TOKENFLEET_GATEWAY_MAX_BODY_BYTES", "65536")
    monkeypatch.setenv("TOKENFLEET_GATEWAY_REDIS_CONNECTIONS", "12")
    monkeypatch.setenv("TOKENFLEET_GATEWAY_PUBSUB_CONNECTIONS", "3")
    config = load(GatewaySettings)
    assert (config.queue_timeout_s, config.max_body_bytes) == (7.5, 65536)
    assert (config.redis_connections, config.pubsub_connections) == (12, 3)
    flagged = load(GatewaySettings, queue_timeout_s=0, redis_connections=None)  # None: not given
    assert (flagged.queue_timeout_s, flagged.redis_connections) == (None, 12)
    monkeypatch.setenv("TOKENFLEET_GATEWAY_QUEUE_TIMEOUT", "0")  # 0 = wait forever
    assert load(GatewaySettings).queue_timeout_s is None
    defaults = GatewayConfig()  # the app's config reads no environment
    assert (defaults.queue_timeout_s, defaults.max_body_bytes) == (30.0, 4 * 1024 * 1024)
    assert defaults.redis_connections == 64


def test_a_refused_setting_names_its_flag_or_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import typer

    from tokenfleet.cli.options import load
    from tokenfleet.config import GatewaySettings

    monkeypatch.setenv("TOKENFLEET_GATEWAY_PUBSUB_CONNECTIONS", "0")
    with pytest.raises(typer.Exit) as refused:
        load(GatewaySettings, max_body_bytes=10)
    assert refused.value.exit_code == 2
    err = capsys.readouterr().err
    assert "--max-body-bytes: Input should be greater than or equal to 1024" in err
    assert "$TOKENFLEET_GATEWAY_PUBSUB_CONNECTIONS: Input should be greater than or equal" in err


# ---- (a) many streams, a few pub/sub connections ------------------------------------


def test_200_streams_share_two_pubsub_connections_and_a_small_pool(env: Env) -> None:
    gateway = ServedGateway(
        GatewayConfig(redis_url=env.url, pubsub_connections=2, redis_connections=8)
    )
    n = 200
    seen_pubsub: list[int] = []
    seen_commands: list[int] = []

    async def sample(stop: asyncio.Event) -> None:
        client = aredis.Redis.from_url(env.url)
        try:
            while not stop.is_set():
                clients = await client.client_list()
                seen_pubsub.append(sum(c.get("name") == PUBSUB_CLIENT_NAME for c in clients))
                seen_commands.append(sum(c.get("name") == CLIENT_NAME for c in clients))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.05)
        finally:
            await client.aclose()

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, list[Any]]:
        body = completion_body(8, prompt=f"story number {i}")
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            lines = [line async for line in reply.aiter_lines()]
        return reply.status_code, sse_data(lines)

    async def run() -> list[tuple[int, list[Any]]]:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(stop))
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120, limits=limits) as http:
            try:
                return await asyncio.gather(*(one(http, i) for i in range(n)))
            finally:
                stop.set()
                await sampler

    try:
        results = asyncio.run(run())
        health = httpx.get(f"{gateway.url}/health", timeout=30).json()
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    finally:
        gateway.stop()
    assert [status for status, _ in results] == [200] * n
    for _, data in results:
        assert data[-1] == "[DONE]"
        assert not any("error" in chunk for chunk in data[:-1]), data
        assert data[-2]["usage"]["completion_tokens"] == 8
        assert data[-3]["choices"][0]["finish_reason"] == "length"
    assert seen_pubsub and max(seen_pubsub) == 2, seen_pubsub  # never one per stream
    assert max(seen_commands) <= 8, max(seen_commands)  # the pool waits, it never grows
    assert health["pubsub"] == {"connections": 2, "of": 2, "streams": 0}
    # every message came over the two connections as they stayed up (not by replays
    # after reconnects)
    assert "tokenfleet_gateway_pubsub_reconnects 0.0" in metrics


# ---- (b) a client that leaves mid-stream ------------------------------------------


def test_clients_leaving_mid_stream_have_their_jobs_cancelled_and_kv_freed(env: Env) -> None:
    gateway = ServedGateway(GatewayConfig(redis_url=env.url, pubsub_connections=1))

    async def leave_after_three_tokens(http: httpx.AsyncClient) -> str:
        async with http.stream("POST", "/v1/completions", json=completion_body(2000)) as reply:
            assert reply.status_code == 200
            job_id = reply.headers["x-tokenfleet-job-id"]
            data = 0
            async for line in reply.aiter_lines():
                data += line.startswith("data: {")
                if data == 3:
                    break
        return job_id

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            return await asyncio.gather(*(leave_after_three_tokens(http) for _ in range(8)))

    try:
        job_ids = asyncio.run(run())

        def all_cancelled() -> bool:
            reasons = [env.r.hget(KEYS.job(job_id), "finish_reason") for job_id in job_ids]
            return reasons == [b"cancelled"] * len(job_ids)

        wait_for(all_cancelled, 60, "every abandoned job to finish as cancelled")

        def kv_free() -> bool:
            info = worker_info(env.r, "lim-w")
            return info["active"] == 0 and info["kv_used_bytes"] == 0

        wait_for(kv_free, 30, "lim-w to report no active session and no KV in use")
        for job_id in job_ids:
            result = env.r.get(KEYS.result(job_id))
            assert result is not None
            assert decode_result(result).usage.completion_tokens < 2000
    finally:
        gateway.stop()


# ---- (c) no worker: 503 after the queue timeout, and the job is dropped ---------------


def test_no_worker_is_503_with_retry_after_and_the_job_never_runs(env: Env) -> None:
    keys = Keys("lim-idle:")
    config = GatewayConfig(
        redis_url=env.url, prefix=keys.prefix, queue_timeout_s=0.5, retry_after_s=2
    )
    gateway = ServedGateway(config)
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            plain = http.post("/v1/completions", json=completion_body(8, stream=False))
            with http.stream("POST", "/v1/completions", json=completion_body(8)) as streamed:
                lines = list(streamed.iter_lines())
    finally:
        gateway.stop()
    assert plain.status_code == 503, plain.text
    assert plain.headers["retry-after"] == "2"
    assert plain.json()["error"]["code"] == "queue_timeout"
    assert streamed.status_code == 200  # the headers went at once: the error is an event
    data = sse_data(lines)
    assert data[-1] == "[DONE]"
    assert data[0]["error"]["code"] == "queue_timeout", data
    job_ids = [plain.headers["x-tokenfleet-job-id"], streamed.headers["x-tokenfleet-job-id"]]
    for job_id in job_ids:
        assert env.r.exists(keys.cancel(job_id)), "the timed-out job was not cancelled"
        assert env.r.hget(keys.job(job_id), "status") == b"queued"

    # a worker that comes later drops both without any prefill
    worker = env.fleet.start("lim-idle-w", "--prefix", keys.prefix, burst=False)

    def finished() -> bool:
        return all(env.r.exists(keys.result(job_id)) for job_id in job_ids)

    wait_for(finished, 90, "the late worker to end both jobs")
    for job_id in job_ids:
        result = decode_result(env.r.get(keys.result(job_id)) or b"")
        assert result.finish_reason in ("deadline", "cancelled"), result
        assert result.usage.completion_tokens == 0

    def counted() -> dict[str, Any]:
        info = worker_info(env.r, worker.name, keys)
        done = sum(info.get("finished_by_reason", {}).values()) >= 2
        return info if done else {}

    wait_for(counted, 30, "the late worker's telemetry to count both jobs")
    assert worker_info(env.r, worker.name, keys)["prefill_tokens_total"] == 0
    worker.kill()


# ---- (d) keep-alive comments while a job is queued ------------------------------------


def test_streams_get_headers_at_once_and_keepalives_while_queued(env: Env) -> None:
    keys = Keys("lim-queued:")
    config = GatewayConfig(redis_url=env.url, prefix=keys.prefix, keepalive_s=0.1)
    gateway = ServedGateway(config)
    try:
        with (
            httpx.Client(base_url=gateway.url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=completion_body(8)) as reply,
        ):
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            job_id = reply.headers["x-tokenfleet-job-id"]
            received: list[str] = []
            for line in reply.iter_lines():
                received.append(line)
                if received.count(": keep-alive") == 3:
                    break
        assert not any(line.startswith("data:") for line in received), received
        # the client left while its job was queued: it is cancelled
        wait_for(lambda: env.r.exists(keys.cancel(job_id)), 30, "the queued job's cancel flag")
    finally:
        gateway.stop()


# ---- (e) the body limit ---------------------------------------------------------------


def test_oversized_bodies_are_413_before_being_read(env: Env) -> None:
    limit = 64 * 1024
    gateway = ServedGateway(GatewayConfig(redis_url=env.url, max_body_bytes=limit))
    big = json.dumps({"model": "default", "prompt": "x" * (4 * limit)}).encode()

    def chunked() -> Iterator[bytes]:
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            declared = http.post("/v1/completions", content=big)
            streamed = http.post("/v1/completions", content=chunked())
            fits = http.post("/v1/completions", json=completion_body(2, stream=False))
            counted = http.get("/metrics").text
    finally:
        gateway.stop()
    for reply in (declared, streamed):
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert error["code"] == "body_too_large"
        assert f"{limit:,} bytes" in error["message"]
    assert "transfer-encoding" not in declared.request.headers
    assert streamed.request.headers["transfer-encoding"] == "chunked"
    assert fits.status_code == 200, fits.text
    assert "tokenfleet_gateway_body_too_large_total 2.0" in counted


def test_an_upload_over_the_file_limit_names_the_file_limit(env: Env) -> None:
    """POST /v1/files has its own limit (the file limit, plus room for the form): its 413
    names that and its value, not --max-body-bytes (which it named, whichever applied)."""
    from tokenfleet.gateway.app import FORM_BYTES, upload_limit

    files, body = 64 * 1024, 16 * 1024
    config = GatewayConfig(redis_url=env.url, max_body_bytes=body, max_file_bytes=files)
    gateway = ServedGateway(config)
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            big = http.post(
                "/v1/files",
                files={"file": ("big.jsonl", b"x" * (3 * files))},
                data={"purpose": "batch"},
            )
            # over the body limit, under the upload's: stored
            fits = http.post(
                "/v1/files",
                files={"file": ("ok.jsonl", b"{}\n" * (body // 2))},
                data={"purpose": "batch"},
            )
    finally:
        gateway.stop()
    assert big.status_code == 413, big.text
    error = big.json()["error"]
    assert (error["code"], error["param"]) == ("file_too_large", "file")
    message = error["message"]
    assert f"the limit is {files + FORM_BYTES:,} bytes" in message, message
    assert f"a file of at most {files:,} bytes, TOKENFLEET_GATEWAY_MAX_FILE_BYTES" in message
    assert "--max-body-bytes" not in message
    assert fits.status_code == 200, fits.text
    # where the body limit is the bigger one, that is the limit the upload gets, and names
    roomy = upload_limit(GatewayConfig(max_body_bytes=files * 4, max_file_bytes=files))
    assert (roomy.max_bytes, roomy.source, roomy.code) == (
        files * 4,
        "--max-body-bytes",
        "body_too_large",
    )


# ---- (f) a Redis restart under a live stream ----------------------------------------


@pytest.mark.fault
def test_a_stream_survives_a_redis_restart(aof_redis: RedisServer, tmp_path: Path) -> None:
    server = aof_redis
    fleet = Fleet(server.url, tmp_path)
    gateway = None
    try:
        worker = fleet.start("aof-w", burst=False)
        fleet.wait_alive(worker)
        gateway = ServedGateway(GatewayConfig(redis_url=server.url, pubsub_connections=1))
        body = completion_body(600)
        lines: list[str] = []
        with (
            httpx.Client(base_url=gateway.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as reply,
        ):
            assert reply.status_code == 200
            job_id = reply.headers["x-tokenfleet-job-id"]
            stream = reply.iter_lines()
            for line in stream:
                lines.append(line)
                if sum(x.startswith("data: {") for x in lines) == 3:
                    server.restart()  # SIGTERM: the AOF is flushed; the same port again
                    break
            lines.extend(stream)
            metrics = http.get("/metrics").text
    finally:
        if gateway is not None:
            gateway.stop()
        fleet.stop_all()
    data = sse_data(lines)
    assert data[-1] == "[DONE]"
    assert not any("error" in chunk for chunk in data[:-1]), data
    assert data[-2]["usage"]["completion_tokens"] == 600
    text = "".join(chunk["choices"][0]["text"] for chunk in data[:-1] if chunk["choices"])
    r = redis.Redis.from_url(server.url)
    stored = decode_result(r.get(KEYS.result(job_id)) or b"")
    r.close()
    assert stored.usage.completion_tokens == 600
    assert text == stored.text  # every token once, in order, across the restart
    reconnects = [
        line for line in metrics.splitlines() if line.startswith("tokenfleet_gateway_pubsub_re")
    ]
    assert reconnects and float(reconnects[0].split()[-1]) >= 1, reconnects
