"""Files and batches in Redis, so that any gateway replica can serve or finish them.

Keys (under the fleet's prefix P; built by `Keys`, keys.py):

    P file:ID            hash: the file object (id, bytes, created_at, filename, purpose,
                         and the owning tenant in `tokenfleet_tenant`)
    P file:ID:content    string: the bytes (at most `max_file_bytes`)
    P files              zset: file ids by creation time
    P files:by-tenant:T  zset: tenant T's file ids by creation time
    P batch:ID           hash: `doc` (the batch object, JSON, with the driver's own
                         `tokenfleet_*` fields: the creator's tenant, lines submitted),
                         `cancel` (a cancel request)
    P batch:ID:results   hash: line index -> its output or error line (JSON), as lines end
    P batch:ID:lease     string: the gateway driving the batch (lua/lease.lua; renewed)
    P batches            zset: batch ids by creation time
    P batches:by-tenant:T  zset: tenant T's batch ids by creation time
    P batches:open       set: the batches not finished yet (what drivers look at)

Files and batches belong to a tenant (the API key's that made them; a batch's output
and error files, to the batch's): a caller of another tenant is told they do not exist
(`NotFound`), and lists hold only the caller's. Methods take `tenant=None` where the
driver acts for every tenant.

On a Redis Cluster these keys keep their names (no hash tag: they hash to slots all
over the cluster, so the files' bytes spread over the masters), and a transaction holds
keys of one slot only. So each write below is one MULTI ... EXEC on a single Redis, and
on a cluster the same commands one after another, in an order that leaves nothing a
reader trips on when it is cut short: an object before the lists that name it and a
batch in `batches:open` last (lists skip ids whose object is gone); a file's object
deleted before its bytes and its list entries; a finished batch's object saved before
it leaves `batches:open` (a driver that finds a finished batch still there takes it
out, `BatchDriver`). Many jobs' results are read per slot (`get_many`).

Why Redis and not a shared directory: the fleet already depends on Redis being there
and persistent, every replica reaches it, and nothing else has to be mounted into
gateway containers. The price is memory, hence the size limit per file
(`GatewayConfig.max_file_bytes`, 32 MiB by default): a bigger job list is several
batches, or `tokenfleet batch run` from the shell, which streams from disk.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from tokenfleet.keys import DEFAULT_TENANT, Keys
from tokenfleet.lua import LEASE_LUA
from tokenfleet.lua.calls import LeaseCall

LEASE_MS = 15_000  # a driver that stops renewing loses its batches after this long

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


TENANT_FIELD = "tokenfleet_tenant"  # in a file's or batch's doc: the tenant owning it


def tenant_of(doc: dict[str, Any]) -> str:
    """The tenant owning a file or batch, whose jobs a batch's lines become (`default`
    for objects made before tenants)."""
    return str(doc.get(TENANT_FIELD) or DEFAULT_TENANT)


def _owned(doc: dict[str, Any], tenant: str | None, what: str) -> dict[str, Any]:
    if tenant is not None and tenant_of(doc) != tenant:
        raise NotFound(f"no {what} {doc['id']!r}")  # another tenant's: not for this caller
    return doc


class FileTooLarge(ValueError):
    pass


class NotFound(KeyError):
    pass


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(12)}"


Command = tuple[Any, ...]  # a command's name and arguments, as `execute_command` takes them


async def get_many(client: aredis.Redis | AsyncRedisCluster, keys: list[str]) -> list[Any]:
    """GET of each of `keys`, in order: one MGET, or on a cluster one per slot (MGET
    refuses keys of several slots there)."""
    if isinstance(client, AsyncRedisCluster):
        return list(await client.mget_nonatomic(keys))
    return list(await client.mget(keys))


class BatchStore:
    def __init__(
        self,
        client: aredis.Redis | AsyncRedisCluster,
        keys: Keys,
        *,
        max_file_bytes: int,
        lease_ms: int = LEASE_MS,
    ) -> None:
        self.r = client
        self.keys = keys
        self.max_file_bytes = max_file_bytes
        self.lease_ms = lease_ms
        self._lease = client.register_script(LEASE_LUA)

    async def _write(self, *commands: Command) -> list[Any]:
        """`commands` in one MULTI ... EXEC; on a cluster one after another, in the
        order given (module docstring: callers order them to be safe cut short)."""
        if isinstance(self.r, AsyncRedisCluster):
            return [await self.r.execute_command(*command) for command in commands]
        async with self.r.pipeline(transaction=True) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return list(await pipe.execute())

    # ---- files ------------------------------------------------------------------------

    async def put_file(
        self, content: bytes, filename: str, purpose: str, tenant: str = DEFAULT_TENANT
    ) -> dict[str, Any]:
        if len(content) > self.max_file_bytes:
            raise FileTooLarge(
                f"the file has {len(content):,} bytes; this gateway stores at most "
                f"{self.max_file_bytes:,} per file (TOKENFLEET_GATEWAY_MAX_FILE_BYTES)"
            )
        file_id = new_id("file")
        doc = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            TENANT_FIELD: tenant,
        }
        created = time.time()
        await self._write(
            ("SET", self.keys.file_content(file_id), content),
            ("HSET", self.keys.file(file_id), "doc", json.dumps(doc)),
            ("ZADD", self.keys.files(), created, file_id),
            ("ZADD", self.keys.files(tenant), created, file_id),
        )
        return doc

    async def file(self, file_id: str, tenant: str | None = None) -> dict[str, Any]:
        """The file object; NotFound when it does not exist or `tenant` does not own it."""
        raw = await self.r.hget(self.keys.file(file_id), "doc")
        if raw is None:
            raise NotFound(f"no file {file_id!r}")
        return _owned(json.loads(raw), tenant, "file")

    async def content(self, file_id: str, tenant: str | None = None) -> bytes:
        if tenant is not None:
            await self.file(file_id, tenant)
        data = await self.r.get(self.keys.file_content(file_id))
        if data is None:
            raise NotFound(f"no file {file_id!r}")
        return bytes(data)

    async def files(self, tenant: str, limit: int = 100) -> list[dict[str, Any]]:
        """The tenant's files, newest first."""
        ids = await self.r.zrevrange(self.keys.files(tenant), 0, limit - 1)
        docs = []
        for raw_id in ids:
            try:
                docs.append(await self.file(raw_id.decode(), tenant))
            except NotFound:
                continue
        return docs

    async def delete_file(self, file_id: str, tenant: str | None = None) -> bool:
        """Delete the file (False when there is none that `tenant` owns)."""
        try:
            doc = await self.file(file_id, tenant)
        except NotFound:
            return False
        deleted, *_ = await self._write(
            ("DEL", self.keys.file(file_id)),
            ("DEL", self.keys.file_content(file_id)),
            ("ZREM", self.keys.files(), file_id),
            ("ZREM", self.keys.files(tenant_of(doc)), file_id),
        )
        return bool(deleted)

    # ---- batches ----------------------------------------------------------------------

    async def create_batch(self, doc: dict[str, Any], tenant: str = DEFAULT_TENANT) -> None:
        """Store a new batch, its jobs to run for `tenant` (the creating API key's)."""
        doc = {**doc, TENANT_FIELD: tenant}
        batch_id = doc["id"]
        created = time.time()
        await self._write(
            ("HSET", self.keys.batch(batch_id), "doc", json.dumps(doc)),
            ("ZADD", self.keys.batches(), created, batch_id),
            ("ZADD", self.keys.batches(tenant), created, batch_id),
            ("SADD", self.keys.open_batches(), batch_id),  # last: drivers look here
        )

    async def batch(self, batch_id: str, tenant: str | None = None) -> dict[str, Any]:
        """The batch object; NotFound when it does not exist or `tenant` does not own it."""
        raw = await self.r.hget(self.keys.batch(batch_id), "doc")
        if raw is None:
            raise NotFound(f"no batch {batch_id!r}")
        return _owned(json.loads(raw), tenant, "batch")

    async def save_batch(self, doc: dict[str, Any]) -> None:
        """Store the batch object; one that ended leaves the open batches (after it is
        saved: drivers look there)."""
        await self._write(
            ("HSET", self.keys.batch(doc["id"]), "doc", json.dumps(doc)),
            *([("SREM", self.keys.open_batches(), doc["id"])] if doc["status"] in TERMINAL else []),
        )

    async def batches(
        self, tenant: str, limit: int = 20, after: str | None = None
    ) -> list[dict[str, Any]]:
        """The tenant's batches, newest first; `after`: continue below that batch id
        (OpenAI's pagination)."""
        key = self.keys.batches(tenant)
        top = "+inf"
        if after is not None:
            score = await self.r.zscore(key, after)
            if score is None:
                return []
            top = f"({score}"
        ids = await self.r.zrevrangebyscore(key, top, "-inf", start=0, num=limit)
        docs = []
        for raw_id in ids:
            try:
                docs.append(await self.batch(raw_id.decode(), tenant))
            except NotFound:
                continue
        return docs

    async def request_cancel(self, batch_id: str) -> None:
        await self.r.hset(self.keys.batch(batch_id), "cancel", "1")

    async def cancel_requested(self, batch_id: str) -> bool:
        return bool(await self.r.hget(self.keys.batch(batch_id), "cancel"))

    async def open_batch_ids(self) -> list[str]:
        """Batches not in a terminal state (what a driver may pick up)."""
        return sorted(raw.decode() for raw in await self.r.smembers(self.keys.open_batches()))

    # ---- results, as lines end ----------------------------------------------------------

    async def put_results(self, batch_id: str, lines: dict[int, dict[str, Any]]) -> None:
        if lines:
            await self.r.hset(
                self.keys.batch_results(batch_id),
                mapping={str(i): json.dumps(line) for i, line in lines.items()},
            )

    async def results(self, batch_id: str) -> dict[int, dict[str, Any]]:
        raw = await self.r.hgetall(self.keys.batch_results(batch_id))
        return {int(k): json.loads(v) for k, v in raw.items()}

    async def drop_results(self, batch_id: str) -> None:
        await self.r.delete(self.keys.batch_results(batch_id))

    # ---- who drives a batch -----------------------------------------------------------

    async def take_lease(self, batch_id: str, owner: str) -> bool:
        """Take or renew the batch's lease (True while `owner` holds it); one script, so
        a driver paused past its lease never renews the next holder's."""
        call = LeaseCall(
            lease=self.keys.batch_lease(batch_id), owner=owner, ms=self.lease_ms, action="take"
        )
        return LeaseCall.parse(await self._lease(keys=call.keys(), args=call.args()))

    async def release_lease(self, batch_id: str, owner: str) -> None:
        call = LeaseCall(
            lease=self.keys.batch_lease(batch_id), owner=owner, ms=self.lease_ms, action="release"
        )
        await self._lease(keys=call.keys(), args=call.args())


__all__ = [
    "LEASE_MS",
    "TENANT_FIELD",
    "TERMINAL",
    "BatchStore",
    "FileTooLarge",
    "NotFound",
    "get_many",
    "new_id",
    "tenant_of",
]
