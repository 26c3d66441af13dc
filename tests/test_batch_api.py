"""OpenAI's Batch API on the gateway (issue 14, part 1), driven by the official `openai`
client against a real redis-server and real worker processes: files.create,
batches.create, polling, files.content; an unusable file fails the batch; cancel and
expiry, after which every line not finished is an error line (issue 21); backpressure
from a small queue cap; and a gateway killed mid-batch (SIGKILL, a real
`tokenfleet gateway` process) whose batch another gateway finishes, every line run once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio as aredis

from tests.helpers.gateway import GatewayEnv, ServedGateway, gateway_env, jsonl
from tests.helpers.support import KEYS, wait_for
from tokenfleet.batch.format import (
    BatchStop,
    job_id_for,
    parse_input,
    result_line,
    succeeded,
)
from tokenfleet.batch.store import BatchStore
from tokenfleet.gateway import GatewayConfig
from tokenfleet.local import RedisServer, free_port
from tokenfleet.producer import Producer
from tokenfleet.protocol import JobResult, Usage
from tokenfleet.reasons import FinishReason

ROOT = Path(__file__).resolve().parent.parent


# One worker for the module. Its gateway drives no batches: each test runs the gateway
# (or gateways) whose driver it is about, so no other replica takes its batch.
env = gateway_env([("batch-w", ["--max-active", "8"])], batches=False)


def driving(url: str, **config: Any) -> ServedGateway:
    return ServedGateway(GatewayConfig(redis_url=url, fleet_cache_s=0.0, **config))


@pytest.fixture
def driver(redis_server: RedisServer) -> Iterator[ServedGateway]:
    """A gateway that drives batches (the default settings)."""
    gateway = driving(redis_server.url)
    yield gateway
    gateway.stop()


def chat_line(custom_id: str, text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def wait_status(
    client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 90
) -> Any:
    seen: list[Any] = []

    def reached() -> bool:
        seen.append(client.batches.retrieve(batch_id))
        return seen[-1].status in statuses

    wait_for(reached, timeout, f"batch {batch_id} to be {statuses}")
    return seen[-1]


def wait_lines_done(client: openai.OpenAI, batch_id: str, at_least: int) -> None:
    """Until at least `at_least` of the batch's lines completed."""
    wait_for(
        lambda: client.batches.retrieve(batch_id).request_counts.completed >= at_least,
        60,
        f"{at_least} line(s) of {batch_id} done",
    )


def start_batch(client: openai.OpenAI, data: bytes) -> Any:
    """Upload `data` as a batch input file and create a chat-completions batch of it."""
    upload = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def job_hashes(r: redis.Redis, batch_id: str) -> list[bytes]:
    """The state hashes of the batch's jobs (`job:BATCH-N`), one per submitted line."""
    return [k for k in r.scan_iter(f"{KEYS.prefix}job:{batch_id}-*") if k.count(b":") == 2]


def lines_of(client: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_end_to_end_with_the_openai_client(
    env: GatewayEnv, driver: ServedGateway
) -> None:
    client = driver.client()
    requests = [chat_line(f"q{i}", f"question number {i}", 4 + i) for i in range(5)]
    requests.insert(2, chat_line("bad", "two answers", 5, n=2))  # a body the fleet refuses
    upload = client.files.create(file=("in.jsonl", jsonl(requests)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(requests))
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "e2e"},
    )
    assert batch.status == "validating" and batch.metadata == {"run": "e2e"}
    done = wait_status(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done.errors
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.output_file_id and done.error_file_id

    out = lines_of(client, done.output_file_id)
    assert [line["custom_id"] for line in out] == [f"q{i}" for i in range(5)]  # line order
    for i, line in enumerate(out):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 4 + i
        # the same request answered directly: greedy, so the same text
        asked = dict(requests[i if i < 2 else i + 1]["body"])
        extra = {"ignore_eos": asked.pop("ignore_eos")}  # an extension: the client's extra_body
        direct = client.chat.completions.create(**asked, extra_body=extra)
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    errors = lines_of(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert (
        errors[0]["error"]["code"] == "invalid_request" and "n=2" in errors[0]["error"]["message"]
    )

    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_an_unusable_file_fails_the_batch_naming_its_lines(
    env: GatewayEnv, driver: ServedGateway
) -> None:
    client = driver.client()
    data = jsonl([chat_line("same", "a", 2), chat_line("same", "b", 2)]) + b"{not json\n"
    upload = client.files.create(file=("bad.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = wait_status(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed"
    problems = [(e.code, e.line) for e in failed.errors.data]
    assert problems == [("duplicate_custom_id", 2), ("invalid_json_line", 3)]
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file_nope", endpoint="/v1/chat/completions", completion_window="24h"
        )


def test_one_rule_says_which_file_a_finished_job_is_in() -> None:
    """`result_line`, which the gateway's driver and `tokenfleet batch run` both use: a
    job the model ended (stop, length) is a success; a cancelled job is an error line
    with no response, coded by who stopped it, its partial text dropped."""
    line = parse_input(jsonl([chat_line("x", "q", 8)]), "/v1/chat/completions")[0]

    def ended(reason: FinishReason) -> JobResult:
        usage = Usage(prompt_tokens=3, completion_tokens=5)
        return JobResult(job_id="b-0", text="PARTIAL", finish_reason=reason, usage=usage)

    for reason in (FinishReason.STOP, FinishReason.LENGTH):
        for stopped in (None, BatchStop.CANCELLED):  # ended by itself before the cancel
            entry, ok = result_line("b", line, ended(reason), stopped)
            assert ok and succeeded(entry) and entry["response"]["status_code"] == 200
    codes = {
        (FinishReason.CANCELLED, BatchStop.CANCELLED): "batch_cancelled",
        (FinishReason.CANCELLED, BatchStop.EXPIRED): "batch_expired",
        (FinishReason.CANCELLED, None): "request_cancelled",  # the job itself was cancelled
        (FinishReason.DEADLINE, None): "request_timeout",
    }
    for (reason, stopped), code in codes.items():
        entry, ok = result_line("b", line, ended(reason), stopped)
        assert not ok and not succeeded(entry)
        assert entry["response"] is None and entry["error"]["code"] == code
        assert "b-0" in entry["error"]["message"] and "5 generated" in entry["error"]["message"]
        assert "PARTIAL" not in json.dumps(entry)


def job_running(r: redis.Redis, job_id: str) -> bool:
    return bool(r.hget(KEYS.job(job_id), "status") == b"running")


def submitted_lines(r: redis.Redis, batch_id: str) -> set[int]:
    """The line numbers of the batch that became jobs."""
    return {int(key.rsplit(b"-", 1)[1]) for key in job_hashes(r, batch_id)}


def test_a_cancelled_batch_reports_every_line_it_stopped_as_batch_cancelled(
    env: GatewayEnv, redis_server: RedisServer
) -> None:
    """A gateway whose batches keep 4 jobs out: 4 short lines end, then long ones run and
    the batch is cancelled. It ends `cancelled` with the short lines, and only them, in
    its output, counted completed; every long line, its job cut short or never
    submitted, is in the error file coded `batch_cancelled` and counted failed."""
    gateway = driving(redis_server.url, batch_max_in_flight=4)
    try:
        client = gateway.client()
        short = [chat_line(f"s{i}", f"short {i}", 3) for i in range(4)]
        long = [chat_line(f"l{i}", f"long answer {i}", 1500) for i in range(20)]
        batch = start_batch(client, jsonl(short + long))
        wait_lines_done(client, batch.id, 4)
        first_long = job_id_for(batch.id, 4)
        wait_for(lambda: job_running(env.r, first_long), 60, "a long line to run")
        assert client.batches.cancel(batch.id).status == "cancelling"
        ended = wait_status(client, batch.id, {"cancelled"})
        counts = ended.request_counts
        assert (counts.total, counts.completed, counts.failed) == (24, 4, 20)

        out = lines_of(client, ended.output_file_id)
        assert [line["custom_id"] for line in out] == [f"s{i}" for i in range(4)]
        for line in out:
            choice = line["response"]["body"]["choices"][0]
            assert (choice["finish_reason"], choice["fleet_finish_reason"]) == ("length", "length")

        errors = lines_of(client, ended.error_file_id)
        assert [e["custom_id"] for e in errors] == [f"l{i}" for i in range(20)]  # line order
        assert {(e["response"] is None, e["error"]["code"]) for e in errors} == {
            (True, "batch_cancelled")
        }
        # the long lines that became jobs were cut short (their message names the job);
        # the rest were never submitted
        ran = submitted_lines(env.r, batch.id) - set(range(4))
        assert 1 <= len(ran) <= 4 and ran == set(range(4, 4 + len(ran)))  # in line order
        for index, entry in enumerate(errors, start=4):
            message = entry["error"]["message"]
            if index in ran:
                assert f"its job {job_id_for(batch.id, index)} was stopped after" in message
            else:
                assert message.endswith("before this request was submitted")
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)
    finally:
        gateway.stop()


def expire_now(url: str, batch_id: str) -> None:
    """Move a batch that no driver holds past the end of its completion window."""

    async def expire() -> None:
        client = aredis.Redis.from_url(url)
        try:
            store = BatchStore(client, KEYS, max_file_bytes=1)
            doc = await store.batch(batch_id)
            doc["expires_at"] = doc["created_at"]
            await store.save_batch(doc)
        finally:
            await client.aclose()

    asyncio.run(expire())


def test_an_expired_batch_reports_every_line_as_batch_expired(
    env: GatewayEnv, redis_server: RedisServer
) -> None:
    """A batch already past its window when a driver takes it submits nothing and ends
    `expired`, each line in the error file coded `batch_expired`, counted failed."""
    batch = start_batch(
        env.gateway.client(), jsonl([chat_line(f"e{i}", "late", 3) for i in range(3)])
    )
    expire_now(redis_server.url, batch.id)  # the module's gateway drives no batches
    gateway = driving(redis_server.url)
    try:
        client = gateway.client()
        ended = wait_status(client, batch.id, {"expired", "completed", "cancelled"})
        assert ended.status == "expired" and ended.expired_at and ended.output_file_id is None
        counts = ended.request_counts
        assert (counts.total, counts.completed, counts.failed) == (3, 0, 3)
        errors = lines_of(client, ended.error_file_id)
        assert [e["custom_id"] for e in errors] == ["e0", "e1", "e2"]
        for entry in errors:
            assert entry["response"] is None and entry["error"]["code"] == "batch_expired"
            assert "expired" in entry["error"]["message"]
        assert submitted_lines(env.r, batch.id) == set()
    finally:
        gateway.stop()


def test_a_small_queue_is_backpressure_not_failures(env: GatewayEnv, driver: ServedGateway) -> None:
    """With a queue cap of 3 every line still completes: the driver submits while the
    queue is under half its cap and waits otherwise (a QueueFull is never a failed line)."""
    producer = Producer(env.r)
    producer.set_queue_cap(3)
    try:
        client = driver.client()
        requests = [chat_line(f"b{i}", f"item {i}", 8) for i in range(16)]
        batch = start_batch(client, jsonl(requests))
        done = wait_status(client, batch.id, {"completed", "failed"})
        assert (done.request_counts.completed, done.request_counts.failed) == (16, 0)
    finally:
        producer.set_queue_cap(1000)


def _gateway_process(url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tokenfleet.cli", "gateway", "--redis-url", url]
    args += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    environ = {
        **os.environ,
        "TOKENFLEET_GATEWAY_BATCH_LEASE_S": "2",
        "TOKENFLEET_GATEWAY_BATCH_MAX_IN_FLIGHT": "2",
    }
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=environ)


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_gateway_killed_mid_batch_is_finished_by_another_each_line_once(
    env: GatewayEnv, redis_server: RedisServer, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    log = tmp_path / "gateways.log"
    first_port, second_port = free_port(), free_port()
    first = _gateway_process(redis_server.url, first_port, log)
    second = None
    try:
        wait_for(lambda: _healthy(first_port), 60, "the first gateway")
        client = _client(first_port)
        requests = [chat_line(f"k{i}", f"kill test {i}", 40) for i in range(16)]
        batch = start_batch(client, jsonl(requests))
        wait_lines_done(client, batch.id, 2)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        second = _gateway_process(redis_server.url, second_port, log)
        wait_for(lambda: _healthy(second_port), 60, "the second gateway")
        done = wait_status(_client(second_port), batch.id, {"completed", "failed"}, timeout=120)
        assert done.status == "completed", log.read_text()[-2000:]
        assert (done.request_counts.completed, done.request_counts.failed) == (16, 0)
        out = lines_of(_client(second_port), done.output_file_id)
        assert [line["custom_id"] for line in out] == [f"k{i}" for i in range(16)]
        # one job per line, under the line's own id: a line submitted again after the kill
        # was the fleet's duplicate (refused by the submit script), never a second job
        assert len(job_hashes(r, batch.id)) == 16
        assert [line["response"]["request_id"] for line in out] == [
            f"{batch.id}-{i}" for i in range(16)
        ]
        for line in out:
            assert line["response"]["body"]["usage"]["completion_tokens"] == 40
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        r.close()


def test_files_and_batches_belong_to_the_tenant_of_the_key_that_made_them(
    env: GatewayEnv, redis_server: RedisServer
) -> None:
    """Two API keys of two tenants on one gateway: acme's file, batch and the batch's
    output file are acme's; zeta's key gets 404 for each, sees none of them listed, can
    neither cancel the batch, delete the file nor start a batch from it."""
    gateway = driving(redis_server.url, api_keys=("k-acme=acme", "k-zeta=zeta"))
    try:
        acme, zeta = gateway.client("k-acme"), gateway.client("k-zeta")
        batch = start_batch(acme, jsonl([chat_line("a0", "tenant test", 3)]))
        done = wait_status(acme, batch.id, {"completed", "failed"})
        assert done.status == "completed"
        for file_id in (batch.input_file_id, done.output_file_id):
            assert acme.files.retrieve(file_id).id == file_id
            with pytest.raises(openai.NotFoundError):
                zeta.files.retrieve(file_id)
            with pytest.raises(openai.NotFoundError):
                zeta.files.content(file_id)
            with pytest.raises(openai.NotFoundError):
                zeta.files.delete(file_id)
        with pytest.raises(openai.NotFoundError):
            zeta.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            zeta.batches.cancel(batch.id)
        with pytest.raises(openai.NotFoundError):
            zeta.batches.create(
                input_file_id=batch.input_file_id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
        assert batch.id in [b.id for b in acme.batches.list()]
        assert [b.id for b in zeta.batches.list()] == []
        mine = {f.id for f in acme.files.list()}
        assert {batch.input_file_id, done.output_file_id} <= mine
        assert not {f.id for f in zeta.files.list()} & mine
        # tokenfleet's own fields stay private
        raw = httpx.get(
            f"{gateway.url}/v1/files/{batch.input_file_id}",
            headers={"Authorization": "Bearer k-acme"},
        ).json()
        assert not [k for k in raw if k.startswith("tokenfleet_")]
        assert acme.files.delete(batch.input_file_id).deleted
    finally:
        gateway.stop()
