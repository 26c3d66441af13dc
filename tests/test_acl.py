"""Least privilege: every component runs under its own Redis ACL role (tokenfleet/acl.py).

This module starts redis-servers of its own (the session's shared server is left
alone), loaded with `--aclfile` from the file `tokenfleet acl` renders, plus an
`admin` user for the tests' own set-up and checks; the default user is off, as in
compose/redis/users.acl. Then real `tokenfleet worker` processes as `worker` serve
jobs end to end (a retry, dead letters, a claim after kill -9), a producer as
`producer` submits, streams, waits and cancels, a `tokenfleet gateway` process as
`gateway` serves completions, and `tokenfleet status` / `dead-letters` / `queue-cap`
processes run as `operator`. Whatever a role is refused lands in ACL LOG, and every
end-to-end test asserts it stayed empty: a missing permission fails a test even where
the code tolerates the error. Other tests show what each role cannot do.

A worker checks its rights and its credentials at start-up:
`test_a_worker_missing_a_command_exits_at_start_naming_it` and
`test_a_worker_with_a_wrong_password_exits_saying_so`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import redis
import yaml
from redis.exceptions import NoPermissionError, ResponseError
from typer.testing import CliRunner

from tests.helpers.support import KEYS, run_cli, wait_for
from tests.helpers.workers import Fleet, WorkerProcess
from tokenfleet.acl import (
    OPERATOR,
    PASSWORD_ENV,
    PRODUCER,
    ROLE_NAMES,
    ROLES,
    Role,
    Scope,
    markdown_table,
    render_acl_file,
    role,
    rules,
)
from tokenfleet.cli import app
from tokenfleet.errors import JobFailed, TenantQueueFull
from tokenfleet.keys import GROUP, Keys
from tokenfleet.local import free_port
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest, TokenEvent
from tokenfleet.reasons import FinishReason

ROOT = Path(__file__).parent.parent
STREAM = KEYS.jobs()
ADMIN = "admin"
PASSWORDS = {name: f"{name}-test-pw" for name in (*ROLE_NAMES, ADMIN)}
WORKER_ARGS = ("--inject-fault-on-metadata", "poison", "--max-deliveries", "2")


# ---- a redis-server that knows only the fleet's users -------------------------------------


@dataclass
class Tls:
    """A CA and a server certificate for 127.0.0.1, made with openssl."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, folder: Path) -> Tls:
        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        ca, ca_key = folder / "ca.crt", folder / "ca.key"
        cert, key, csr = folder / "server.crt", folder / "server.key", folder / "server.csr"
        openssl(
            "req",
            "-x509",
            *ec,
            "-keyout",
            str(ca_key),
            "-out",
            str(ca),
            "-days",
            "2",
            "-subj",
            "/CN=tokenfleet test CA",
        )
        openssl("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
        ext = folder / "san.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            "2",
            "-extfile",
            str(ext),
        )
        return cls(ca, cert, key)


@dataclass
class AclServer:
    """redis-server --aclfile: the roles of tokenfleet/acl.py plus `admin`, default off."""

    dir: Path
    tls: Tls | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def url(self, user: str, password: str | None = None) -> str:
        secret = quote(PASSWORDS.get(user, "") if password is None else password, safe="")
        if self.tls is None:
            return f"redis://{user}:{secret}@127.0.0.1:{self.port}/0"
        return f"rediss://{user}:{secret}@127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"

    def client(self, user: str, password: str | None = None) -> redis.Redis:
        return redis.Redis.from_url(self.url(user, password))

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH", pytrace=False)
        aclfile = self.dir / "users.acl"
        admin = f"user {ADMIN} on >{PASSWORDS[ADMIN]} ~* &* +@all\n"
        aclfile.write_text(render_acl_file(passwords=PASSWORDS) + admin)
        args = [binary, "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", ""]
        args += ["--appendonly", "no", "--maxmemory-policy", "noeviction"]
        args += ["--loglevel", "warning", "--logfile", str(self.dir / "redis.log")]
        args += ["--aclfile", str(aclfile)]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:  # TLS only: no plain-text port at all
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)]
            args += ["--tls-ca-cert-file", str(self.tls.ca)]
        with (self.dir / "redis.out").open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        self.admin = self.client(ADMIN)

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                logs = [self.dir / "redis.out", self.dir / "redis.log"]
                text = "".join(f.read_text(errors="replace") for f in logs if f.exists())
                raise AssertionError(f"redis-server exited:\n{text}")
            try:
                return bool(self.admin.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, 20, "redis-server to accept connections")

    def stop(self) -> None:
        self.admin.close()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None

    def denials(self) -> list[tuple[str, str, str, str]]:
        """ACL LOG as (user, reason, context, object): everything refused since the reset."""
        return [
            (e["username"], e["reason"], e["context"], e["object"]) for e in self.admin.acl_log()
        ]

    def reset_log(self) -> None:
        self.admin.acl_log_reset()

    def assert_no_denials(self) -> None:
        assert self.denials() == [], "a role was refused a command or key it needs"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    acl_server = AclServer(tmp_path_factory.mktemp("acl-redis"))
    acl_server.start()
    yield acl_server
    acl_server.stop()


@pytest.fixture(scope="module")
def workers(server: AclServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two worker processes as `worker` on the default stream (poison jobs fail)."""
    fleet = Fleet(server.url("worker"), tmp_path_factory.mktemp("acl-workers"))
    try:
        started = [fleet.start(f"acl-w{i}", *WORKER_ARGS, burst=False) for i in (1, 2)]
        for worker in started:
            fleet.wait_alive(worker)
        yield fleet
    finally:
        fleet.stop_all()


@pytest.fixture
def acl(server: AclServer) -> AclServer:
    """The module's server with ACL LOG reset, so a test sees only its own refusals."""
    server.reset_log()
    return server


def cli(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`tokenfleet ARGS --redis-url URL` as its own process."""
    return run_cli(*args, "--redis-url", url, timeout=timeout)


def live(fleet: Fleet) -> list[WorkerProcess]:
    return [w for w in fleet.workers if w.proc.poll() is None]


class Follow:
    """`handle.stream()` in a thread: every token event, or the error that ended it."""

    def __init__(self, stream: Callable[[], Iterator[TokenEvent]]) -> None:
        self.events: list[TokenEvent] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: Callable[[], Iterator[TokenEvent]]) -> None:
        try:
            self.events.extend(stream())
        except BaseException as exc:
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()


def holder_of(admin: redis.Redis, entry_id: str) -> str | None:
    for p in admin.xpending_range(STREAM, GROUP, "-", "+", 100):
        if p["message_id"].decode() == entry_id:
            return str(p["consumer"].decode())
    return None


def dead_letters_of(admin: redis.Redis, job_id: str) -> list[tuple[str, dict[bytes, bytes]]]:
    return [
        (entry_id.decode(), fields)
        for entry_id, fields in admin.xrange(KEYS.dead_letters(), "-", "+")
        if fields.get(b"job_id") == job_id.encode()
    ]


# ---- the role table, the shipped file, the CLI, compose -----------------------------------


def test_the_shipped_acl_file_is_the_role_table_rendered() -> None:
    shipped = (ROOT / "compose" / "redis" / "users.acl").read_text()
    assert shipped == render_acl_file(), "regenerate it: tokenfleet acl > compose/redis/users.acl"
    lines = shipped.splitlines()
    assert lines[0] == "user default off"
    assert [line.split()[1] for line in lines[1:]] == list(ROLE_NAMES)
    for r in ROLES:
        assert f">change-me-{r.name}" in shipped
    assert "+@all" not in shipped and "~*" not in shipped and "&*" not in shipped


def test_the_operations_guide_lists_exactly_these_commands() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    assert "## Least privilege: Redis ACL roles" in guide
    assert markdown_table() in guide, (
        "update the table in docs/operations.md: python -c "
        "'from tokenfleet.acl import markdown_table; print(markdown_table())'"
    )


def test_acl_renders_for_any_prefix_and_the_cli_prints_it() -> None:
    runner = CliRunner()
    env = {name: None for name in PASSWORD_ENV.values()}
    plain = runner.invoke(app, ["acl", "--prefix", "blue:"], env=env)
    assert plain.exit_code == 0, plain.output
    assert plain.output == render_acl_file("blue:")
    assert "tokenfleet:" not in plain.output
    for line in plain.output.splitlines()[1:]:
        assert " ~blue:* &blue:* " in line
        assert all(p.startswith(("~blue:", "(~blue:")) for p in line.split() if "~" in p)

    secret = {PASSWORD_ENV["worker"]: "s3cret worker pw"}
    hashed = runner.invoke(app, ["acl"], env={**env, **secret})
    assert hashed.exit_code == 0, hashed.output
    digest = hashlib.sha256(b"s3cret worker pw").hexdigest()
    assert f"user worker reset on #{digest} " in hashed.output
    assert "s3cret" not in hashed.output
    assert ">change-me-producer" in hashed.output  # roles without a password: placeholders

    glob = rules(PRODUCER, "odd*[x]:")  # glob characters in a prefix match only themselves
    assert "~odd\\*\\[x\\]:*" in glob
    with pytest.raises(ValueError):
        rules(PRODUCER, "two words:")


def test_compose_acl_overlay_runs_every_service_under_its_role() -> None:
    base = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())["services"]
    overlay_file = ROOT / "compose" / "docker-compose.acl.yml"
    overlay = yaml.safe_load(overlay_file.read_text())["services"]
    redis_svc = overlay["redis"]
    command = [str(a) for a in redis_svc["command"]]
    target = command[command.index("--aclfile") + 1]
    mounts = [str(v) for v in redis_svc["volumes"]]
    source = next(m.rsplit(":", 2)[0] for m in mounts if m.rsplit(":", 2)[1] == target)
    default = re.fullmatch(r"\$\{TOKENFLEET_REDIS_ACL_FILE:-(.+)\}", source)
    assert default is not None
    assert (overlay_file.parent / default.group(1)).resolve() == (
        ROOT / "compose" / "redis" / "users.acl"
    )
    base_redis = [str(a) for a in base["redis"]["command"]]
    assert command[: len(base_redis)] == base_redis  # AOF and noeviction kept
    users = {"worker": "worker", "worker-gpu": "worker", "gateway": "gateway"}
    for service, user in users.items():
        ours, theirs = overlay[service]["command"], base[service]["command"]
        url = ours[ours.index("--redis-url") + 1]
        expected = f"redis://{user}:${{{PASSWORD_ENV[user]}:-change-me-{user}}}@redis:6379/0"
        assert url == expected
        assert overlay[service]["environment"]["REDIS_URL"] == expected
        # the same command as the base file's, but for the URL
        assert [a for a in ours if a != url] == [a for a in theirs if not a.startswith("redis:")]
    pytest.importorskip("check_jsonschema")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(overlay_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- each role is confined ----------------------------------------------------------------

OUTSIDE = "elsewhere:key"
CAP = KEYS.queue_cap()
EVENTS = KEYS.events("acl-victim")
DENIED: dict[str, list[tuple[str, ...]]] = {
    # producers and the gateway: no acking, deleting or reading as a worker; no cap
    # changes; no forged events; nothing outside the prefix; no server administration
    "producer": [
        ("XACK", STREAM, GROUP, "1-1"),
        ("XDEL", STREAM, "1-1"),
        ("XREADGROUP", "GROUP", GROUP, "fake", "STREAMS", STREAM, ">"),
        ("XCLAIM", STREAM, GROUP, "fake", "0", "1-1"),
        ("SET", CAP, "1000000"),
        ("DEL", CAP),
        ("EXPIRE", CAP, "1"),
        ("HSET", KEYS.tenant_limits("acme"), "queued_share", "1"),
        ("ZREM", KEYS.tenant_queued("acme"), "x"),
        ("XADD", EVENTS, "*", "m", "forged"),
        ("PUBLISH", KEYS.channel("acl-victim"), "forged"),
        ("HSET", KEYS.worker("fake"), "max_job_tokens", "999999"),
        ("ZADD", KEYS.workers(), "1", "fake"),
        ("DEL", KEYS.dead_letters()),
        ("GET", OUTSIDE),
        ("SET", OUTSIDE, "1"),
        ("EVAL", "return 1", "0"),
        ("KEYS", "*"),
        ("FLUSHALL",),
        ("CONFIG", "GET", "maxmemory"),
    ],
    # workers: no cap or tenant-limit changes, no deleting dead letters or whole keys.
    # (A worker may XADD to a jobs stream: accept.lua puts a job whose tenant is at its
    # running limit back at the tail of its band.)
    "worker": [
        ("HSET", KEYS.tenant_limits("acme"), "max_running", "1000"),
        ("DEL", KEYS.tenant_limits(None)),
        ("SET", CAP, "1000000"),
        ("DEL", CAP),
        ("EXPIRE", CAP, "1"),
        ("DEL", STREAM),
        ("XDEL", KEYS.dead_letters(), "1-1"),
        ("SET", KEYS.cancel("acl-victim"), "1"),
        ("GET", OUTSIDE),
        ("SUBSCRIBE", KEYS.telemetry_channel()),
        ("EVAL", "return 1", "0"),
        ("FLUSHALL",),
        ("CONFIG", "SET", "maxmemory", "1"),
    ],
    # the operator runs the fleet, not Redis: nothing outside the prefix, no admin
    "operator": [
        ("GET", OUTSIDE),
        ("DEL", OUTSIDE),
        ("KEYS", "*"),
        ("SCAN", "0"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "*"),
        ("ACL", "LIST"),
        ("SHUTDOWN",),
        ("SCRIPT", "FLUSH"),
        ("CLIENT", "LIST"),
        ("EVAL", "return 1", "0"),
    ],
}
DENIED["gateway"] = [*DENIED["producer"], ("ZREM", KEYS.workers(), "acl-w1")]


@pytest.mark.parametrize(
    ("user", "command"),
    [(user, cmd) for user, cmds in DENIED.items() for cmd in cmds],
    ids=[f"{user}-{'-'.join(cmd[:2])}" for user, cmds in DENIED.items() for cmd in cmds],
)
def test_each_role_is_refused_what_it_does_not_need(
    acl: AclServer, user: str, command: tuple[str, ...]
) -> None:
    acl.admin.set(CAP, 1000)
    client = acl.client(user)
    try:
        assert client.ping()
        if command[0] == "SUBSCRIBE":
            pubsub = client.pubsub()
            with pytest.raises(NoPermissionError):
                pubsub.subscribe(*command[1:])
                pubsub.get_message(timeout=5)
            pubsub.close()
        else:
            with pytest.raises(NoPermissionError):
                client.execute_command(*command)
    finally:
        client.close()
    assert acl.admin.get(CAP) == b"1000"
    assert [d[0] for d in acl.denials()] == [user]


def test_scripts_run_with_the_callers_rights(acl: AclServer) -> None:
    """A script may only do what its caller may: a producer cannot XDEL through one."""
    entry = acl.admin.xadd(STREAM, {"job_id": "acl-script", "payload": b"x"}).decode()
    sha = acl.admin.script_load("return redis.call('XDEL', KEYS[1], ARGV[1])")
    producer, worker = acl.client("producer"), acl.client("worker")
    try:
        with pytest.raises(ResponseError):
            producer.evalsha(sha, 1, STREAM, entry)
        assert acl.admin.xrange(STREAM, entry, entry)  # still there
        assert acl.denials() == [("producer", "command", "lua", "xdel")]
        assert worker.evalsha(sha, 1, STREAM, entry) == 1
    finally:
        producer.close()
        worker.close()


def test_roles_rendered_for_another_prefix_are_confined_to_it(acl: AclServer) -> None:
    blue = Keys("blue:")
    acl.admin.execute_command("ACL", "SETUSER", "blue-producer", *rules(PRODUCER, "blue:", "b"))
    acl.admin.execute_command("ACL", "SETUSER", "blue-operator", *rules(OPERATOR, "blue:", "b"))
    try:
        producer = Producer.from_url(acl.url("blue-producer", "b"), prefix="blue:")
        handle = producer.submit(job_id="blue-1", prompt="hi", max_new_tokens=2)
        assert acl.admin.hget(blue.job("blue-1"), "status") == b"queued"
        assert handle.cancel()
        with pytest.raises(NoPermissionError):
            producer.redis.get(CAP)
        status = cli(acl.url("blue-operator", "b"), "status", "--json", "--prefix", "blue:")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["queues"][0]["depth"] == 1
        elsewhere = Producer.from_url(acl.url("blue-producer", "b"))  # the prefix tokenfleet:
        with pytest.raises(NoPermissionError):
            elsewhere.submit(prompt="hi")
        elsewhere.redis.close()
        producer.redis.close()
    finally:
        acl.admin.execute_command("ACL", "DELUSER", "blue-producer", "blue-operator")
        acl.admin.delete(blue.jobs(), blue.job("blue-1"), blue.cancel("blue-1"), blue.models())
    assert {d[0] for d in acl.denials()} == {"blue-producer"}


# ---- every component, end to end, under its own role --------------------------------------


def test_producer_and_workers_serve_jobs_end_to_end_under_their_roles(
    acl: AclServer, workers: Fleet
) -> None:
    admin = acl.admin
    producer = Producer.from_url(acl.url("producer"))

    # submit, stream every token once, in order, and the result
    handle = producer.submit(
        job_id="acl-stream", prompt="Hello", max_new_tokens=12, ignore_eos=True
    )
    tokens = list(handle.stream(timeout=60))
    assert [t.index for t in tokens] == list(range(12))
    result = handle.result(timeout=60)
    assert result.finish_reason == FinishReason.LENGTH
    assert result.token_ids == [t.token_id for t in tokens]
    assert handle.status().status == "finished"

    # several in one round trip: scripts queued on a pipeline
    many = producer.submit_many(
        GenerationRequest(job_id=f"acl-many-{i}", prompt="hi", max_new_tokens=4, ignore_eos=True)
        for i in range(3)
    )
    assert [o.error for o in many] == [None] * 3
    for outcome in many:
        assert outcome.handle is not None
        assert outcome.handle.result(timeout=60).usage.completion_tokens == 4

    # cancel a running job
    long = producer.submit(
        job_id="acl-cancel", prompt="a long story", max_new_tokens=2000, ignore_eos=True
    )
    wait_for(lambda: admin.xlen(KEYS.events(long.id)) > 0, 60, "the long job to start")
    assert long.cancel()
    assert long.result(timeout=60).finish_reason == FinishReason.CANCELLED

    # garbage a producer XADDed itself (it may: submit.lua adds to the same stream)
    entry = producer.redis.xadd(STREAM, {"job_id": "acl-garbage", "payload": b"\xc1\xc1"})
    wait_for(lambda: dead_letters_of(admin, "acl-garbage"), 60, "the garbage dead-lettered")
    [(_, letter)] = dead_letters_of(admin, "acl-garbage")
    assert letter[b"reason"] == b"not_msgpack"
    assert letter[b"entry"] == entry
    assert not admin.xrange(STREAM, entry, entry)

    # a job that fails every time: retried once (--max-deliveries 2), then dead-lettered
    poison = producer.submit(
        job_id="acl-poison", prompt="bad", max_new_tokens=8, metadata={"poison": True}
    )
    with pytest.raises(JobFailed):
        poison.result(timeout=60)
    [(_, letter)] = dead_letters_of(admin, "acl-poison")
    assert letter[b"reason"] == b"engine_error"
    assert letter[b"deliveries"] == b"2"

    # kill -9 the worker holding a job mid-stream: the other claims it and finishes it
    assert len(live(workers)) == 2
    claimed = producer.submit(
        job_id="acl-claim", prompt="resume me", max_new_tokens=1200, ignore_eos=True
    )
    follow = Follow(lambda: claimed.stream(timeout=60))
    wait_for(lambda: admin.xlen(KEYS.events(claimed.id)) >= 3, 60, "the job mid-stream")
    holder = holder_of(admin, claimed.entry_id)
    assert holder is not None
    [victim] = [w for w in workers.workers if w.name == holder]
    victim.kill()
    assert not admin.exists(KEYS.result(claimed.id)), "it finished before the kill"
    wait_for(follow.done, 120, "the claimed job to finish")
    assert follow.error is None, follow.error
    finished = claimed.result(timeout=60)
    assert finished.finish_reason == FinishReason.LENGTH
    assert finished.worker not in (None, holder)
    assert [e.index for e in follow.events] == list(range(1200))
    assert [e.token_id for e in follow.events] == finished.token_ids

    # a fresh producer finds the dead worker's name stale and prunes it
    later = Producer.from_url(acl.url("producer"))
    assert later.submit(job_id="acl-after", prompt="hi", max_new_tokens=2).result(timeout=60)
    assert holder.encode() not in admin.zrange(KEYS.workers(), 0, -1)
    producer.redis.close()
    later.redis.close()
    acl.assert_no_denials()


def test_bands_and_tenant_limits_work_under_the_roles(acl: AclServer, workers: Fleet) -> None:
    """The operator sets tenant limits (`tokenfleet tenants set`); the producer's submit.lua
    counts and refuses per tenant; the workers' pull.lua reads every band and accept.lua
    puts a job whose tenant is at max_running back in its band: all without a denial."""
    url = acl.url("operator")
    done = cli(url, "tenants", "set", "acl-t", "--queued-share", "0.002", "--max-running", "1")
    assert done.returncode == 0, done.stderr
    producer = Producer.from_url(acl.url("producer"))
    try:
        # cap 1000 x 0.002: two of acl-t's jobs may wait at once
        first = producer.submit(
            job_id="acl-t-0",
            prompt="hi",
            max_new_tokens=600,
            ignore_eos=True,
            priority="batch",
            tenant="acl-t",
        )
        wait_for(lambda: first.status().status == "running", 60, "acl-t's first job to start")
        waiting = [
            producer.submit(
                job_id=f"acl-t-{i}",
                prompt="hi",
                max_new_tokens=4,
                priority="batch",
                tenant="acl-t",
            )
            for i in (1, 2)
        ]
        with pytest.raises(TenantQueueFull):
            producer.submit(job_id="acl-t-3", prompt="hi", tenant="acl-t")
        # another tenant's interactive job is served while acl-t runs its one job
        other = producer.submit(
            job_id="acl-u-0",
            prompt="hi",
            max_new_tokens=4,
            priority="interactive",
            tenant="acl-u",
        )
        assert other.result(timeout=60).finish_reason == FinishReason.LENGTH
        assert acl.admin.zcard(KEYS.tenant_running("acl-t")) == 1
        assert first.cancel()
        for handle in waiting:
            assert handle.result(timeout=60).finish_reason == FinishReason.LENGTH
        listed = cli(url, "tenants", "--json")
        assert listed.returncode == 0, listed.stderr
        assert "acl-t" in listed.stdout
    finally:
        acl.admin.delete(KEYS.tenant_limits("acl-t"))
        producer.redis.close()
    acl.assert_no_denials()


def test_the_gateway_serves_completions_under_the_gateway_role(
    acl: AclServer, workers: Fleet, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    args = [sys.executable, "-m", "tokenfleet.cli", "gateway", "--redis-url", acl.url("gateway")]
    args += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60) as http:

            def healthy() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"the gateway exited:\n{log.read_text()}")
                if acl.denials():  # fail now, naming what it was refused
                    raise AssertionError(f"refused: {acl.denials()}\n{log.read_text()}")
                try:
                    reply = http.get("/health")
                except httpx.TransportError:
                    return False
                return reply.status_code == 200 and reply.json()["live_workers"] >= 1

            wait_for(healthy, 60, "the gateway to serve /health")
            models = http.get("/v1/models")
            assert models.status_code == 200, models.text
            assert "default" in [m["id"] for m in models.json()["data"]]
            body = {
                "model": "default",
                "prompt": "Hello",
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            }
            whole = http.post("/v1/completions", json=body)
            assert whole.status_code == 200, whole.text
            assert whole.json()["usage"]["completion_tokens"] == 6
            chunks = []
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line.removeprefix("data: ")))
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert text == whole.json()["choices"][0]["text"]
            # /metrics reads the fleet-wide gauges (XLEN, XINFO GROUPS, ZCARD, heartbeats)
            page = http.get("/metrics").text
            waiting = 'tokenfleet_fleet_num_requests_waiting{band="default",model="default"} 0.0'
            assert waiting in page, page
            assert "tokenfleet_gateway_fleet_read_errors_total 0.0" in page
            # a batch, start to end: files, the batch state, the driver's lease and MGETs
            line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
            upload = http.post(
                "/v1/files",
                files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
                data={"purpose": "batch"},
            )
            assert upload.status_code == 200, upload.text
            created = http.post(
                "/v1/batches",
                json={
                    "input_file_id": upload.json()["id"],
                    "endpoint": "/v1/completions",
                    "completion_window": "24h",
                },
            )
            assert created.status_code == 200, created.text
            batch_id = created.json()["id"]

            def batch_done() -> bool:
                if acl.denials():
                    raise AssertionError(f"refused: {acl.denials()}\n{log.read_text()}")
                return http.get(f"/v1/batches/{batch_id}").json()["status"] == "completed"

            wait_for(batch_done, 60, "the batch to complete under the gateway role")
            output_id = http.get(f"/v1/batches/{batch_id}").json()["output_file_id"]
            result = json.loads(http.get(f"/v1/files/{output_id}/content").text)
            assert result["response"]["body"]["choices"][0]["text"] == text
            assert http.delete(f"/v1/files/{upload.json()['id']}").json()["deleted"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    acl.assert_no_denials()


def test_a_gateway_refused_a_command_says_so_instead_of_redis_unavailable(
    acl: AclServer, workers: Fleet, tmp_path: Path
) -> None:
    """A missing permission is the operator's to fix: 500 `redis_forbidden` naming the
    command, not a `503 redis_unavailable` that clients would retry forever."""
    lacking = without(role("gateway"), "evalsha")  # the submit script
    acl.admin.execute_command("ACL", "SETUSER", lacking.name, *rules(lacking, password="pw"))
    port = free_port()
    log = tmp_path / "gateway.log"
    url = acl.url(lacking.name, "pw")
    args = [sys.executable, "-m", "tokenfleet.cli", "gateway", "--redis-url", url]
    args += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            replies: list[httpx.Response] = []

            def answered() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"the gateway exited:\n{log.read_text()}")
                try:
                    body = {"model": "default", "prompt": "Hello", "max_tokens": 4}
                    replies.append(http.post("/v1/completions", json=body))
                except httpx.TransportError:
                    return False
                return True

            wait_for(answered, 60, "the gateway to answer")
            reply = replies[0]
            assert reply.status_code == 500, reply.text
            error = reply.json()["error"]
            assert error["code"] == "redis_forbidden" and "evalsha" in error["message"], error
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        acl.admin.execute_command("ACL", "DELUSER", lacking.name)
        acl.admin.execute_command("ACL", "LOG", "RESET")


def test_the_operator_role_runs_status_dead_letters_and_queue_cap(
    acl: AclServer, workers: Fleet
) -> None:
    url = acl.url("operator")
    producer = Producer.from_url(acl.url("producer"))
    poison = producer.submit(
        job_id="acl-op-poison", prompt="bad", max_new_tokens=4, metadata={"poison": True}
    )
    with pytest.raises(JobFailed):
        poison.result(timeout=60)

    status = cli(url, "status", "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["dead_letters"] >= 1
    assert {w.name for w in live(workers)} <= set(view["workers"])
    assert "default" in [q["model"] for q in view["queues"]]
    assert cli(url, "status").returncode == 0  # the table too

    listed = cli(url, "dead-letters", "--json")
    assert listed.returncode == 0, listed.stderr
    [letter] = [e for e in json.loads(listed.stdout) if e["job_id"] == "acl-op-poison"]
    requeued = cli(url, "dead-letters", "--requeue", letter["id"])
    assert requeued.returncode == 0, requeued.stderr
    assert "job acl-op-poison submitted again" in requeued.stdout

    def failed_again() -> bool:
        letters = dead_letters_of(acl.admin, "acl-op-poison")
        return len(letters) == 1 and letters[0][0] != letter["id"]

    wait_for(failed_again, 60, "the requeued job to run (and fail) again")

    try:
        capped = cli(url, "queue-cap", "500")
        assert capped.returncode == 0, capped.stderr
        assert "cap 500" in capped.stdout
        assert acl.admin.get(KEYS.queue_cap()) == b"500"
    finally:
        acl.admin.delete(KEYS.queue_cap())
    producer.redis.close()
    acl.assert_no_denials()


def test_a_fleet_over_tls_serves_a_job(tmp_path: Path) -> None:
    """rediss:// with ?ssl_ca_certs=: a worker and a producer on a TLS-only redis-server."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    tls_server = AclServer(tmp_path, tls=Tls.make(tmp_path))
    try:
        tls_server.start()
    except AssertionError as exc:
        if "tls" in str(exc).lower() and "Bad directive" in str(exc):
            pytest.skip("this redis-server is built without TLS")
        raise
    fleet = Fleet(tls_server.url("worker"), tmp_path)
    try:
        worker = fleet.start("acl-tls-w", burst=False)
        fleet.wait_alive(worker)
        producer = Producer.from_url(tls_server.url("producer"))
        handle = producer.submit(prompt="over TLS", max_new_tokens=5, ignore_eos=True)
        assert len(list(handle.stream(timeout=60))) == 5
        assert handle.result(timeout=60).worker == "acl-tls-w"
        producer.redis.close()
        tls_server.assert_no_denials()
    finally:
        fleet.stop_all()
        tls_server.stop()


# ---- part 7: a worker refuses to start without its rights or with wrong credentials -------


def without(r: Role, command: str) -> Role:
    """`r` less one command, wherever it is granted."""
    scoped = tuple(
        Scope(s.patterns, {c: why for c, why in s.commands.items() if c != command})
        for s in r.scoped
    )
    commands = {c: why for c, why in r.commands.items() if c != command}
    assert command in r.all_commands()
    return Role(f"{r.name}-no-{command}", r.summary, commands, scoped)


@pytest.mark.parametrize("missing", ["xdel", "evalsha"])
def test_a_worker_missing_a_command_exits_at_start_naming_it(
    acl: AclServer, tmp_path: Path, missing: str
) -> None:
    """The start-up probe refuses to serve: before it, a worker served jobs until a script
    hit the missing command mid-way (leaving half its writes behind)."""
    lacking = without(role("worker"), missing)
    acl.admin.execute_command("ACL", "SETUSER", lacking.name, *rules(lacking, password="pw"))
    model = f"acl-no-{missing}"
    keys = KEYS
    producer = Producer.from_url(acl.url("producer"))
    job = producer.submit(
        job_id=f"acl-untouched-{missing}", prompt="hi", max_new_tokens=4, model=model
    )
    fleet = Fleet(acl.url(lacking.name, "pw"), tmp_path)
    try:
        worker = fleet.start(f"acl-{lacking.name}", "--model-name", model, burst=False)
        wait_for(lambda: worker.proc.poll() is not None, 120, "the worker to exit at start")
        output = worker.output()
        assert worker.proc.returncode != 0, output
        assert re.search(rf"\b{missing}\b", output, re.IGNORECASE), output
        # ... before serving anything: the job is untouched and was never even read
        assert acl.admin.hget(keys.job(job.id), "status") == b"queued"
        assert not acl.admin.exists(keys.events(job.id), keys.result(job.id))
        try:
            pending = acl.admin.xpending(keys.jobs(model), GROUP)["pending"]
        except ResponseError:  # no group: it never got that far
            pending = 0
        assert pending == 0, f"the job was read before the worker gave up:\n{output}"
    finally:
        fleet.stop_all()
        acl.admin.execute_command("ACL", "DELUSER", lacking.name)
        acl.admin.delete(keys.jobs(model), keys.job(job.id), keys.models())
        producer.redis.close()


REFUSED = re.compile(r"auth|password|credential", re.IGNORECASE)


def test_a_worker_with_a_wrong_password_exits_saying_so(acl: AclServer, tmp_path: Path) -> None:
    """A refused password stops the worker: before, it was retried every few seconds,
    forever."""
    fleet = Fleet(acl.url("worker", "not-the-password"), tmp_path)
    try:
        worker = fleet.start("acl-wrong-password", burst=False)

        def refused_or_exited() -> bool:
            return worker.proc.poll() is not None or bool(REFUSED.search(worker.output()))

        wait_for(refused_or_exited, 120, "the worker to reach Redis")
        wait_for(
            lambda: worker.proc.poll() is not None,
            30,
            f"the worker to exit once its credentials were refused:\n{worker.output()}",
        )
        output = worker.output()
        assert worker.proc.returncode != 0, output
        assert REFUSED.search(output), output
    finally:
        fleet.stop_all()


def test_a_partitioned_fleet_serves_jobs_under_the_roles(acl: AclServer, tmp_path: Path) -> None:
    """With the queue in partitions every key a script touches carries a hash tag
    (`<prefix>{pN}:...`, as on a Redis Cluster): the roles' scoped patterns match those
    too, so a producer and a worker serve jobs of every partition without a refusal."""
    fleet = Fleet(acl.url("worker"), tmp_path)
    producer = Producer.from_url(acl.url("producer"), partitions=2)
    try:
        handles = [
            producer.submit(job_id=f"acl-part-{i}", prompt="hi", max_new_tokens=6, ignore_eos=True)
            for i in range(6)
        ]
        assert {producer.keys.partition_of(h.id) for h in handles} == {0, 1}
        fleet.local.start_one("acl-part", ["--burst"], env={"TOKENFLEET_PARTITIONS": "2"})
        worker = WorkerProcess("acl-part", fleet.local)
        fleet.workers.append(worker)
        for handle in handles:
            assert handle.result(timeout=120).usage.completion_tokens == 6
        assert worker.wait(120) == 0, worker.output()
        acl.assert_no_denials()
    finally:
        producer.redis.close()
        fleet.stop_all()
