"""A submit that a replica acknowledged (a producer with `wait_replicas`, for failover).

WAIT counts the replicas that hold a connection's own writes, so it has to follow the
submit script on the same connection: a pipeline of the two on one server, on a cluster
the two on one connection of the primary serving the job's slot. The script goes as
EVAL (a node's script cache may not hold it yet; one call, no NOSCRIPT round trip). Too
few replicas in time raise `NotReplicated`: the job is queued on the primary, and a
resubmit of the same id waits again without queuing it twice.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from tokenfleet.connect import initialized
from tokenfleet.errors import NotReplicated
from tokenfleet.lua import SUBMIT_LUA
from tokenfleet.lua.layout import ScriptArg


def _commands(
    keys: list[str], args: list[ScriptArg], wait: tuple[int, int]
) -> list[tuple[Any, ...]]:
    return [("EVAL", SUBMIT_LUA, len(keys), *keys, *args), ("WAIT", *wait)]


def _checked(reply: Any, acked: Any, args: list[ScriptArg], wait: tuple[int, int]) -> Any:
    if int(acked) < wait[0]:
        job_id = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
        raise NotReplicated(job_id, int(acked), wait[0], wait[1])
    return reply


def submit_waiting(
    client: redis.Redis | RedisCluster,
    keys: list[str],
    args: list[ScriptArg],
    wait: tuple[int, int],
) -> Any:
    """submit.lua's reply, once `wait[0]` replicas hold it (else NotReplicated)."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(keys[0])
        pipe = node.redis_connection.pipeline(transaction=False)
    else:
        pipe = client.pipeline(transaction=False)
    for command in _commands(keys, args, wait):
        pipe.execute_command(*command)
    reply, acked = pipe.execute()
    return _checked(reply, acked, args, wait)


async def submit_waiting_async(
    client: aredis.Redis | AsyncRedisCluster,
    keys: list[str],
    args: list[ScriptArg],
    wait: tuple[int, int],
) -> Any:
    """`submit_waiting` on redis.asyncio."""
    if not isinstance(client, AsyncRedisCluster):
        pipe = client.pipeline(transaction=False)
        for command in _commands(keys, args, wait):
            pipe.execute_command(*command)
        reply, acked = await pipe.execute()
        return _checked(reply, acked, args, wait)
    await initialized(client)
    node = client.get_node_from_key(keys[0])
    conn = node.acquire_connection()
    try:
        await conn.send_packed_command(conn.pack_commands(_commands(keys, args, wait)))
        reply = await conn.read_response()
        acked = await conn.read_response()
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        node.release(conn)
    return _checked(reply, acked, args, wait)
