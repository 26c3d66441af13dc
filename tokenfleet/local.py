"""A fleet on this machine, without Docker: an embedded Redis and worker processes.

Used by `tokenfleet demo` and `tokenfleet up`. The embedded Redis is the real
`redis-server` when it is on PATH (nothing persisted, a free port, a temp
dir); otherwise fakeredis's TCP server runs in this process (slower, but every
command the fleet uses works on it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_up(url: str, timeout: float = 20.0) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()


@dataclass
class EmbeddedRedis:
    """A throw-away Redis for a local fleet. `kind` is 'redis-server' or 'fakeredis'."""

    url: str
    kind: str
    _proc: subprocess.Popen[bytes] | None = None
    _server: Any = None
    _dir: tempfile.TemporaryDirectory[str] | None = None

    @classmethod
    def start(cls, prefer_real: bool = True) -> EmbeddedRedis:
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        binary = shutil.which("redis-server") if prefer_real else None
        if binary is not None:
            workdir = tempfile.TemporaryDirectory(prefix="tokenfleet-redis-")
            args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", "--dir", workdir.name, "--loglevel", "warning"]
            args += ["--maxmemory-policy", "noeviction"]
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            embedded = cls(url, "redis-server", _proc=proc, _dir=workdir)
        else:
            from fakeredis import TcpFakeServer

            server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
            threading.Thread(target=server.serve_forever, daemon=True).start()
            embedded = cls(url, "fakeredis", _server=server)
        wait_until_up(url)
        return embedded

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=20)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._dir is not None:
            self._dir.cleanup()


@dataclass
class LocalWorkers:
    """`tokenfleet worker` child processes sharing one Redis."""

    redis_url: str
    prefix: str
    worker_args: Sequence[str] = ()
    log_dir: Path | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, count: int, name_prefix: str = "local") -> list[str]:
        names = []
        for _ in range(count):
            name = f"{name_prefix}-{os.getpid()}-{len(self.procs)}"
            args = [sys.executable, "-m", "tokenfleet.cli", "worker", "--redis-url", self.redis_url]
            args += ["--prefix", self.prefix, "--name", name, *self.worker_args]
            out: Any = subprocess.DEVNULL
            if self.log_dir is not None:
                out = (self.log_dir / f"{name}.log").open("wb")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            # Own process group: a Ctrl-C in the terminal reaches the parent only, which
            # then drains the workers itself (one SIGTERM each).
            self.procs[name] = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            names.append(name)
        return names

    def alive(self) -> list[str]:
        return [name for name, proc in self.procs.items() if proc.poll() is None]

    def drain(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM every worker (they finish in-flight jobs), wait, return exit codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = None
        return codes


@contextlib.contextmanager
def redis_for(url: str | None, prefer_real: bool = True) -> Iterator[tuple[str, str]]:
    """Yield (url, kind): the given Redis, or an embedded one stopped on exit."""
    if url:
        wait_until_up(url, timeout=5)
        yield url, "external"
        return
    embedded = EmbeddedRedis.start(prefer_real)
    try:
        yield embedded.url, embedded.kind
    finally:
        embedded.stop()
