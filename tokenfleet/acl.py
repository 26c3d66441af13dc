"""Redis ACL roles for a fleet: what each component may send, under one key prefix.

This table is the one source of truth for the roles: `tokenfleet acl` prints it as
an ACL file, compose/redis/users.acl is that output for the default prefix, and
tests/test_acl.py loads it into a real redis-server and runs every component
under its own role. docs/operations.md ("Least privilege") explains it.

Every role is confined to the fleet's keys (`~<prefix>*`) and channels
(`&<prefix>*`) and gets only the commands it sends (redis-py's and its own), with
these rules:

* Lua scripts run with the caller's rights: the commands inside a script count
  for whoever runs it (a producer that runs submit.lua needs XADD, HSET, ...).
* redis-py runs a registered script with EVALSHA, loads it with SCRIPT LOAD when
  the server lacks it, and checks the scripts queued on a pipeline with SCRIPT
  EXISTS first. A transactional pipeline is MULTI ... EXEC.
* On connect redis-py sends AUTH (always allowed) and CLIENT SETINFO (Redis ≥ 7.2;
  redis-py ignores a refusal, so it is not granted: Redis 7.0 does not know it).
  A URL naming a database other than 0 also needs `select`.
* A role's write commands are scoped to the key families it writes (`Scope`, an
  ACL selector): a producer or a worker can neither set nor clear a queue cap, a
  producer cannot write into a job's replay stream, a worker cannot add jobs.
  Reads are allowed on every key under the prefix.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenfleet.keys import DEFAULT_PREFIX


@dataclass(frozen=True)
class Scope:
    """Commands a role may send only on keys matching `patterns` (globs after the prefix)."""

    patterns: tuple[str, ...]
    commands: Mapping[str, str]  # command (ACL name, e.g. "xgroup|create") -> why


@dataclass(frozen=True)
class Role:
    """One Redis user of the fleet."""

    name: str
    summary: str
    commands: Mapping[str, str]  # on any key/channel under the prefix: command -> why
    scoped: tuple[Scope, ...] = field(default=())

    def all_commands(self) -> set[str]:
        """Every command this role may send, on some key."""
        names = set(self.commands)
        for scope in self.scoped:
            names |= set(scope.commands)
        return names


_CONNECT = {"ping": "health checks (redis-py health_check_interval, /health)"}
_SCRIPTS = {
    "evalsha": "runs the role's scripts (redis-py register_script)",
    "script|load": "loads a script the server lacks (after a restart, on first use)",
}
_PIPELINED_SCRIPTS = {"script|exists": "redis-py checks scripts queued on a pipeline first"}
# submit.lua's writes (reads are granted on every key): the jobs stream, the job hash,
# the set of model names, the tenant's queued set and the set of tenant names.
_SUBMIT_WRITES = (
    Scope(("jobs:*",), {"xadd": "submit.lua: the job's entry in its band's jobs stream"}),
    Scope(
        ("tenant:*:queued:*",),
        {
            "zadd": "submit.lua: the job joins its tenant's queued set",
            "zremrangebyscore": "submit.lua: drops queued-set members older than a job hash",
        },
    ),
    Scope(("models", "tenants"), {"sadd": "submit.lua: the sets of model and tenant names"}),
    Scope(
        ("job:*",),
        {
            "hset": "submit.lua: the job's state hash",
            "expire": "submit.lua: the job hash's TTL",
        },
    ),
    Scope(("job:*:cancel",), {"set": "cancel: the job's cancel flag"}),
)
_FOLLOW = {
    "get": "the job's result; submit.lua: the queue cap",
    "exists": "whether the job's state/result still exists",
    "hget": "cancel: the job's status; submit.lua: an earlier submit of the same id",
    "xrange": "replaying the job's events",
    "xlen": "submit.lua: the queue depth; Producer.depth",
    "zrange": "live workers' names (capacity check before submit)",
    "zcard": "submit.lua: the tenant's queued jobs",
    "subscribe": "the job's live channel",
    "ssubscribe": "the job's live channel on a cluster (a shard channel)",
}

PRODUCER = Role(
    "producer",
    "submits jobs (submit.lua), follows them (replay stream + live channel), reads "
    "results, cancels; Producer and AsyncProducer",
    {
        **_CONNECT,
        **_SCRIPTS,
        **_PIPELINED_SCRIPTS,
        **_FOLLOW,
        "hgetall": "live workers' hashes (capacity check); JobHandle.status",
    },
    (
        *_SUBMIT_WRITES,
        Scope(("workers",), {"zrem": "prunes stale worker names it finds (live_workers)"}),
    ),
)

GATEWAY = Role(
    "gateway",
    "the HTTP gateway: an AsyncProducer (submit, follow, cancel) plus the read-only "
    "fleet view for /v1/models and /health",
    {
        **_CONNECT,
        **_SCRIPTS,
        **_FOLLOW,
        "unsubscribe": "the shared subscriber drops the channels of finished requests",
        "sunsubscribe": "the same on a cluster (shard channels)",
        "client|setname": "names its connections on connect (CLIENT LIST); refused = no connection",
        "hgetall": "worker hashes for /v1/models and /health; a batch's results",
        "mget": "the batch driver: the results of a batch's jobs, in one call",
        "xinfo|groups": "/metrics: each band's pending jobs (waiting = XLEN - pending)",
        "zrevrange": "/v1/files: newest files first",
        "zrevrangebyscore": "/v1/batches: newest batches first, paginated",
        "zscore": "/v1/batches?after=: where the page starts",
        "smembers": "the batch driver: the batches not finished yet",
        "multi": "files and batches are written in one transaction (MULTI ... EXEC)",
        "exec": "files and batches are written in one transaction (MULTI ... EXEC)",
    },
    (
        *_SUBMIT_WRITES,
        Scope(
            ("file:*", "files", "files:*", "batch:*", "batches", "batches:*"),
            {
                "sadd": "the set of unfinished batches",
                "srem": "a batch that ended leaves the set of unfinished ones",
                "set": "/v1/files: a file's bytes; lease.lua: the batch driver's lease",
                "hset": "a file's or batch's object; a batch's results as lines end",
                "zadd": "the lists of files and batches, all and per tenant",
                "zrem": "DELETE /v1/files/ID",
                "del": "DELETE /v1/files/ID; a finished batch's results and lease",
                "pexpire": "lease.lua: the batch driver renews its lease",
            },
        ),
    ),
)

# The worker's start-up check (lua/probe.lua) runs every command it needs on throwaway
# keys `<prefix>probe:<worker>:*`, so each of its scoped commands is also allowed there.
WORKER_PROBE_KEYS = "probe:*"


def _worker_scope(patterns: tuple[str, ...], commands: Mapping[str, str]) -> Scope:
    return Scope((*patterns, WORKER_PROBE_KEYS), commands)


WORKER = Role(
    "worker",
    "serves one jobs stream: reads and claims entries, publishes events, finishes or "
    "dead-letters jobs, heartbeats",
    {
        **_CONNECT,
        **_SCRIPTS,
        **_PIPELINED_SCRIPTS,
        "multi": "the heartbeat and leave transactions",
        "exec": "the heartbeat and leave transactions",
        "xreadgroup": "reads new entries (pull.lua) and its own pending list",
        "xinfo|consumers": "finds consumers whose worker may be dead",
        "xinfo|groups": "pull.lua: whether a band has entries not delivered yet",
        "xrevrange": "pull.lua: a band's newest entry",
        "zcard": "accept.lua: how many jobs the tenant runs",
        "zscore": "accept.lua: whether the job is counted running already",
        "xpending": "scripts: who owns an entry (the write fence), claimable entries",
        "xrange": "tokens already emitted (resume); scripts: whether an entry still exists",
        "xlen": "--burst: whether the stream is empty",
        "hget": "scripts: the job's status and recorded entry",
        "hmget": "scripts: the job's status, entry and emitted count",
        "exists": "scripts: a candidate's heartbeat, a job's cancel flag",
        "publish": "events on each job's live channel, telemetry",
        "spublish": "events on each job's live channel on a cluster (a shard channel)",
        "wait": "durable mode (--wait-replicas): a tick's writes acknowledged by replicas",
    },
    (
        _worker_scope(
            ("jobs:*",),
            {
                "xgroup|create": "creates the stream's consumer group",
                "xgroup|delconsumer": "claim_orphans.lua: drops dead consumers",
                "xclaim": "scripts: claims dead workers' entries, counts a retry",
                "xack": "scripts: acks a finished entry",
                "xdel": "scripts: deletes a finished entry (XLEN = depth)",
                "xadd": "accept.lua: puts a job whose tenant is at max_running back in its "
                "band (only the entry its state records is the job)",
            },
        ),
        _worker_scope(
            ("tenant:*:queued:*", "tenant:*:running:*"),
            {
                "zadd": "accept.lua: a started job joins its tenant's running set",
                "zrem": "scripts: a started or finished job leaves its tenant's sets",
            },
        ),
        _worker_scope(("pulls:*",), {"hset": "pull.lua: the starvation guard's counts"}),
        _worker_scope(("job:*:events", "dead"), {"xadd": "job events; dead letters"}),
        _worker_scope(("job:*:result",), {"set": "scripts: the job's result"}),
        _worker_scope(
            ("job:*", "worker:*"),
            {
                "hset": "job state (running, finished); its heartbeat hash",
                "expire": "TTLs of job hashes, replay streams and its heartbeat hash",
            },
        ),
        _worker_scope(("worker:*",), {"del": "drops its heartbeat hash on a clean exit"}),
        _worker_scope(
            ("alive:*",),
            {
                "set": "a partitioned fleet: its heartbeat's flag per partition",
                "del": "drops those flags on a clean exit",
            },
        ),
        _worker_scope(
            ("workers",),
            {"zadd": "announces itself in the workers set", "zrem": "leaves the workers set"},
        ),
    ),
)

OPERATOR = Role(
    "operator",
    "tokenfleet status/top, dead-letters (list, requeue), queue-cap, and the redis-cli "
    "reads of docs/operations.md",
    {
        **_CONNECT,
        **_SCRIPTS,
        "get": "queue caps; submit.lua (requeue)",
        "set": "queue-cap N; cancelling a job by hand",
        "smembers": "the model names",
        "xlen": "queue depth, dead-letter count",
        "xinfo|groups": "in flight / consumers per stream",
        "xpending": "who holds what (redis-cli)",
        "xrange": "a dead letter (requeue), a job's events (redis-cli)",
        "xrevrange": "the newest dead letters",
        "xdel": "drops a requeued dead letter",
        "xadd": "submit.lua (requeue)",
        "zrange": "worker names",
        "zrem": "prunes stale worker names",
        "zadd": "submit.lua (requeue): the tenant's queued set",
        "zcard": "tokenfleet tenants: queued and running jobs per tenant; submit.lua",
        "zremrangebyscore": "submit.lua (requeue)",
        "hgetall": "worker hashes, job hashes (redis-cli)",
        "hget": "submit.lua (requeue)",
        "hmget": "a dead letter's job: is it still queued or running (requeue)",
        "hset": "submit.lua (requeue); tokenfleet tenants set",
        "expire": "submit.lua (requeue)",
        "sadd": "submit.lua (requeue)",
        "del": "clears a requeued job's old state, result and events; a tenant's limits",
        "ttl": "a worker's heartbeat TTL (redis-cli)",
        "subscribe": "telemetry and a job's live channel (redis-cli)",
    },
)

ROLES: tuple[Role, ...] = (PRODUCER, WORKER, GATEWAY, OPERATOR)
ROLE_NAMES = tuple(role.name for role in ROLES)

# Environment variables `tokenfleet acl` reads a role's password from.
PASSWORD_ENV = {role.name: f"TOKENFLEET_REDIS_{role.name.upper()}_PASSWORD" for role in ROLES}


def role(name: str) -> Role:
    for candidate in ROLES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no role {name!r}; roles: {', '.join(ROLE_NAMES)}")


def placeholder_password(name: str) -> str:
    return f"change-me-{name}"


_GLOB = re.compile(r"([*?\[\]\\])")


def _glob_escape(text: str) -> str:
    return _GLOB.sub(r"\\\1", text)


def _checked_prefix(prefix: str) -> str:
    if not prefix or any(ch.isspace() for ch in prefix) or any(ch in prefix for ch in "()\"'"):
        raise ValueError(f"prefix {prefix!r} cannot be used in an ACL rule")
    return _glob_escape(prefix)


def _password_rule(password: str | None, name: str, hashed: bool) -> str:
    if password is None:
        return f">{placeholder_password(name)}"
    if hashed:
        return "#" + hashlib.sha256(password.encode()).hexdigest()
    if any(ch.isspace() for ch in password):
        raise ValueError(f"the {name} password contains whitespace: use hashed=True")
    return f">{password}"


TAGGED = "{p*}:"  # a partition's hash tag in a key pattern ({ and } are literal there)


def rules(
    r: Role, prefix: str = DEFAULT_PREFIX, password: str | None = None, *, hashed: bool = False
) -> list[str]:
    """`ACL SETUSER <name>` arguments for role `r` under `prefix`.

    Without a password the rule is the placeholder `>change-me-<name>`; `hashed`
    writes `#<sha256>` instead of the clear text. The first rule is `reset`, so
    applying them again replaces the user wholesale."""
    p = _checked_prefix(prefix)
    out = ["reset", "on", _password_rule(password, r.name, hashed), f"~{p}*", f"&{p}*"]
    out += [f"+{command}" for command in sorted(r.commands)]
    for scope in r.scoped:
        # each pattern also under a partition's hash tag (`<prefix>{pN}:...`, keys.py): a
        # partitioned fleet's, or one on Redis Cluster
        keys = " ".join(f"~{p}{tag}{pattern}" for pattern in scope.patterns for tag in ("", TAGGED))
        commands = " ".join(f"+{command}" for command in sorted(scope.commands))
        out.append(f"({keys} {commands})")
    return out


def user_line(
    r: Role, prefix: str = DEFAULT_PREFIX, password: str | None = None, *, hashed: bool = False
) -> str:
    """One `user ...` line of an ACL file."""
    return " ".join(["user", r.name, *rules(r, prefix, password, hashed=hashed)])


def render_acl_file(
    prefix: str = DEFAULT_PREFIX,
    passwords: Mapping[str, str] | None = None,
    *,
    hashed: bool = True,
) -> str:
    """An ACL file (redis-server --aclfile) for `prefix`: `user default off`, then one
    user per role. Roles without an entry in `passwords` get the placeholder
    `>change-me-<role>`; given passwords are written as `#<sha256>` unless not `hashed`.

    An ACL file holds nothing but `user` lines (Redis refuses comments in it): the
    explanations live here and in docs/operations.md."""
    passwords = passwords or {}
    lines = ["user default off"]
    lines += [user_line(r, prefix, passwords.get(r.name), hashed=hashed) for r in ROLES]
    return "\n".join(lines) + "\n"


def markdown_table(prefix: str = DEFAULT_PREFIX) -> str:
    """The roles as the Markdown table in docs/operations.md ("Least privilege")."""
    rows = [
        "| role | commands on any key / channel under the prefix | commands only on these keys |",
        "|---|---|---|",
    ]
    for r in ROLES:
        anywhere = " ".join(_md(c) for c in sorted(r.commands))
        scoped = "; ".join(
            " ".join(_md(c) for c in sorted(s.commands))
            + " on "
            + " ".join(f"`{prefix}{p}`" for p in s.patterns)
            for s in r.scoped
        )
        rows.append(f"| {r.name} | {anywhere} | {scoped or '—'} |")
    return "\n".join(rows) + "\n"


def _md(command: str) -> str:
    return "`" + command.replace("|", "\\|") + "`"  # a bare | would end the table cell
