"""Every entry point opens the fleet's Redis here, from one URL: a single server or a
Redis Cluster.

    redis://[[user]:password@]host[:port][/db][?option=value...]     one server
    rediss://...                                                     one server over TLS
    unix://[[user]:password@]/path/to/socket[?db=N...]               one server, a socket
    redis+cluster://[[user]:password@]h1[:p1][,h2[:p2]...][/0][?...]  a Redis Cluster
    rediss+cluster://...                                             a cluster over TLS

A plain URL goes to redis-py's `from_url` unchanged. A cluster URL names startup nodes
(any one reachable node is enough; the client learns the rest from it, and a port
defaults to 6379); its user, password and query options (`ssl_ca_certs`,
`socket_timeout`, ...) are read exactly as redis-py reads them on a plain URL, and apply
to every node. A cluster has only db 0. Anything else is `InvalidRedisUrl`. As with
`from_url`, an option in the URL wins over the same keyword argument.

The sync cluster client connects and reads the slot map when it is built: a cluster none
of whose startup nodes answers raises `redis.ConnectionError` here, as a plain client's
first command would. The asyncio cluster client connects on its first command; sharded
pub/sub (`pubsub().ssubscribe`) fails on one that never ran a command (redis-py#4296),
so await `initialized(client)` before subscribing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias
from urllib.parse import urlsplit

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException

from tokenfleet.errors import InvalidRedisUrl

__all__ = [
    "AsyncClient",
    "Client",
    "ClusterUrl",
    "connect",
    "connect_async",
    "connect_async_pooled",
    "initialized",
    "is_cluster_url",
    "parse_cluster_url",
]

Client: TypeAlias = redis.Redis | RedisCluster
AsyncClient: TypeAlias = aredis.Redis | AsyncRedisCluster

PLAIN_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}  # -> a node's scheme
DEFAULT_PORT = 6379
SCHEMES_HELP = "redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://"


@dataclass(frozen=True)
class ClusterUrl:
    """A parsed cluster URL: its startup nodes, TLS or not, and the options every node's
    connections get (`username`, `password` and the query's options, as redis-py parses
    them on a plain URL)."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    options: dict[str, Any] = field(default_factory=dict, repr=False)  # may hold a password
    # the first node as a plain redis:// (rediss://) URL, same credentials and options:
    # for a connection to one node (pub/sub)
    first_node_url: str = field(default="", repr=False)

    def client_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        """Keyword arguments of a cluster client: `kwargs`, the URL's options on top."""
        return {**kwargs, **self.options, **({"ssl": True} if self.tls else {})}


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def is_cluster_url(url: str) -> bool:
    """Whether `url` selects cluster mode (`redis+cluster://` or `rediss+cluster://`)."""
    return _scheme(url) in CLUSTER_SCHEMES


def _host_port(part: str) -> tuple[str, int]:
    """`h`, `h:p`, `[v6]` or `[v6]:p` -> (host, port)."""
    if part.startswith("["):
        host, bracket, rest = part[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise InvalidRedisUrl(f"cluster URL: malformed host {part!r}")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = part.partition(":")
    if not host:
        raise InvalidRedisUrl(f"cluster URL: a node with no host in {part!r}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidRedisUrl(f"cluster URL: bad port {port_text!r} of host {host!r}")
    return host, int(port_text)


def parse_cluster_url(url: str) -> ClusterUrl:
    """Startup nodes, TLS and options of a cluster URL (InvalidRedisUrl if malformed)."""
    scheme = _scheme(url)
    if scheme not in CLUSTER_SCHEMES:
        raise InvalidRedisUrl("not a cluster URL (redis+cluster:// or rediss+cluster://)")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # unbalanced [ ] of an IPv6 host
        raise InvalidRedisUrl(f"cluster URL: malformed host list ({exc})") from None
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    nodes = tuple(_host_port(part.strip()) for part in hostlist.split(",") if part.strip())
    if not nodes:
        raise InvalidRedisUrl("cluster URL: no host:port to start from")
    if parts.path.strip("/") not in ("", "0"):
        raise InvalidRedisUrl(
            f"cluster URL: db {parts.path.strip('/')!r}: a Redis Cluster has only db 0"
        )
    # redis-py reads the credentials and the query of a plain URL of the first node
    host, port = nodes[0]
    netloc = f"{userinfo}{at}{f'[{host}]' if ':' in host else host}:{port}"
    query = f"?{parts.query}" if parts.query else ""
    node_url = f"{CLUSTER_SCHEMES[scheme]}://{netloc}/0{query}"
    try:
        options = parse_url(node_url)
    except ValueError as exc:
        raise InvalidRedisUrl(f"cluster URL: {exc}") from None
    if options.pop("db", 0) != 0:
        raise InvalidRedisUrl("cluster URL: ?db= other than 0: a Redis Cluster has only db 0")
    for key in ("host", "port", "connection_class"):
        options.pop(key, None)
    tls = scheme == "rediss+cluster"
    return ClusterUrl(nodes, tls=tls, options=options, first_node_url=node_url)


def _check_plain(url: str) -> None:
    if _scheme(url) not in PLAIN_SCHEMES:
        raise InvalidRedisUrl(f"a Redis URL starts with {SCHEMES_HELP}")


def connect(url: str, **kwargs: Any) -> Client:
    """A sync client for `url`: `redis.Redis`, or `redis.cluster.RedisCluster` for a
    cluster URL (module docstring). `kwargs` go to the client, under the URL's options."""
    if not is_cluster_url(url):
        _check_plain(url)
        return redis.Redis.from_url(url, **kwargs)
    parsed = parse_cluster_url(url)
    startup = [ClusterNode(host, port) for host, port in parsed.nodes]
    try:
        return RedisCluster(startup_nodes=startup, **parsed.client_kwargs(**kwargs))
    except RedisClusterException as exc:
        # raised while reading the slot map: no node answered, or the slots are not all
        # served yet (a cluster still forming); callers retry on ConnectionError
        hosts = ", ".join(f"{h}:{p}" for h, p in parsed.nodes)
        raise redis.ConnectionError(f"Redis Cluster at {hosts}: {exc}") from exc


def connect_async(url: str, **kwargs: Any) -> AsyncClient:
    """An asyncio client for `url`: `redis.asyncio.Redis`, or
    `redis.asyncio.cluster.RedisCluster` for a cluster URL. Neither connects before its
    first command; await `initialized(client)` before sharded pub/sub."""
    if not is_cluster_url(url):
        _check_plain(url)
        return aredis.Redis.from_url(url, **kwargs)
    parsed = parse_cluster_url(url)
    startup = [AsyncClusterNode(host, port) for host, port in parsed.nodes]
    return AsyncRedisCluster(startup_nodes=startup, **parsed.client_kwargs(**kwargs))


def connect_async_pooled(
    url: str, *, max_connections: int, timeout: float, **kwargs: Any
) -> tuple[AsyncClient, aredis.ConnectionPool]:
    """An asyncio client with at most `max_connections` connections, and the pool to
    open dedicated (pub/sub) connections from; close both.

    On one server the client runs on that pool, a `BlockingConnectionPool`: a command
    waits up to `timeout` s for a free connection. On a cluster the cap is per node, and
    redis-py's cluster client does not wait for a connection: a node's pool full raises
    `MaxConnectionsError` (a `ConnectionError`) at once. Its pool is one on the first
    startup node, whose subscribers hear every plain PUBLISH (a cluster forwards it to
    every node)."""
    if not is_cluster_url(url):
        _check_plain(url)
        pool = aredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **kwargs
        )
        return aredis.Redis(connection_pool=pool), pool
    parsed = parse_cluster_url(url)
    startup = [AsyncClusterNode(host, port) for host, port in parsed.nodes]
    client = AsyncRedisCluster(
        startup_nodes=startup,
        **parsed.client_kwargs(max_connections=max_connections, **kwargs),
    )
    pool = aredis.BlockingConnectionPool.from_url(
        parsed.first_node_url, max_connections=max_connections, timeout=timeout, **kwargs
    )
    return client, pool


async def initialized(client: AsyncClient) -> AsyncClient:
    """`client`, connected: a cluster client has read the slot map (sharded pub/sub
    needs it, redis-py#4296); a plain client is returned as it is. A cluster none of
    whose startup nodes answers raises `redis.ConnectionError`."""
    if isinstance(client, AsyncRedisCluster):
        try:
            await client.initialize()
        except RedisClusterException as exc:
            raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc
    return client
