"""TCP proxies in front of a redis-server, for fault tests: one that loses a reply in
transit, one that partitions the network and heals it."""

from __future__ import annotations

import contextlib
import socket
import threading
from threading import Event

__all__ = ["LostReplyProxy", "PartitionProxy"]


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
