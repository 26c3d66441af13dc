"""Test support importable from any test: free ports, condition waits, a redis-server process,
a proxy that loses a reply."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from threading import Event

import pytest
import redis

from tokenfleet.local import free_port

__all__ = [
    "LostReplyProxy",
    "PartitionProxy",
    "RedisServer",
    "free_port",
    "run_cli",
    "wait_for",
]
ROOT = Path(__file__).parent.parent


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run `tokenfleet ARGS` as its own process; wide output so Rich doesn't wrap lines."""
    env = {**(env or os.environ), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def wait_for(
    predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition"
) -> None:
    """Poll `predicate` until it is truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class RedisServer:
    """A redis-server child process on a free port."""

    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    appendonly: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not on PATH: install it (apt-get install -y redis-server); "
                "these tests need a real Redis",
                pytrace=False,
            )
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--save", "", "--appendonly", "yes" if self.appendonly else "no"]
        args += ["--maxmemory-policy", "noeviction", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, 20, "redis-server to accept connections")
        client.close()

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=20)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class LostReplyProxy:
    """A TCP proxy in front of a redis-server that can lose one reply in transit.

    After `arm(*markers)`, the first command sent through it whose bytes contain every
    marker and whose reply is not empty (RESP nil) is executed by the server, but its
    reply is dropped and the connection cut: what a client sees when the network fails
    between the server's answer and its own read. `cut` is set once that happened."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.markers: tuple[bytes, ...] = ()
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, *markers: bytes) -> None:
        self.markers = markers

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            watching = threading.Event()  # a marked command is waiting for its reply
            args = (client, server, watching)
            threading.Thread(target=self._requests, args=args, daemon=True).start()
            threading.Thread(target=self._replies, args=args, daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, watching: Event) -> None:
        while data := _recv(client):
            markers = self.markers
            if markers and all(marker in data for marker in markers):
                watching.set()
            server.sendall(data)
        _close(client, server)

    def _replies(self, client: socket.socket, server: socket.socket, watching: Event) -> None:
        while data := _recv(server):
            if watching.is_set():
                watching.clear()
                if self.markers and not data.startswith((b"*-1", b"_")):
                    self.markers = ()
                    self.cut.set()
                    break
            client.sendall(data)
        _close(client, server)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


class PartitionProxy:
    """A TCP proxy in front of a redis-server that can cut the network and heal it.

    `cut()` is a partition as a client meets it: bytes in flight on open connections
    are dropped, new connections are accepted but nothing reaches the server, and
    nothing answers (the client's socket timeout fires). `heal()` closes what the cut
    left hanging and forwards again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.partitioned = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut(self) -> None:
        self.partitioned.set()

    def heal(self) -> None:
        with self._lock:
            hanging, self._open = self._open, []
        self.partitioned.clear()
        _close(*hanging)

    def close(self) -> None:
        self.listener.close()
        self.heal()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._open.append(client)
            if self.partitioned.is_set():
                continue  # a black hole: accepted, never forwarded, closed by heal()
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._open.append(server)
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        while data := _recv(source):
            if self.partitioned.is_set():
                continue  # dropped on the floor, like packets during a partition
            try:
                sink.sendall(data)
            except OSError:
                break
        _close(source, sink)
