"""`tokenfleet batch run` from the shell (issue 14): a batch file straight through a
producer to a real worker; Ctrl-C (a real SIGINT to the process) stops it, and the
same command again finishes it with every line in the output exactly once; a job
cancelled in the fleet is an error line, not a success (issue 21)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import redis

from tests.helpers.support import wait_for
from tests.helpers.workers import Fleet
from tokenfleet.batch.format import batch_id_for_file, job_id_for
from tokenfleet.keys import Keys
from tokenfleet.producer import Producer

ROOT = Path(__file__).resolve().parent.parent


def write_requests(path: Path, max_tokens: Sequence[int]) -> None:
    """Completion lines `r0`, `r1`, ... asking for `max_tokens[i]` tokens each, then
    one line `bad` whose body the fleet refuses."""
    lines = []
    for i, asked in enumerate(max_tokens):
        body = {
            "model": "default",
            "prompt": f"item {i}",
            "max_tokens": asked,
            "temperature": 0,
            "ignore_eos": True,
        }
        lines.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
        )
    lines.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "default", "prompt": "x", "best_of": 3},
        }
    )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def batch_run(redis_url: str, source: Path, out: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tokenfleet.cli", "batch", "run", str(source), "-o", str(out)]
    args += ["--max-in-flight", "2", "--quiet", "--redis-url", redis_url]
    # SIGINT back to its default in the child: a suite started in the background (`cmd &`
    # in a script) inherits it ignored, and Python then never raises KeyboardInterrupt
    return subprocess.Popen(
        args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def output_lines(out: Path) -> list[dict[str, object]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def test_batch_run_stops_on_ctrl_c_and_resumes_each_line_once(
    fleet: Fleet, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    worker = fleet.start("batch-cli-w", burst=False)
    fleet.wait_alive(worker)
    source, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    asked = [40] * 2 + [600] * 10  # long lines: the run cannot end before the Ctrl-C lands
    write_requests(source, asked)

    first = batch_run(redis_url, source, out)
    wait_for(lambda: len(output_lines(out)) >= 2, 60, "two results written")
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=30)
    assert first.returncode == 130, err.decode()
    assert b"run the same command again to resume" in err
    partial = output_lines(out)
    assert 2 <= len(partial) < 13

    second = batch_run(redis_url, source, out)
    stdout, err = second.communicate(timeout=120)
    assert second.returncode == 1, err.decode()  # one line failed: exit 1, said so
    assert b"12 done, 1 failed of 13" in stdout

    lines = output_lines(out)
    assert lines[: len(partial)] == partial  # appended, never rewritten
    ids = [line["custom_id"] for line in lines]
    assert sorted(ids) == sorted([f"r{i}" for i in range(12)] + ["bad"])  # each once
    for line in lines:
        if line["custom_id"] == "bad":
            assert line["error"]["code"] == "invalid_request"  # type: ignore[index]
            continue
        body = line["response"]["body"]  # type: ignore[index]
        index = int(str(line["custom_id"])[1:])
        assert body["usage"]["completion_tokens"] == asked[index]
    # one job per line under its own id; the second run's resubmissions were duplicates
    keys = Keys()
    hashes = [k for k in r.scan_iter(f"{keys.prefix}job:batch_*") if k.count(b":") == 2]
    assert len(hashes) == 12

    third = batch_run(redis_url, source, out)  # all done: nothing to do
    stdout, _ = third.communicate(timeout=60)
    assert b"12 done, 1 failed of 13" in stdout and output_lines(out) == lines


def test_batch_run_writes_a_job_cancelled_in_the_fleet_as_an_error_line(
    fleet: Fleet, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Line r0's job is cancelled while it is out: its line is an error coded
    `request_cancelled` (no response, no partial text), counted failed, not done."""
    worker = fleet.start("batch-cli-cancel-w", burst=False)
    fleet.wait_alive(worker)
    source, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    write_requests(source, [1500, 4, 4])
    job = Producer(r).handle(job_id_for(batch_id_for_file(source.read_bytes()), 0))

    run = batch_run(redis_url, source, out)
    wait_for(job.cancel, 60, "r0's job to be cancelled while it runs")  # False until submitted
    stdout, err = run.communicate(timeout=120)
    assert run.returncode == 1, err.decode()
    assert b"2 done, 2 failed of 4" in stdout
    by_id = {str(line["custom_id"]): line for line in output_lines(out)}
    assert sorted(by_id) == ["bad", "r0", "r1", "r2"]
    cancelled = by_id["r0"]
    assert cancelled["response"] is None
    assert cancelled["error"]["code"] == "request_cancelled"  # type: ignore[index]
    assert job.id in cancelled["error"]["message"]  # type: ignore[index]
    for custom_id in ("r1", "r2"):
        body = by_id[custom_id]["response"]["body"]  # type: ignore[index]
        assert body["usage"]["completion_tokens"] == 4
