"""Test glue over `tokenfleet.local.LocalWorkers`: real worker processes with the tests'
flags (tiny-random on CPU, one thread, verbose, burst unless asked), one handle per
worker, and the in-process engine run their results are compared with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.helpers.support import wait_for
from tokenfleet.local import LocalWorkers

if TYPE_CHECKING:
    import subprocess

    from tokenfleet.producer import JobHandle
    from tokenfleet.protocol import GenerationRequest, JobResult, TokenEvent

TEST_WORKER_ARGS = ("--model", "tiny-random", "--device", "cpu", "--threads", "1", "--verbose")


@dataclass
class WorkerProcess:
    """One worker of a `Fleet`: its process and log, as the tests poke at them."""

    name: str
    workers: LocalWorkers = field(repr=False)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.workers.procs[self.name]

    @property
    def log(self) -> Path:
        path = self.workers.log_path(self.name)
        assert path is not None
        return path

    def signal(self, signum: int) -> None:
        self.workers.signal(self.name, signum)

    def kill(self) -> None:
        self.workers.kill(self.name)

    def wait(self, timeout: float = 120) -> int:
        return self.workers.wait(self.name, timeout)

    def output(self) -> str:
        return self.workers.log(self.name)

    def wait_log(self, fragment: str, timeout: float = 60) -> None:
        """Until `fragment` appears in the worker's log (fails early if it exited without it)."""

        def logged() -> bool:
            if fragment in self.output():
                return True
            if self.proc.poll() is not None and fragment not in self.output():
                raise AssertionError(
                    f"worker {self.name} exited without logging {fragment!r}:\n{self.output()}"
                )
            return False

        wait_for(logged, timeout, f"{fragment!r} in the log of worker {self.name}")


class Fleet:
    """Starts `tokenfleet worker` processes against one Redis (the default prefix), logs
    in `tmp`; `stop_all` kills whatever still runs."""

    def __init__(self, redis_url: str, tmp: Path) -> None:
        # float32: the tests compare what workers return with the engine in process
        # (a worker's default dtype is `auto`, bfloat16 on CPUs that have it)
        env = {"OMP_NUM_THREADS": "1", "TOKENFLEET_DTYPE": "float32"}
        self.local = LocalWorkers(redis_url, worker_args=TEST_WORKER_ARGS, log_dir=tmp, env=env)
        self.workers: list[WorkerProcess] = []

    def start(self, name: str, *extra: str, burst: bool = True) -> WorkerProcess:
        self.local.start_one(name, ["--burst", *extra] if burst else extra)
        worker = WorkerProcess(name, self.local)
        self.workers.append(worker)
        return worker

    def wait_alive(self, worker: WorkerProcess, timeout: float = 60) -> None:
        """Until the worker's heartbeat hash exists (it has loaded its model and joined)."""
        self.local.wait_live([worker.name], timeout)

    def info(self, worker: WorkerProcess) -> dict[str, Any]:
        """The worker's telemetry hash, decoded (every value is JSON); {} once it expired."""
        return self.local.heartbeat(worker.name)

    def stop_all(self) -> None:
        self.local.kill_all()


def in_process(requests: Sequence[GenerationRequest]) -> dict[str, JobResult]:
    """What each job gets from one engine in this process (tiny-random on CPU, every
    request admitted at once): the reference a fleet's results must equal."""
    # Imported here, not at the top: conftest imports this module for every test, and the
    # pure-core tests should not pay for the model's imports.
    from tokenfleet.model import load_model
    from tokenfleet.worker.engine import Engine, EngineConfig

    config = EngineConfig(kv_budget_bytes=64 << 20, max_waiting=len(requests))
    engine = Engine(load_model("tiny-random", device="cpu"), config)
    for request in requests:
        assert engine.submit(request).accepted, request.job_id
    results: dict[str, JobResult] = {}
    while engine.has_work:
        for done in engine.step().finished:
            results[done.job_id] = done.result
    return results


def collect(handle: JobHandle, timeout: float = 90) -> list[TokenEvent]:
    """What the client handle yields; its indices must be 0..n-1, each once."""
    events = list(handle.stream(timeout=timeout))
    assert [e.index for e in events] == list(range(len(events))), handle.id
    return events
