"""What PD_NATS_URL and PD_REDIS_URL name: one NATS server or a cluster's; one Redis, the
primary a group of Sentinels watches, or a Redis Cluster.

    PD_NATS_URL   nats://user:pass@host:4222[,nats://user:pass@host2:4222,...]
                  one server or several of a cluster: nats-py tries them in turn, learns the
                  cluster's other servers from the one it reaches, and reconnects to any of them
    PD_REDIS_URL  redis://[user:pass@]host:6379[/db]
                  redis+sentinel://[user:pass@]host:26379[,host2:26379,...]/<service>[/db][?sentinel_password=...]
                  the primary the Sentinels name for <service>; the user and password are the
                  primary's (and its replicas': an ACL user, or the default user with no
                  name), sentinel_password the Sentinels' own when they ask for one. After a
                  failover, a connection that breaks or reaches a replica asks the Sentinels
                  again (redis-py's Sentinel support)
                  redis+cluster://[user:pass@]host:6379[,host2:6379,...]
                  a Redis Cluster: any of its nodes (the client learns the rest, and follows
                  slots that move); every script's keys share a hash tag (pdserve/shared/state/keys.py).
                  The prefix index is kept in router memory there (PD_PREFIX_INDEX=events)

A malformed URL is a ValueError naming what is wrong, raised when the service starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.cluster import ClusterNode
from redis.sentinel import Sentinel

from pdserve.shared.grants import inbox

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
CLUSTER_CONNECTIONS = 1024  # per node: redis-py's cluster client fails a call past its limit instead of waiting
TIMEOUTS = {"socket_timeout": 5, "socket_connect_timeout": 5}


def nats_servers(url: str) -> list[str]:
    """The servers of a PD_NATS_URL: one, or several separated by commas."""
    servers = [s.strip() for s in url.split(",") if s.strip()]
    if not servers:
        raise ValueError("PD_NATS_URL names no server")
    for server in servers:
        if urlsplit(server).scheme not in ("nats", "tls"):
            raise ValueError(f"PD_NATS_URL: {redacted(server)!r} is not a nats:// or tls:// URL")
    return servers


def redacted(url: str) -> str:
    """`url` without its credentials, to name it in an error or a log."""
    scheme, sep, rest = url.rpartition("://")
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else url


def nats_inbox(url: str) -> str:
    """Where a client of PD_NATS_URL gets its replies: under its user's name (the only inboxes
    that user's grant reads, pdserve/shared/grants.py), or nats-py's default with no user."""
    parts = urlsplit(nats_servers(url)[0])
    return inbox(unquote(parts.username)) if parts.username and parts.password else "_INBOX"


@dataclass(frozen=True)
class SentinelTarget:
    """A redis+sentinel:// URL, parsed."""
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    password: str | None = None
    sentinel_password: str | None = None
    username: str | None = None


def _hosts(netloc: str, what: str) -> list[tuple[str, int]]:
    """The host:port list of a URL's netloc (after its credentials); `what` names one in errors."""
    hosts = []
    for host in filter(None, netloc.rpartition("@")[2].split(",")):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"PD_REDIS_URL: {what} {host!r} is not host:port")
        hosts.append((name, int(port)))
    if not hosts:
        raise ValueError(f"PD_REDIS_URL names no {what}")
    return hosts


def sentinel_target(url: str) -> SentinelTarget | None:
    """The Sentinels, service and credentials of a redis+sentinel:// URL; None for another scheme."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    sentinels = _hosts(parts.netloc, "Sentinel")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("PD_REDIS_URL: a redis+sentinel:// URL ends in /<service> or /<service>/<db>")
    query, user = parse_qs(parts.query), unquote(parts.username) if parts.username else None
    return SentinelTarget(sentinels, path[0], int(path[1]) if len(path) == 2 else 0,
                          unquote(parts.password) if parts.password else None,
                          query.get("sentinel_password", [None])[0], user)


@dataclass(frozen=True)
class ClusterTarget:
    """A redis+cluster:// URL, parsed."""
    nodes: list[tuple[str, int]]
    password: str | None = None
    username: str | None = None


def cluster_target(url: str) -> ClusterTarget | None:
    """The nodes and credentials of a redis+cluster:// URL; None for another scheme."""
    parts = urlsplit(url)
    if parts.scheme != CLUSTER_SCHEME:
        return None
    nodes = _hosts(parts.netloc, "cluster node")
    if parts.path.strip("/"):
        raise ValueError("PD_REDIS_URL: a Redis Cluster has one database: a redis+cluster:// URL has no /<db>")
    return ClusterTarget(nodes, unquote(parts.password) if parts.password else None,
                         unquote(parts.username) if parts.username else None)


class _SentinelBlockingPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """The Sentinels' primary, with a blocking pool's waiting: a burst of calls waits for a
    connection instead of failing."""


def async_redis(url: str, max_connections: int) -> aioredis.Redis | AsyncRedisCluster:
    """An asyncio client of PD_REDIS_URL: a blocking pool of at most `max_connections` (a cluster's:
    CLUSTER_CONNECTIONS per node)."""
    cluster = cluster_target(url)
    if cluster is not None:
        return AsyncRedisCluster(startup_nodes=[AsyncClusterNode(h, p) for h, p in cluster.nodes],
                                 username=cluster.username, password=cluster.password,
                                 max_connections=CLUSTER_CONNECTIONS, **TIMEOUTS)
    target = sentinel_target(url)
    if target is None:
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=5, **TIMEOUTS)
        return aioredis.Redis(connection_pool=pool)
    sentinels = AsyncSentinel(target.sentinels, sentinel_kwargs={"password": target.sentinel_password, **TIMEOUTS})
    return sentinels.master_for(target.service, connection_pool_class=_SentinelBlockingPool,
                                max_connections=max_connections, timeout=5, db=target.db,
                                username=target.username, password=target.password, **TIMEOUTS)


def sync_redis(url: str) -> redis.Redis | redis.RedisCluster:
    """A blocking client of PD_REDIS_URL (operator tools, benchmarks, tests)."""
    cluster = cluster_target(url)
    if cluster is not None:
        return redis.RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.nodes],
                                  username=cluster.username, password=cluster.password, **TIMEOUTS)
    target = sentinel_target(url)
    if target is None:
        return redis.Redis.from_url(url, **TIMEOUTS)
    sentinels = Sentinel(target.sentinels, sentinel_kwargs={"password": target.sentinel_password, **TIMEOUTS})
    return sentinels.master_for(target.service, db=target.db, username=target.username, password=target.password,
                                **TIMEOUTS)
