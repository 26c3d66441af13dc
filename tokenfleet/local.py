"""A fleet on this machine, without Docker: a redis-server child process and worker
processes.

Used by `tokenfleet demo`, `tokenfleet up --embedded`, bench/ and the tests. The Redis
is always the real `redis-server` (the fleet's Lua scripts, streams and pub/sub are
the product, so a local fleet runs on the real thing): one not on PATH is
`RedisServerNotFound`, which says what to install.
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
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tokenfleet.errors import RedisServerNotFound
from tokenfleet.fleet import decode_worker, read_workers
from tokenfleet.keys import DEFAULT_PREFIX, Keys


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
class RedisServer:
    """A `redis-server` child process on 127.0.0.1: `start`, `stop`, `start` again.

    It listens on `port` (a free one by default) and keeps its files in `dir`, or in a
    temp dir of its own that `stop` removes. Nothing is saved unless `appendonly`
    (which needs a `dir`: the AOF outlives a `stop`, so `restart` finds the data again).
    A full server refuses writes (`noeviction`): the fleet's keys are never evicted.
    `stop` and `start` keep the port, as a restarted Redis does for its clients."""

    port: int = field(default_factory=free_port)
    dir: Path | None = None
    appendonly: bool = False
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.appendonly and self.dir is None:
            raise ValueError("an appendonly RedisServer needs a dir that outlives its stops")

    @classmethod
    def launch(cls, dir: Path | None = None, appendonly: bool = False) -> RedisServer:
        """A started server on a free port."""
        server = cls(dir=dir, appendonly=appendonly)
        server.start()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout: float = 20.0) -> None:
        """Run redis-server and wait until it answers (RedisServerNotFound if it is not on
        PATH, RuntimeError if it exits first, TimeoutError after `timeout` seconds)."""
        assert self.proc is None, "this redis-server is running already"
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerNotFound()
        if self.dir is not None:
            workdir = self.dir
        else:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="tokenfleet-redis-")
            workdir = Path(self._tmp.name)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(workdir)]
        args += ["--save", "", "--appendonly", "yes" if self.appendonly else "no"]
        args += ["--maxmemory-policy", "noeviction", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if (code := self.proc.poll()) is not None:
                    self.proc = None
                    raise RuntimeError(f"redis-server on port {self.port} exited with {code}")
                try:
                    # its own process answers, not another server already on the port
                    if int(client.info("server")["process_id"]) == self.proc.pid:
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop(kill=True)
                    raise TimeoutError(f"redis-server on port {self.port} did not come up")
                time.sleep(0.01)
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        """End the process (SIGTERM, which flushes an AOF; SIGKILL with `kill`) and reap
        it; remove the temp dir of its own, if any."""
        if self.proc is not None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def restart(self) -> None:
        self.stop()
        self.start()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class WorkerExited(RuntimeError):
    """A worker process ended while it was being waited for (the message carries its log)."""


@dataclass
class LocalWorkers:
    """`tokenfleet worker` child processes sharing one Redis: start, watch, signal, stop.

    Each worker runs `python -m tokenfleet.cli worker --redis-url URL --prefix PREFIX
    --name NAME *worker_args *extra` in its own process group (a Ctrl-C in the terminal
    reaches the parent only, which then drains the workers itself), with this process's
    environment plus `env` (and a start's own `env`). Its output goes to
    `log_dir/NAME.log`, or nowhere without a `log_dir`.

    `cwd` and `env` run another checkout: PYTHONPATH=TREE and cwd=TREE (`python -m` puts
    the working directory first on sys.path) import tokenfleet from TREE.

    Liveness is the worker's heartbeat hash (`Keys.worker(name)`): it exists once the
    worker has loaded its model and joined, and expires after WORKER_TTL_S without one.
    """

    redis_url: str
    prefix: str = DEFAULT_PREFIX
    worker_args: Sequence[str] = ()
    log_dir: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _client: redis.Redis | None = field(default=None, repr=False)

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)

    # ---- start ---------------------------------------------------------------------------

    def start(
        self,
        count: int,
        name_prefix: str = "local",
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Start `count` workers named NAME_PREFIX-PID-N; return their names."""
        return [
            self.start_one(f"{name_prefix}-{os.getpid()}-{len(self.procs)}", extra, env)
            for _ in range(count)
        ]

    def start_one(
        self, name: str, extra: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> str:
        assert name not in self.procs, f"worker {name} was started already"
        args = [sys.executable, "-m", "tokenfleet.cli", "worker", "--redis-url", self.redis_url]
        args += ["--prefix", self.prefix, "--name", name, *self.worker_args, *extra]
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {})}
        log = self.log_path(name)
        with contextlib.ExitStack() as stack:
            out: Any = subprocess.DEVNULL if log is None else stack.enter_context(log.open("wb"))
            self.procs[name] = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environ,
                cwd=self.cwd,
                start_new_session=True,
            )
        return name

    # ---- watch ---------------------------------------------------------------------------

    def alive(self) -> list[str]:
        """Names of the workers whose process is still running."""
        return [name for name, proc in self.procs.items() if proc.poll() is None]

    def joined(self, name: str) -> bool:
        """Whether the worker's heartbeat hash exists."""
        return bool(self._redis().exists(self.keys.worker(name)))

    def wait_live(self, names: Sequence[str] | None = None, timeout: float = 180.0) -> None:
        """Until every named worker (default: all) has joined; WorkerExited if one ends
        first, TimeoutError (with the logs' tails) if `timeout` passes."""
        waiting = list(self.procs if names is None else names)
        deadline = time.monotonic() + timeout
        while waiting:
            for name in waiting:
                if self.procs[name].poll() is not None and not self.joined(name):
                    raise WorkerExited(f"worker {name} exited early:\n{self.log(name)}")
            waiting = [name for name in waiting if not self.joined(name)]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"workers {waiting} did not join: {self.log_tail()}")
            if waiting:
                time.sleep(0.05)

    def heartbeat(self, name: str) -> dict[str, Any]:
        """The worker's heartbeat hash, decoded; {} once it expired."""
        raw = self._redis().hgetall(self.keys.worker(name))
        return decode_worker(name, raw).fields if raw else {}

    def settle(self, timeout: float = 15.0) -> dict[str, dict[str, Any]]:
        """Wait for a heartbeat from every worker written after now, each holding no job;
        return those heartbeats (counters such as `ticks` as of the end of the last run)."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while True:
            # read_workers reads the scores before the hashes: a heartbeat's HSET lands
            # before its ZADD, so a hash read after a fresh score is at least that fresh.
            live = read_workers(self._redis(), self.keys)
            beats = {name: live[name].fields if name in live else {} for name in self.procs}
            idle = all(b.get("held_jobs") == 0 and b.get("active") == 0 for b in beats.values())
            seen = [live[name].last_seen if name in live else None for name in self.procs]
            if idle and all(t is not None and t >= since for t in seen):
                return beats
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not settle: {beats}")
            time.sleep(0.05)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each running worker has used so far."""
        return {name: cpu_seconds(self.procs[name].pid) for name in self.alive()}

    def log_path(self, name: str) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def log(self, name: str) -> str:
        """The worker's output so far ('' without a log_dir)."""
        path = self.log_path(name)
        return path.read_text(errors="replace") if path is not None and path.exists() else ""

    def log_tail(self, chars: int = 800) -> str:
        """The last `chars` of every worker's non-empty log, one after another."""
        tails = [f"{name}: {text[-chars:]}" for name in self.procs if (text := self.log(name))]
        return " | ".join(tails)

    # ---- stop ----------------------------------------------------------------------------

    def signal(self, name: str, signum: int) -> None:
        self.procs[name].send_signal(signum)

    def wait(self, name: str, timeout: float = 120.0) -> int:
        """The worker's exit code, once it exited (subprocess.TimeoutExpired after `timeout`)."""
        return self.procs[name].wait(timeout=timeout)

    def kill(self, name: str, timeout: float = 30.0) -> None:
        """SIGKILL one worker (if it still runs) and reap it."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=timeout)

    def drain(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM every worker (they finish in-flight jobs), wait, return exit codes;
        one still running after `timeout` is killed and reads None."""
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
                proc.wait(timeout=30)
                codes[name] = None
        self.close()
        return codes

    def kill_all(self) -> None:
        """SIGKILL every worker still running, reap them all."""
        for name in self.procs:
            self.kill(name)
        self.close()

    def close(self) -> None:
        """Close the Redis connection used to watch the workers (reopened when needed)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def _redis(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.redis_url)
        return self._client


@contextlib.contextmanager
def redis_for(url: str | None) -> Iterator[tuple[str, str]]:
    """Yield (url, kind): the Redis at `url` ('external'), or without one a redis-server
    of this process's own ('redis-server'), stopped on exit."""
    if url:
        wait_until_up(url, timeout=5)
        yield url, "external"
        return
    server = RedisServer.launch()
    try:
        yield server.url, "redis-server"
    finally:
        server.stop()
