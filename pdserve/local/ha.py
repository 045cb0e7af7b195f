"""The bus and the store as a fleet runs them, on one machine: a 3-node NATS cluster (JetStream
on every node, the prefill job stream with 3 replicas) and a Redis primary with a replica,
watched by 3 Sentinels that promote the replica when the primary is gone. The same
nats-server and valkey-server binaries as the single-server stack (valkey-server runs as a
Sentinel with --sentinel). Used by `make run RUN_ARGS=--ha`, the HA tests and `make chaos`'s HA stack.

Every server takes the stack's password (NATS routes, Redis's default user, replication)
from config files in the stack's private data directory (the clients a password per instance on
NATS and per role on Redis, pdserve/local/identities.py; the Sentinels one of their own); each has
a store directory of its own. The clients are given every node (PD_NATS_URL, comma-separated) and the Sentinels
(PD_REDIS_URL, redis+sentinel://), and find the rest themselves (pdserve/shared/urls.py).

Process names: nats-0..2, redis (the primary at start), redis-replica, sentinel-0..2.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from pdserve.local.identities import Identities
from pdserve.local.servers import STORE_ARGS, binary, free_port, valkey_server, wait_for_port

NODES = 3
SENTINELS = 3
SERVICE = "pdserve"             # the Sentinels' name for the primary
DOWN_AFTER_MS = 1000            # a primary silent this long is down (for a Sentinel; a quorum of 2 agrees)
FAILOVER_TIMEOUT_MS = 5000


@dataclass
class Ports:
    nats: list[int] = field(default_factory=lambda: [free_port() for _ in range(NODES)])
    routes: list[int] = field(default_factory=lambda: [free_port() for _ in range(NODES)])
    monitor: list[int] = field(default_factory=lambda: [free_port() for _ in range(NODES)])
    redis: list[int] = field(default_factory=lambda: [free_port() for _ in range(2)])   # primary, replica
    sentinels: list[int] = field(default_factory=lambda: [free_port() for _ in range(SENTINELS)])

    @classmethod
    def from_first(cls, nats: int, redis: int) -> Ports:
        """The first NATS node and the Redis primary on these ports, the rest on free ones."""
        ports = cls()
        ports.nats[0], ports.redis[0] = nats, redis
        return ports


def nats_url(ports: Ports, user: str, password: str, scheme: str = "nats") -> str:
    return ",".join(f"{scheme}://{user}:{password}@127.0.0.1:{p}" for p in ports.nats)


def redis_url(ports: Ports, user: str, password: str, sentinel_password: str) -> str:
    """The primary through the Sentinels, as `user` (\"\": Redis's default user)."""
    sentinels = ",".join(f"127.0.0.1:{p}" for p in ports.sentinels)
    return f"redis+sentinel://{user}:{password}@{sentinels}/{SERVICE}/0?sentinel_password={sentinel_password}"


def nats_node(data: Path, ports: Ports, secret: str, ids: Identities, i: int) -> list[str]:
    """Node i of the cluster: its config file written, its command line returned. `ids`: the
    clients' users (each instance's grant: pdserve/shared/grants.py) and the store's key."""
    routes = ", ".join(f'"nats-route://route:{secret}@127.0.0.1:{p}"' for j, p in enumerate(ports.routes) if j != i)
    conf = data / f"nats-{i}.conf"
    conf.write_text(f'server_name: "nats-{i}"\nlisten: "127.0.0.1:{ports.nats[i]}"\n'
                    f'http: "127.0.0.1:{ports.monitor[i]}"\n'
                    f'{ids.nats_config(data / f"nats-{i}")}'
                    f'cluster {{\n  name: "pdserve"\n  listen: "127.0.0.1:{ports.routes[i]}"\n'
                    f'  authorization {{ user: route, password: "{secret}" }}\n'
                    # clients are given every node: the cluster need not tell them of the others
                    f'  no_advertise: true\n  routes: [{routes}]\n}}\n')
    return [binary("nats-server"), "-c", str(conf)]


def redis_node(data: Path, ports: Ports, secret: str, ids: Identities, i: int) -> list[str]:
    """The primary (0) or the replica (1): no persistence, full syncs over the socket; the
    default user's password `secret`, each instance an ACL user (pdserve/shared/grants.py)."""
    store = data / ("redis" if i == 0 else "redis-replica")
    store.mkdir(exist_ok=True)
    conf = store / "redis.conf"
    conf.write_text(f"requirepass {secret}\nmasterauth {secret}\n{ids.redis_users()}")
    argv = [valkey_server(), str(conf), "--port", str(ports.redis[i]), "--bind", "127.0.0.1",
            *STORE_ARGS, "--dir", str(store),
            "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
    return argv + (["--replicaof", "127.0.0.1", str(ports.redis[0])] if i else [])


def sentinel(data: Path, ports: Ports, secret: str, sentinel_secret: str, i: int) -> list[str]:
    """Sentinel i (it rewrites its config file as it learns the replicas and the others): its
    clients' password `sentinel_secret`, the primary's `secret`."""
    conf = data / f"sentinel-{i}.conf"
    conf.write_text(f"port {ports.sentinels[i]}\nbind 127.0.0.1\ndir {data}\nrequirepass {sentinel_secret}\n"
                    f"sentinel monitor {SERVICE} 127.0.0.1 {ports.redis[0]} 2\n"
                    f"sentinel auth-pass {SERVICE} {secret}\nsentinel sentinel-pass {sentinel_secret}\n"
                    f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                    f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n")
    return [valkey_server(), str(conf), "--sentinel"]


def write_users(data: Path, ports: Ports, secret: str, ids: Identities) -> None:
    """Every NATS and Redis node's config written again (one more user: the caller reloads the
    NATS nodes and gives the Redis nodes the user)."""
    for i in range(NODES):
        nats_node(data, ports, secret, ids, i)
    for i in range(2):
        redis_node(data, ports, secret, ids, i)


def servers(data: Path, ports: Ports, secret: str, ids: Identities,
            sentinel_secret: str) -> dict[str, list[str]]:
    """Every server's command line by process name, in the order to start them."""
    return {**{f"nats-{i}": nats_node(data, ports, secret, ids, i) for i in range(NODES)},
            **{name: redis_node(data, ports, secret, ids, i)
               for i, name in enumerate(("redis", "redis-replica"))},
            **{f"sentinel-{i}": sentinel(data, ports, secret, sentinel_secret, i) for i in range(SENTINELS)}}


def start(data: Path, ports: Ports, secret: str, ids: Identities,
          spawn: Callable[[str, list[str]], object], sentinel_secret: str, timeout_s: float = 30) -> None:
    """Start every server with `spawn(name, argv)` and wait until the set is whole. The
    Sentinels start once the replica has synced, and it is whole when each knows the replica
    and the other two: a Sentinel learns a primary's replicas from its INFO, asked every 10 s,
    so one started beside the replica could see none, and a primary lost then is never failed
    over (no replica to promote, its INFO never asked again)."""
    commands = servers(data, ports, secret, ids, sentinel_secret)
    for name, argv in commands.items():
        if not name.startswith("sentinel"):
            spawn(name, argv)
    for port in ports.nats + ports.redis:
        wait_for_port(port, timeout_s)
    deadline = time.monotonic() + timeout_s
    replica = redis.Redis(port=ports.redis[1], password=secret, socket_timeout=2)
    until(deadline, lambda: replica.info("replication")["master_link_status"] == "up", "the replica's sync")
    for name, argv in commands.items():
        if name.startswith("sentinel"):
            spawn(name, argv)
    for port in ports.sentinels:
        wait_for_port(port, timeout_s)
    sentinels = [redis.Redis(port=p, password=sentinel_secret, socket_timeout=2) for p in ports.sentinels]

    def whole() -> bool:
        views = [s.sentinel_master(SERVICE) for s in sentinels]
        return all(v["num-slaves"] >= 1 and v["num-other-sentinels"] >= SENTINELS - 1 for v in views)
    until(deadline, whole, "the Sentinels' view of the replica and of each other")


def until(deadline: float, done: Callable[[], bool], what: str) -> None:
    while True:
        with contextlib.suppress(redis.RedisError, KeyError):
            if done():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"HA servers: no {what} in time")
        time.sleep(0.1)


def is_server(name: str) -> bool:
    """A process of the bus or the store (started first, stopped last)."""
    return name.startswith(("nats", "redis", "sentinel"))
