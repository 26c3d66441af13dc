"""Real worker processes for integration tests: start, signal, wait, collect their logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from support import wait_for

from tokenfleet.keys import Keys


@dataclass
class WorkerProcess:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

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


@dataclass
class Fleet:
    """Starts `tokenfleet worker` processes against one Redis; stops them all at the end."""

    redis_url: str
    tmp: Path
    workers: list[WorkerProcess] = field(default_factory=list)

    def start(self, name: str, *extra: str, burst: bool = True) -> WorkerProcess:
        log = self.tmp / f"{name}.log"
        args = [sys.executable, "-m", "tokenfleet.cli", "worker", "--redis-url", self.redis_url]
        args += ["--name", name, "--model", "tiny-random", "--device", "cpu", "--threads", "1"]
        args += ["--verbose"]
        if burst:
            args.append("--burst")
        args += list(extra)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        worker = WorkerProcess(name, proc, log)
        self.workers.append(worker)
        return worker

    def wait_alive(self, worker: WorkerProcess, timeout: float = 60) -> None:
        """Until the worker's heartbeat hash exists (it has loaded its model and joined)."""
        client = redis.Redis.from_url(self.redis_url)
        key = Keys().worker(worker.name)

        def alive() -> bool:
            if worker.proc.poll() is not None:
                raise AssertionError(f"worker {worker.name} exited early:\n{worker.output()}")
            return bool(client.exists(key))

        wait_for(alive, timeout, f"worker {worker.name} heartbeat")
        client.close()

    def info(self, worker: WorkerProcess) -> dict[str, Any]:
        """The worker's telemetry hash, decoded (every value is JSON); {} once it expired."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            raw = client.hgetall(Keys().worker(worker.name))
        finally:
            client.close()
        return {field.decode(): json.loads(value) for field, value in raw.items()}

    def stop_all(self) -> None:
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.proc.wait(timeout=30)
