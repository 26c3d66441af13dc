"""The operator's tools as an operator runs them: real `tokenfleet` processes, a real
redis-server, and `redis-cli` alone following docs/protocol.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from tests.helpers.support import KEYS, run_cli, wait_for
from tests.helpers.workers import Fleet
from tokenfleet.fleet import live_workers
from tokenfleet.keys import GROUP
from tokenfleet.producer import Producer
from tokenfleet.protocol import decode_result
from tokenfleet.worker.queue import WorkerQueue

ROOT = Path(__file__).parent.parent


def port_of(redis_url: str) -> int:
    return int(redis_url.rsplit(":", 1)[1].split("/")[0])


# --- demo ---------------------------------------------------------------------


def path_without(program: str) -> str:
    """$PATH minus every directory holding `program`, with this Python's own directory kept."""
    dirs = [d for d in os.environ["PATH"].split(os.pathsep) if d]
    kept = [d for d in dirs if not (Path(d) / program).exists()]
    return os.pathsep.join([str(Path(sys.executable).parent), *kept])


def test_demo_and_up_without_redis_server_say_what_to_install() -> None:
    """The local fleet runs the real redis-server, never a stand-in: without one on PATH
    `demo` and `up --embedded` exit 2 at once, naming the packages to install."""
    env = {**os.environ, "PATH": path_without("redis-server")}
    assert shutil.which("redis-server", path=env["PATH"]) is None
    for args in (["demo", "--no-live", "--model", "tiny-random"], ["up", "--embedded"]):
        proc = run_cli(*args, env=env, timeout=60)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        assert "error: redis-server is not on PATH" in proc.stderr, out
        assert "apt-get install redis-server" in out and "brew install redis" in out, out
        assert "Traceback" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "tiny-random"])
def test_demo_serves_every_job_on_an_embedded_redis(model: str) -> None:
    # The real model (the README's `make demo`) and the random one (`--model tiny-random`).
    flags = [] if model == "smollm2-135m-instruct" else ["--model", model]
    proc = run_cli("demo", "--no-live", "--jobs", "6", *flags, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"redis: redis://127\.0\.0\.1:\d+/0 \(redis-server\)", proc.stdout), out
    assert "finished: 6/6 jobs; workers exited with [0, 0]" in proc.stdout, out
    assert f"model: {model}" in proc.stdout, out
    if flags:
        assert proc.stdout.count("[length]") == 6, out  # one line per job, as it ends
        return
    # One line per job as it ends: "job ID [stop|length] N tokens by W: <answer start>".
    answers = re.findall(r"\[(?:stop|length)\] \d+ tokens by \S+: (.+)", proc.stdout)
    assert len(answers) == 6, out
    for answer in answers:
        # printable English: words of letters, not the byte soup of random weights
        words = re.findall(r"[A-Za-z]{2,}", answer)
        letters = sum(ch.isascii() and (ch.isalpha() or ch in " ,.'-:;!?\"()") for ch in answer)
        assert len(words) >= 4 and letters >= 0.9 * len(answer.rstrip("…")), answer


# --- redis-cli alone, as docs/protocol.md shows -------------------------------------


def doc_redis_cli_commands() -> list[str]:
    """The shell commands of docs/protocol.md's "With redis-cli alone" block."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text.split("### With redis-cli alone", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(line)
    return commands


def redis_cli(command: str, port: int) -> str:
    """Run a documented `redis-cli ...` line through bash, pointed at the test's Redis.

    `--csv` quotes every reply, binary included, so it can be read back exactly."""
    assert command.startswith("redis-cli ")
    line = f"redis-cli -p {port} --csv " + command.removeprefix("redis-cli ")
    proc = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, cwd=ROOT, timeout=30, check=False
    )
    assert proc.returncode == 0 and not proc.stdout.startswith("ERR"), proc.stdout + proc.stderr
    return proc.stdout.strip()


_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b", '"': b'"', "\\": b"\\"}


def unquote(quoted: str) -> bytes:
    """Undo redis-cli's quoting (sdscatrepr): \\xNN, \\n, \\", ... → the raw bytes."""
    out, i = bytearray(), 0
    while i < len(quoted):
        ch = quoted[i]
        if ch != "\\":
            out += ch.encode()
            i += 1
        elif quoted[i + 1] == "x":
            out.append(int(quoted[i + 2 : i + 4], 16))
            i += 4
        else:
            out += _ESCAPES[quoted[i + 1]]
            i += 2
    return bytes(out)


def csv_values(output: str) -> list[bytes]:
    return [unquote(m) for m in _QUOTED.findall(output)]


@pytest.mark.slow
def test_a_job_submitted_and_read_back_with_redis_cli_alone_as_documented(
    fleet: Fleet, r: redis.Redis, redis_url: str
) -> None:
    port = port_of(redis_url)
    submit, xlen, xrange, get = doc_redis_cli_commands()
    assert "--eval tokenfleet/lua/submit.lua" in submit
    job = re.search(r"tokenfleet:job:([\w.-]+) ", submit)
    assert job is not None
    job_id = job.group(1)

    reply = csv_values(redis_cli(submit, port))
    assert reply[0] == b"ok", reply
    assert redis_cli(xlen, port) == "1"  # queue depth
    assert r.xrange(KEYS.jobs(), "-", "+")[0][0] == reply[1]  # the entry id it replied

    worker = fleet.start("cli-worker")
    assert worker.wait(120) == 0, worker.output()
    assert redis_cli(xlen, port) == "0"  # finished jobs leave the stream

    values = csv_values(redis_cli(xrange, port))  # id, "m", msgpack, id, "m", msgpack, ...
    assert values[1::3] == [b"m"] * (len(values) // 3)
    # an entry holds one event or several back to back (a worker's coalesced ticks; the
    # last tokens and the finish share an entry): read each as a msgpack stream
    events: list[dict[str, Any]] = [e for m in values[2::3] for e in _unpack_all(m)]
    tokens, finish = events[:-1], events[-1]
    assert all(e["v"] == 1 and e["job_id"] == job_id for e in events)
    assert [e["type"] for e in tokens] == ["token"] * len(tokens)
    assert [e["index"] for e in tokens] == list(range(len(tokens)))
    assert finish["type"] == "finish"
    assert finish["reason"] in ("length", "stop")
    assert finish["usage"]["completion_tokens"] == len(tokens) > 0
    assert finish["worker"] == "cli-worker"
    if finish["reason"] == "length":
        assert len(tokens) == 16  # "max_new_tokens":16 in the documented payload

    (stored,) = csv_values(redis_cli(get, port))
    result = decode_result(stored)
    assert result.job_id == job_id
    assert result.token_ids == [e["token_id"] for e in tokens]
    assert result.text == "".join(e["text"] for e in tokens)
    assert result.finish_reason == finish["reason"]


# --- status ------------------------------------------------------------------------


def status_json(redis_url: str) -> dict[str, Any]:
    proc = run_cli("status", "--json", "--redis-url", redis_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status: dict[str, Any] = json.loads(proc.stdout)
    return status


def band_queue(status: dict[str, Any], model: str, band: str) -> dict[str, Any]:
    (queue,) = [q for q in status["queues"] if (q["model"], q["band"]) == (model, band)]
    assert queue["stream"] == KEYS.jobs(model, band)
    return queue


def default_queue(status: dict[str, Any]) -> dict[str, Any]:
    return band_queue(status, "default", "default")


def test_status_reports_depth_waiting_in_flight_dead_letters_and_workers(
    r: redis.Redis, redis_url: str
) -> None:
    producer = Producer(r)
    for i in range(5):
        producer.submit(job_id=f"st-{i}", prompt="status", max_new_tokens=4)
    status = status_json(redis_url)
    queue = default_queue(status)
    assert (queue["depth"], queue["waiting"], queue["in_flight"]) == (5, 5, 0)
    assert queue["cap"] == 1000
    assert status["dead_letters"] == 0
    assert status["workers"] == {}

    consumer = WorkerQueue(r, KEYS, "fake-consumer")  # the test plays a worker
    consumer.ensure_group()
    assert len(consumer.read(2)) == 2
    queue = default_queue(status_json(redis_url))
    assert (queue["depth"], queue["waiting"], queue["in_flight"]) == (5, 3, 2)
    assert queue["consumers"] == 1

    (third,) = consumer.read(1)
    assert consumer.dead_letter(third, "too_many_deliveries", "given up by the test")
    consumer.heartbeat({"model": "default", "status": "running", "active": 2})
    status = status_json(redis_url)
    queue = default_queue(status)
    assert (queue["depth"], queue["waiting"], queue["in_flight"]) == (4, 2, 2)
    assert status["dead_letters"] == 1
    assert set(status["workers"]) == {"fake-consumer"}
    assert status["workers"]["fake-consumer"]["status"] == "running"
    assert status["workers"]["fake-consumer"]["active"] == 2

    table = run_cli("status", "--redis-url", redis_url)
    assert table.returncode == 0, table.stderr
    assert "dead letters: 1" in table.stdout
    assert "fake-consumer" in table.stdout


def tables(output: str) -> dict[str, list[list[str]]]:
    """The cells of each row of the Rich tables in `output`, by the first word of the
    table's title ("queues", "tenants", "workers")."""
    out: dict[str, list[list[str]]] = {}
    rows: list[list[str]] = []
    for line in output.splitlines():
        if line.startswith("│"):
            rows.append([cell.strip() for cell in line.split("│")[1:-1]])
        elif line.strip() and line.lstrip()[0] not in "┏┃┡└":
            rows = out.setdefault(line.split()[0], [])
    return out


def test_status_shows_each_band_of_each_model_and_the_tenants(
    r: redis.Redis, redis_url: str
) -> None:
    # The bands' streams written directly (no worker, no submit script): 3 interactive
    # jobs of which a worker read 1, 2 batch jobs of model "other"; no default-band stream.
    r.sadd(KEYS.models(), "default", "other")
    r.set(KEYS.queue_cap("other"), 50)
    for i in range(3):
        r.xadd(KEYS.jobs("default", "interactive"), {"job_id": f"i-{i}"})
    r.xgroup_create(KEYS.jobs("default", "interactive"), GROUP, id="0")
    assert r.xreadgroup(GROUP, "w", {KEYS.jobs("default", "interactive"): ">"}, count=1)
    for i in range(2):
        r.xadd(KEYS.jobs("other", "batch"), {"job_id": f"b-{i}"})

    status = status_json(redis_url)
    assert [(q["model"], q["band"]) for q in status["queues"]] == [
        ("default", "default"),  # a model's default band first, as before bands
        ("default", "interactive"),
        ("default", "batch"),
        ("other", "default"),
        ("other", "interactive"),
        ("other", "batch"),
    ]
    interactive = band_queue(status, "default", "interactive")
    assert (interactive["depth"], interactive["waiting"], interactive["in_flight"]) == (3, 2, 1)
    assert (interactive["consumers"], interactive["cap"]) == (1, 1000)
    plain = default_queue(status)  # its stream does not exist: empty, not an error
    assert (plain["depth"], plain["waiting"], plain["in_flight"], plain["lag"]) == (0, 0, 0, None)
    batch = band_queue(status, "other", "batch")
    assert (batch["depth"], batch["waiting"], batch["in_flight"], batch["cap"]) == (2, 2, 0, 50)
    assert band_queue(status, "other", "interactive")["depth"] == 0
    assert status["tenants"] == {}  # the old keys stay, the tenants come beside them
    assert {"time", "prefix", "dead_letters", "workers"} <= set(status)

    table = run_cli("status", "--redis-url", redis_url)
    assert table.returncode == 0, table.stderr
    shown = tables(table.stdout)
    assert shown["queues"] == [
        ["default", "interactive", "3", "2", "1", "1000", "1"],  # highest band first
        ["default", "default", "0", "0", "0", "1000", "0"],
        ["default", "batch", "0", "0", "0", "1000", "0"],
        ["other", "interactive", "0", "0", "0", "50", "0"],
        ["other", "default", "0", "0", "0", "50", "0"],
        ["other", "batch", "2", "2", "0", "50", "0"],
    ]
    assert "tenants" not in shown  # no tenant yet: no tenants table

    # Tenants as the scripts record them, and limits set by the operator.
    r.zadd(KEYS.tenant_queued("acme", "other"), {"b-0": 1.0, "b-1": 1.0})
    r.zadd(KEYS.tenant_running("acme", "default"), {"i-0": 1.0})
    r.sadd(KEYS.tenants(), "acme", "default")
    for name, limit in (("acme", "--queued-share=0.1"), ("*", "--max-running=2")):
        done = run_cli("tenants", "set", name, limit, "--redis-url", redis_url)
        assert done.returncode == 0, done.stderr

    status = status_json(redis_url)
    assert status["tenant_defaults"] == {
        "queued_share": None,
        "max_running": 2,
        "cache_group": None,
    }
    acme = status["tenants"]["acme"]
    assert acme["effective"] == {"queued_share": 0.1, "max_running": 2, "cache_group": None}
    assert acme["models"]["other"] == {"queued": 2, "running": 0, "queued_limit": 5}
    assert acme["models"]["default"] == {"queued": 0, "running": 1, "queued_limit": 100}
    assert status["tenants"]["default"]["models"]["default"]["queued"] == 0

    table = run_cli("status", "--redis-url", redis_url)
    assert table.returncode == 0, table.stderr
    assert "tenants (2)   defaults (*): queued share -, max running 2" in table.stdout
    assert tables(table.stdout)["tenants"] == [
        # tenant, model, queued, running, queued limit, queued share, max running, cache group
        ["acme", "default", "0", "1", "100", "0.1", "2 (*)", "-"],
        ["acme", "other", "2", "0", "5", "0.1", "2 (*)", "-"],
        ["default", "-", "0", "0", "-", "-", "2 (*)", "-"],  # no jobs anywhere: one row
    ]


# --- up + Ctrl-C ------------------------------------------------------------------


@pytest.mark.slow
def test_up_drains_on_ctrl_c_and_loses_no_job(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "up.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "tokenfleet.cli", "up", "--workers", "2"]
    with log.open("wb") as out:
        up = subprocess.Popen(
            [*args, "--redis-url", redis_url], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    ids = [f"up-{i}" for i in range(8)]

    def running() -> bool:
        if up.poll() is not None:
            raise AssertionError(f"`tokenfleet up` exited early:\n{log.read_text()}")
        return True

    def mid_generation() -> list[str]:
        running()
        return [i for i in ids if r.xlen(KEYS.events(i)) and not r.exists(KEYS.result(i))]

    try:
        # Both workers up first: a worker still importing torch dies of SIGTERM (see report).
        wait_for(lambda: running() and len(live_workers(r, KEYS)) == 2, 120, "two workers")
        producer = Producer(r)
        for job_id in ids:
            producer.submit(job_id=job_id, prompt=job_id, max_new_tokens=256, ignore_eos=True)
        wait_for(mid_generation, 60, "a job part-way through")
        started = mid_generation()
        up.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert up.wait(120) == 0, log.read_text()
    finally:
        if up.poll() is None:  # failed: stop `up` and the workers it started
            for info in live_workers(r, KEYS).values():
                os.kill(int(info["pid"]), signal.SIGKILL)
            up.kill()
            up.wait(30)
    output = log.read_text()
    assert "draining" in output and "stopped 2 worker(s)" in output, output

    finished = {i for i in ids if r.exists(KEYS.result(i))}
    queued = {f[b"job_id"].decode() for _, f in r.xrange(KEYS.jobs(), "-", "+")}
    assert finished | queued == set(ids)  # no job lost ...
    assert not finished & queued  # ... and none both finished and queued
    assert set(started) <= finished  # jobs generating at Ctrl-C were finished, not dropped
    for job_id in finished:
        stored = r.get(KEYS.result(job_id))
        assert stored is not None
        result = decode_result(stored)
        assert result.finish_reason == "length"
        assert len(result.token_ids) == 256
    assert live_workers(r, KEYS) == {}  # every worker left
    if queued:  # handed back: nobody holds them any more (their heartbeats are gone)
        pending = r.xpending_range(KEYS.jobs(), GROUP, "-", "+", 100)
        assert all(not r.exists(KEYS.worker(p["consumer"].decode())) for p in pending)


# --- dead letters ------------------------------------------------------------------


@pytest.mark.slow
def test_dead_letters_are_listed_and_a_decodable_one_is_served_after_requeue(
    fleet: Fleet, r: redis.Redis, redis_url: str
) -> None:
    Producer(r).submit(job_id="dl-good", prompt="again", max_new_tokens=8, ignore_eos=True)
    consumer = WorkerQueue(r, KEYS, "fake-consumer")
    consumer.ensure_group()
    (good,) = consumer.read(1)
    assert consumer.dead_letter(good, "too_many_deliveries", "given up by the test")
    r.xadd(KEYS.jobs(), {"job_id": "dl-bad", "payload": b"\xc1 not msgpack"})
    (bad,) = consumer.read(1)
    assert consumer.dead_letter(bad, "not_msgpack", "garbage from the test")

    listed = run_cli("dead-letters", "--json", "--redis-url", redis_url)
    assert listed.returncode == 0, listed.stderr
    entries = json.loads(listed.stdout)
    assert [(e["job_id"], e["reason"]) for e in entries] == [
        ("dl-bad", "not_msgpack"),  # newest first
        ("dl-good", "too_many_deliveries"),
    ]
    assert entries[1]["message"] == "given up by the test"
    bad_id, good_id = entries[0]["id"], entries[1]["id"]
    plain = run_cli("dead-letters", "--redis-url", redis_url)
    assert plain.returncode == 0 and "2 dead letter(s)" in plain.stdout, plain.stdout

    refused = run_cli("dead-letters", "--requeue", bad_id, "--redis-url", redis_url)
    assert refused.returncode == 2
    assert "cannot be requeued" in refused.stderr
    requeued = run_cli("dead-letters", "--requeue", good_id, "--redis-url", redis_url)
    assert requeued.returncode == 0, requeued.stderr
    assert f"{good_id}: job dl-good submitted again" in requeued.stdout
    assert [e[0].decode() for e in r.xrange(KEYS.dead_letters(), "-", "+")] == [bad_id]
    assert r.xlen(KEYS.jobs()) == 1

    # A duplicate entry's dead letter while its job is still queued: requeuing it would
    # wipe the live job's state, so it is refused.
    Producer(r).submit(job_id="dl-live", prompt="live", max_new_tokens=8, ignore_eos=True)
    payload = r.xrange(KEYS.jobs(), "-", "+")[-1][1][b"payload"]
    dup = {"job_id": "dl-live", "reason": "rejected_duplicate", "payload": payload}
    dup_id = r.xadd(KEYS.dead_letters(), dup).decode()
    live = run_cli("dead-letters", "--requeue", dup_id, "--redis-url", redis_url)
    assert live.returncode == 2
    assert "job dl-live is still queued or running" in live.stderr

    worker = fleet.start("dl-worker")
    assert worker.wait(120) == 0, worker.output()
    for job_id in ("dl-good", "dl-live"):
        stored = r.get(KEYS.result(job_id))
        assert stored is not None
        result = decode_result(stored)
        assert result.finish_reason == "length"
        assert len(result.token_ids) == 8
        assert result.worker == "dl-worker"


def test_the_demo_views_show_generated_text_verbatim_not_as_rich_markup() -> None:
    import io

    from rich.console import Console

    from tokenfleet.demo import DemoState, JobView, _jobs_table

    state = DemoState()
    state.jobs["j"] = JobView("j", 0, "p", text="a [/x] b [bold]c", reason="running")
    out = io.StringIO()
    Console(file=out, width=120).print(_jobs_table(state))  # "[/x]" used to raise MarkupError
    assert "a [/x] b [bold]c" in out.getvalue()


def _unpack_all(data: bytes) -> list[dict[str, Any]]:
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    return list(unpacker)
