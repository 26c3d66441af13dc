"""`tokenfleet.integrations.rq.generate` run by a real RQ worker against a real fleet worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus

from tests.helpers.support import KEYS
from tests.helpers.workers import Fleet
from tokenfleet.integrations.rq import generate
from tokenfleet.producer import Producer
from tokenfleet.protocol import decode_result

# A forking rq.Worker in its own process, as a service would run it; burst: exit when done.
RQ_WORKER = """
import sys
from redis import Redis
from rq import Queue, Worker
connection = Redis.from_url(sys.argv[1])
Worker([Queue("gen", connection=connection)], connection=connection).work(burst=True)
"""


@pytest.fixture
def no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without these, `generate` uses the Redis its RQ job came from."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("TOKENFLEET_REDIS_URL", raising=False)


def run_rq_worker(redis_url: str, tmp_path: Path) -> None:
    log = tmp_path / "rq-worker.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            [sys.executable, "-c", RQ_WORKER, redis_url],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 0, log.read_text(errors="replace")


def failure_text(job: Job) -> str:
    latest = job.latest_result()
    assert latest is not None
    return str(latest.exc_string)


@pytest.mark.slow
@pytest.mark.usefixtures("no_redis_env")
def test_rq_job_returns_the_fleet_result_and_a_rejection_fails_it_by_name(
    fleet: Fleet, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    q = Queue("gen", connection=r)
    served = q.enqueue(
        generate,
        {"prompt": "Hello from RQ", "max_new_tokens": 12, "ignore_eos": True},
        timeout=90,
    )
    # tiny-random's context is 2,048 tokens: the worker refuses this one (rejected_invalid).
    rejected = q.enqueue(
        generate, {"prompt": "Hi", "max_new_tokens": 4000}, redis_url=redis_url, timeout=90
    )
    worker = fleet.start("fleet-1", burst=False)  # serves both RQ jobs, one after the other
    run_rq_worker(redis_url, tmp_path)
    worker.signal(15)
    assert worker.wait(60) == 0, worker.output()

    assert served.get_status(refresh=True) == JobStatus.FINISHED, failure_text(served)
    returned = served.return_value(refresh=True)
    stored = r.get(KEYS.result(f"rq-{served.id}"))  # the fleet job id derives from the RQ id
    assert stored is not None
    fleet_result = decode_result(stored)
    assert returned == fleet_result.model_dump(mode="json")
    assert returned["finish_reason"] == "length"
    assert returned["text"] == fleet_result.text
    assert returned["token_ids"] == fleet_result.token_ids
    assert len(returned["token_ids"]) == 12
    assert returned["worker"] == "fleet-1"

    assert rejected.get_status(refresh=True) == JobStatus.FAILED
    text = failure_text(rejected)
    assert "tokenfleet.errors.JobRejected" in text
    assert "rejected_invalid" in text


@pytest.mark.usefixtures("no_redis_env")
def test_a_full_fleet_queue_fails_the_rq_job_with_queue_full(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    producer = Producer(r)
    producer.set_queue_cap(1)
    producer.submit(prompt="already queued", max_new_tokens=4)  # no fleet worker: it stays
    q = Queue("gen", connection=r)
    job = q.enqueue(generate, {"prompt": "one too many"}, timeout=30)
    run_rq_worker(redis_url, tmp_path)

    assert job.get_status(refresh=True) == JobStatus.FAILED
    text = failure_text(job)
    assert "tokenfleet.errors.QueueFull" in text
    assert "cap 1" in text
    assert producer.depth() == 1  # refused at submit: nothing was added


def test_nothing_in_tokenfleet_imports_pickle() -> None:
    package = Path(__file__).parent.parent / "tokenfleet"
    offenders = [
        str(path)
        for path in package.rglob("*.py")
        if "import pickle" in path.read_text() or "from pickle" in path.read_text()
    ]
    assert offenders == []
