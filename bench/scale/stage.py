"""The processes under test for one (W, B) of `make bench-scale`, on free ports: nats-server
(JetStream, with its monitoring port for message counts), redis-server (or a Redis Cluster) and the router
replicas, started as pdserve/local/stack.py starts them and exporting spans to the run's OTLP
receiver; the simulated fleet (bench/scale/fleet.py) in its own process; this process's clients
(the gateway's NATS connection, the store, a connection of its own to each Redis server for
INFO and SLOWLOG) and its counters (bench/scale/meters.py).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from bench.scale.fleet_process import FleetProcess
from bench.scale.meters import Meters, cpu_s
from bench.scale.plan import FleetWorker
from pdserve.local.servers import binary, free_port, wait_for_port
from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.bus import Bus
from pdserve.shared.state import State
from pdserve.shared.tools.otlp_sink import OtlpReceiver
from pdserve.shared.urls import TIMEOUTS


class Backend:
    """nats-server (JetStream, monitoring port), redis-server (or a Redis Cluster of `cluster`
    primaries) and router replicas on free ports with this run's password, started as
    pdserve/local/stack.py starts them."""

    def __init__(self, log_dir: Path, otlp_url: str, cluster: int = 0):
        self.stack = Stack(StackConfig.on_free_ports(log_dir=log_dir, redis_cluster=cluster, env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_url, "OTEL_BSP_MAX_QUEUE_SIZE": "100000"}))
        self.monitor_port = free_port()
        self.monitor_url = f"http://127.0.0.1:{self.monitor_port}"

    def start(self) -> None:
        s, c = self.stack, self.stack.cfg
        (s.data / "nats.conf").write_text(s.ids.nats_config(s.data / "nats"))
        s.spawn("nats", [binary("nats-server"), "-c", str(s.data / "nats.conf"), "-a", "127.0.0.1",
                         "-p", str(c.nats_port), "-m", str(self.monitor_port)])
        # commands over 1 ms are logged: what holds the single-threaded Redis up, per run
        s.start_redis("slowlog-log-slower-than 1000\nslowlog-max-len 4096\n")
        wait_for_port(c.nats_port, 20, s.procs["nats"], logs=s.log_dir)
        # the operator's keeper, as the local stack's
        s.spawn("streams", [sys.executable, "-m", "pdserve.shared.streams"],
                {**s.service_env(), "PD_NATS_URL": s.nats_url})
        self.add_router("router")

    def add_router(self, name: str) -> None:
        self.stack.service(name, "pdserve.services.router.main")

    def routers(self) -> list[str]:
        return [n for n in self.stack.procs if n.startswith("router")]

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.stack.procs.items() if p.poll() is None}

    def servers(self) -> list[aioredis.Redis]:
        """A client of each Redis server (a cluster's primaries), for INFO and SLOWLOG."""
        s = self.stack
        return [aioredis.Redis(port=p, password=s.secret, **TIMEOUTS) for p in s.redis_ports]


def store_name(cluster: int) -> str:
    """A run's store: `redis` (one redis-server) or `cluster<N>` (a Redis Cluster of N primaries)."""
    return f"cluster{cluster}" if cluster else "redis"


class Stage:
    """One (W, B): the backend, the fleet, and this process's clients (the gateway's NATS
    connection; the store, for the registry; `servers`, each Redis server's, for INFO and SLOWLOG)."""

    def __init__(self, backend: Backend, fleet: FleetProcess, bus: Bus, state: State, servers: list[aioredis.Redis]):
        self.backend, self.fleet, self.bus, self.state, self.servers = backend, fleet, bus, state, servers
        self.meters = Meters(self.pids, backend.monitor_url, servers)
        self.store = store_name(backend.stack.cfg.redis_cluster)
        self.memory_before = 0   # what Redis held before the fleet started

    def pids(self) -> dict[str, int]:
        return {**self.backend.pids(), "fleet": self.fleet.pid, "bench": os.getpid()}

    async def registered(self, want: int, timeout_s: float = 60) -> None:
        """Until the registry holds `want` entries (workers and routers)."""
        deadline = time.monotonic() + timeout_s
        while len(await self.state.registry.workers()) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"registry short of {want} entries; logs in {self.backend.stack.log_dir}")
            await asyncio.sleep(0.2)

    async def routers(self, replicas: int, workers: int) -> None:
        """Start router replicas up to `replicas`; return once they are registered."""
        for i in range(len(self.backend.routers()), replicas):
            self.backend.add_router(f"router-{i}")
        await self.registered(workers + replicas)
        await self.synced(workers)

    async def synced(self, workers: int, timeout_s: float = 300) -> None:
        """Until every router's prefix index follows the `workers` workers' feeds with no snapshot
        awaited (its metrics: pd_prefix_index_feeds; PD_PREFIX_INDEX=redis: at once)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5) as http:
            for name in self.backend.routers():
                while True:
                    text = (await http.get(self.backend.stack.metrics_url(name))).text
                    feeds = dict(re.findall(r'^pd_prefix_index_feeds\{state="(\w+)"\} (\S+)$', text, re.M))
                    if not feeds or (float(feeds.get("following", 0)) >= workers
                                     and float(feeds.get("awaiting_snapshot", 0)) == 0):
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name}'s prefix index not in sync: {feeds}")
                    await asyncio.sleep(0.5)

    async def quiet(self, timeout_s: float = 60) -> None:
        """Until the routers have worked off what they still hold (under 10% of a core)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = [p for n, p in self.backend.pids().items() if n.startswith("router")]
            before = sum(cpu_s(p) for p in pids)
            await asyncio.sleep(0.5)
            if sum(cpu_s(p) for p in pids) - before < 0.05:
                return


@asynccontextmanager
async def stage(plan: list[FleetWorker], receiver: OtlpReceiver, log_dir: Path, cluster: int = 0):
    async with AsyncExitStack() as stack:
        backend = Backend(log_dir, receiver.url, cluster)
        stack.callback(backend.stack.stop)
        backend.start()
        bus = await Bus.connect(backend.stack.nats_url, "scale-gateway")
        stack.push_async_callback(bus.close)
        state = State.connect(backend.stack.redis_url)
        stack.push_async_callback(state.close)
        servers = backend.servers()
        for server in servers:
            stack.push_async_callback(server.aclose)
        fleet = FleetProcess(log_dir / "fleet.log")
        stack.push_async_callback(fleet.stop)
        st = Stage(backend, fleet, bus, state, servers)
        await st.registered(1)
        st.memory_before = (await st.meters.read()).redis_memory
        await fleet.start(plan, backend.stack.service_env())
        await st.registered(len(plan) + 1)
        yield st
