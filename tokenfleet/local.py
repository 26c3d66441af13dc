"""A fleet on this machine, without Docker: a redis-server child process and worker
processes.

Used by `tokenfleet demo`, `tokenfleet up --embedded`, bench/ and the tests. The Redis
is always the real `redis-server` (the fleet's Lua scripts, streams and pub/sub are
the product, so a local fleet runs on the real thing): one not on PATH is
`RedisServerNotFound`, which says what to install. `RedisCluster` is a local Redis
Cluster of such servers (joined with `redis-cli`), for cluster-mode tests.
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
from redis.crc import key_slot

from tokenfleet.connect import connect
from tokenfleet.errors import RedisServerNotFound
from tokenfleet.fleet import decode_worker, read_workers
from tokenfleet.keys import DEFAULT_PREFIX, Keys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_up(url: str, timeout: float = 20.0) -> None:
    """Until the Redis (or Redis Cluster) at `url` answers a PING (its ConnectionError
    after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = connect(url)  # a cluster client reads the slot map here
            try:
                client.ping()
                return
            finally:
                client.close()
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class RedisServer:
    """A `redis-server` child process on 127.0.0.1: `start`, `stop`, `start` again.

    It listens on `port` (a free one by default) and keeps its files in `dir`, or in a
    temp dir of its own that `stop` removes. Nothing is saved unless `appendonly`
    (which needs a `dir`: the AOF outlives a `stop`, so `restart` finds the data again).
    A full server refuses writes (`noeviction`): the fleet's keys are never evicted.
    `stop` and `start` keep the port, as a restarted Redis does for its clients.
    `args` are more redis-server arguments (a cluster node's, for `RedisCluster`)."""

    port: int = field(default_factory=free_port)
    dir: Path | None = None
    appendonly: bool = False
    args: Sequence[str] = ()
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
        args += ["--maxmemory-policy", "noeviction", "--loglevel", "warning", *self.args]
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


CLUSTER_SLOTS = 16384


@dataclass(frozen=True)
class ClusterNodeView:
    """One node of a `RedisCluster` as the cluster sees it (a live node's CLUSTER NODES).

    `master_port` is a replica's master (None for a master); `slots` are a master's slot
    ranges, both ends included; `failed` is the asked node's `fail` / `fail?` flag."""

    port: int
    node_id: str
    master: bool
    master_port: int | None
    slots: tuple[tuple[int, int], ...]
    failed: bool

    def serves(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports (held open together while they are picked)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def _parse_cluster_nodes(text: str) -> list[ClusterNodeView]:
    """CLUSTER NODES' lines: `id ip:port@bus flags master-id ping pong epoch link slot...`."""
    rows = [line.split() for line in text.splitlines() if line.strip()]
    port_of = {row[0]: int(row[1].split("@")[0].rsplit(":", 1)[1]) for row in rows}
    views = []
    for row in rows:
        node_id, flags, master_id = row[0], set(row[2].split(",")), row[3]
        slots = []
        for item in row[8:]:  # row[4:8]: ping sent, pong received, config epoch, link
            if item.startswith("["):
                continue  # a slot being migrated or imported
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        views.append(
            ClusterNodeView(
                port=port_of[node_id],
                node_id=node_id,
                master="master" in flags,
                master_port=port_of.get(master_id) if master_id != "-" else None,
                slots=tuple(slots),
                failed=bool(flags & {"fail", "fail?"}),
            )
        )
    return sorted(views, key=lambda view: view.port)


@dataclass
class RedisCluster:
    """A Redis Cluster on 127.0.0.1: `masters` masters (at least 3) with
    `replicas_per_master` replicas each, every node a `RedisServer` child process.

    Each node has two free ports (clients, and the cluster bus: `--cluster-port`) and
    keeps its files (`nodes-PORT.conf`, and an AOF with `appendonly`) in its own folder
    of a temp dir that `stop` removes. `start` launches the nodes, joins them with
    `redis-cli --cluster create` and returns when the cluster is `ready` (below); ~3 s.
    `kill(port)` SIGKILLs one node (a failover test), `start_node(port)` runs it again
    from its nodes.conf, so it rejoins (as a replica if its slots failed over meanwhile).
    A silent node is failed over after `node_timeout_ms` (cluster-node-timeout)."""

    masters: int = 3
    replicas_per_master: int = 0
    node_timeout_ms: int = 2000
    appendonly: bool = False
    servers: dict[int, RedisServer] = field(default_factory=dict)
    start_s: float | None = None  # how long the last `start` took, to ready
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        if self.replicas_per_master < 0:
            raise ValueError("replicas_per_master must be ≥ 0")

    @classmethod
    def launch(cls, masters: int = 3, replicas_per_master: int = 0) -> RedisCluster:
        """A started cluster on free ports."""
        cluster = cls(masters=masters, replicas_per_master=replicas_per_master)
        cluster.start()
        return cluster

    @property
    def size(self) -> int:
        return self.masters * (1 + self.replicas_per_master)

    @property
    def ports(self) -> list[int]:
        """Every node's client port, in the order `redis-cli --cluster create` got them."""
        return list(self.servers)

    @property
    def url(self) -> str:
        """`redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...`: every node a startup node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.servers)

    # ---- start and stop ------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Launch the nodes, create the cluster and wait until it is ready
        (RedisServerNotFound without redis-server or redis-cli, RuntimeError if
        `--cluster create` fails, TimeoutError after `timeout` seconds)."""
        assert not any(s.proc for s in self.servers.values()), "this cluster is running"
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisServerNotFound("redis-cli")
        began = time.monotonic()
        deadline = began + timeout
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tokenfleet-cluster-")
        ports = _free_ports(2 * self.size)
        self.servers = {}
        try:
            for port, bus in zip(ports[: self.size], ports[self.size :], strict=True):
                folder = Path(self._tmp.name) / str(port)
                folder.mkdir()
                node_args = ["--cluster-enabled", "yes", "--cluster-port", str(bus)]
                node_args += ["--cluster-config-file", f"nodes-{port}.conf"]
                node_args += ["--cluster-node-timeout", str(self.node_timeout_ms)]
                # a replica's first sync starts at once (the default waits 5 s for others)
                node_args += ["--repl-diskless-sync-delay", "0"]
                self.servers[port] = server = RedisServer(
                    port=port, dir=folder, appendonly=self.appendonly, args=node_args
                )
                server.start(timeout=max(1.0, deadline - time.monotonic()))
            create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.servers)]
            create += ["--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
            done = subprocess.run(
                create,
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
            )
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}")
            self.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
            roles = [view.master for view in self.nodes()]
            assert roles.count(True) == self.masters, f"cluster roles: {self.nodes()}"
            self.start_s = time.monotonic() - began
        except BaseException:
            self.stop(kill=True)
            raise

    def stop(self, kill: bool = False) -> None:
        """End every node (SIGTERM; SIGKILL with `kill`) and remove the temp dir."""
        for server in self.servers.values():
            server.stop(kill=kill)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def kill(self, port: int) -> None:
        """SIGKILL one node (and reap it); the others fail it over after the timeout."""
        self.servers[port].stop(kill=True)

    def pause(self, port: int) -> None:
        """SIGSTOP one node: it neither serves nor replicates until `resume`."""
        proc = self.servers[port].proc
        assert proc is not None, f"node {port} is not running"
        proc.send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT a node `pause` stopped."""
        proc = self.servers[port].proc
        assert proc is not None, f"node {port} is not running"
        proc.send_signal(signal.SIGCONT)

    def replica_of(self, master: int) -> int:
        """Port of a replica that follows master `master` now."""
        for view in self.nodes():
            if view.master_port == master and not view.master:
                return view.port
        raise LookupError(f"master {master} has no replica")

    def start_node(self, port: int, timeout: float = 20.0) -> None:
        """Run a stopped node again: it rejoins from its nodes.conf (not waited for)."""
        self.servers[port].start(timeout=timeout)

    def running(self) -> list[int]:
        """Ports of the nodes whose process runs."""
        return [port for port, server in self.servers.items() if server.proc is not None]

    # ---- the cluster's view --------------------------------------------------------------

    def node_client(self, port: int) -> redis.Redis:
        """A plain client of one node (its own keys only; close it)."""
        return redis.Redis(port=port, socket_timeout=5)

    def _ask(self, port: int, *command: str) -> Any:
        client = self.node_client(port)
        try:
            return client.execute_command(*command, NEVER_DECODE=True)
        finally:
            client.close()

    def nodes(self, port: int | None = None) -> list[ClusterNodeView]:
        """Every node as node `port` (default: the first running one) sees it, by port."""
        asked = port if port is not None else self.running()[0]
        return _parse_cluster_nodes(self._ask(asked, "CLUSTER", "NODES").decode())

    def master_ports(self) -> list[int]:
        """Ports of the masters that serve slots now (a failed-over master serves none)."""
        return [view.port for view in self.nodes() if view.master and view.slots]

    def master_for(self, key: str | bytes) -> int:
        """Port of the master that serves `key`'s slot now."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for view in self.nodes():
            if view.master and not view.failed and view.serves(slot):
                return view.port
        raise LookupError(f"no live master serves slot {slot}")

    def ready(self) -> bool:
        """Whether every running node says `cluster_state:ok` with all 16384 slots
        served and every node known, all running nodes agree on who serves which slots
        and which replica follows which master, every slot's master is running (a killed
        master's slots have failed over), and every running replica of a running master
        has synced with it."""
        running = self.running()
        views = []
        try:
            for port in running:
                info = dict(
                    line.split(":", 1)
                    for line in self._ask(port, "CLUSTER", "INFO").decode().splitlines()
                    if ":" in line
                )
                if info.get("cluster_state") != "ok":
                    return False
                if int(info.get("cluster_slots_ok", 0)) != CLUSTER_SLOTS:
                    return False
                if int(info.get("cluster_known_nodes", 0)) != len(self.servers):
                    return False
                views.append(self.nodes(port))
            shapes = {tuple((v.port, v.master_port, v.slots) for v in view) for view in views}
            if len(shapes) != 1:
                return False
            if any(view.slots and view.port not in running for view in views[0]):
                return False  # a stopped master's slots not failed over yet
            for view in views[0]:
                if view.master_port is not None and view.port in running:
                    if view.master_port not in running:
                        continue
                    client = self.node_client(view.port)
                    try:
                        if client.info("replication").get("master_link_status") != "up":
                            return False
                    finally:
                        client.close()
        except redis.RedisError:
            return False
        return True

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until `ready` (TimeoutError, with the first node's view, after `timeout`)."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                try:
                    seen: object = self.nodes()
                except (redis.RedisError, IndexError) as exc:  # no node answers
                    seen = exc
                raise TimeoutError(f"Redis Cluster not ready after {timeout:g}s: {seen}")
            time.sleep(0.05)


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

    As a context manager it drains the workers on the way out (`drain`: SIGTERM, they
    finish what they hold; a worker still running after `drain_timeout` is killed), an
    exception in the block included, so no worker outlives the block that started it.
    """

    redis_url: str
    prefix: str = DEFAULT_PREFIX
    worker_args: Sequence[str] = ()
    log_dir: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    drain_timeout: float = 60.0
    _client: redis.Redis | None = field(default=None, repr=False)

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drain(self.drain_timeout)

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
            self._client = connect(self.redis_url)
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
