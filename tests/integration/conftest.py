"""Real servers for the tests that talk to them: redis-server and nats-server (JetStream),
from the pip-installed binaries, on free ports, one per test module. A module whose store must
work on a Redis Cluster too overrides `redis_url` with `redis_or_cluster_url`: its tests run on
one redis-server, then on a cluster of three primaries (pdserve/local/redis_cluster.py: one for the
run, emptied for each module)."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
from pathlib import Path

import pytest
import redis

from pdserve.local import ha, redis_cluster
from pdserve.local.identities import Identities
from pdserve.local.servers import binary, ended, free_port, running, valkey_server, wait_for_port
from pdserve.shared import grants, streams
from pdserve.shared.bus import Bus


@pytest.fixture(scope="module")
def redis_url(redis_server_url):
    return redis_server_url


@pytest.fixture(scope="module")
def redis_server_url():
    port = free_port()
    with tempfile.TemporaryDirectory() as d, running([valkey_server(), "--port", str(port), "--bind", "127.0.0.1",
                                                      "--save", "", "--appendonly", "no", "--dir", d],
                                                     stdout=subprocess.DEVNULL) as proc:
        wait_for_port(port, proc=proc)
        yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture(scope="session")
def redis_cluster_nodes():
    """One cluster of three primaries for the whole run (its start is ~2 s of CPU)."""
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str]) -> subprocess.Popen:
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
        return procs[-1]

    with tempfile.TemporaryDirectory() as d:
        try:
            yield redis_cluster.start(Path(d), 3, spawn)
        finally:
            for proc in procs:
                ended(proc)


@pytest.fixture(scope="module")
def redis_cluster_url(redis_cluster_nodes):
    """The cluster, emptied for each module as a fresh one would be."""
    for node in redis_cluster_nodes.removeprefix("redis+cluster://").split(","):
        host, port = node.rsplit(":", 1)
        with redis.Redis(host=host, port=int(port)) as primary:
            primary.flushall()
    return redis_cluster_nodes


@pytest.fixture(scope="module", params=["one", "cluster"])
def redis_or_cluster_url(request):
    return request.getfixturevalue("redis_cluster_url" if request.param == "cluster" else "redis_server_url")


@pytest.fixture(scope="module")
def nats_url():
    port = free_port()
    with tempfile.TemporaryDirectory() as d, running([binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port),
                                                      "-sd", d], stdout=subprocess.DEVNULL,
                                                     stderr=subprocess.DEVNULL) as proc:
        wait_for_port(port, proc=proc)
        url = f"nats://127.0.0.1:{port}"
        asyncio.run(_streams(url))
        yield url


async def _streams(url: str) -> None:
    """The streams, made as the operator's keeper makes them (pdserve/shared/streams.py)."""
    bus = await Bus.connect(url, "operator")
    await streams.ensure(bus.js)
    await bus.close()


@pytest.fixture
def ha_servers():
    """A fresh 3-node NATS cluster and a Redis primary + replica under 3 Sentinels
    (pdserve/local/ha.py): (ports, password, processes by name)."""
    ports, secret = ha.Ports(), "ha-test-password"
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, argv: list[str]) -> None:
        procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    with tempfile.TemporaryDirectory() as d:
        try:
            ids = Identities.made({})
            ids.nats[grants.OPERATOR] = grants.User(grants.OPERATOR, grants.OPERATOR, secret)   # (the tests' user)
            ha.start(Path(d), ports, secret, ids, spawn, secret)
            yield ports, secret, procs
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait()
