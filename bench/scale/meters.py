"""Counters read around each measurement of `make bench-scale`: CPU seconds per process
(/proc/<pid>/stat), the machine's busy time (/proc/stat), NATS messages (the server's
monitoring port: /varz in total, /connz per client name) and Redis memory (INFO)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK   # utime, stime (fields 14, 15 of the line)


def machine_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the machine so far, all cores."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / TICK, sum(ticks) / TICK


def nats_msgs(monitor_url: str) -> dict[str, int]:
    """Messages into (`in`) and out of (`out`) the server, in all and per client name."""
    def get(path: str) -> dict:
        with urllib.request.urlopen(monitor_url + path, timeout=5) as r:
            return json.loads(r.read())
    varz, out = get("/varz"), {}
    out["in"], out["out"] = varz["in_msgs"], varz["out_msgs"]
    for c in get("/connz?limit=100000")["connections"]:
        name = c.get("name") or "unnamed"
        out[f"{name}.in"] = out.get(f"{name}.in", 0) + c["in_msgs"]
        out[f"{name}.out"] = out.get(f"{name}.out", 0) + c["out_msgs"]
    return out


@dataclass
class Reading:
    t: float
    cpu: dict[str, float]       # process name -> CPU seconds so far
    busy_s: float
    total_s: float
    nats: dict[str, int]
    redis_memory: int           # INFO memory: used_memory less its clients' buffers (mem_clients_normal), all servers


@dataclass
class Usage:
    """What happened between two readings."""
    wall_s: float
    cpu_s: dict[str, float]
    machine_busy: float         # fraction of all cores
    nats: dict[str, int]

    def cpu_pct(self, cores: int) -> dict[str, float]:
        """Per process, % of one core; `machine`: all cores (up to 100 x cores); `other`: the
        machine less these processes (anything else running on it)."""
        out = {k: round(100 * v / self.wall_s, 1) for k, v in self.cpu_s.items()}
        machine = 100 * self.machine_busy * cores
        return {**out, "machine": round(machine, 1), "other": round(max(0.0, machine - sum(out.values())), 1)}

    def net(self, idle: Usage, key: str, table: str = "cpu_s") -> float:
        """This window's amount less what the idle window's rate accounts for."""
        return getattr(self, table).get(key, 0) - getattr(idle, table).get(key, 0) * self.wall_s / idle.wall_s


class Meters:
    def __init__(self, pids: Callable[[], dict[str, int]], nats_monitor_url: str, servers: list[aioredis.Redis]):
        self.pids, self.nats_monitor_url, self.servers = pids, nats_monitor_url, servers

    async def read(self) -> Reading:
        busy, total = machine_s()
        memory = [await server.info("memory") for server in self.servers]
        held = sum(m["used_memory"] - m["mem_clients_normal"] for m in memory)
        return Reading(time.monotonic(), {name: cpu_s(pid) for name, pid in self.pids().items()}, busy, total,
                       nats_msgs(self.nats_monitor_url), held)


def usage(a: Reading, b: Reading) -> Usage:
    return Usage(b.t - a.t, {k: v - a.cpu.get(k, 0.0) for k, v in b.cpu.items()},
                 (b.busy_s - a.busy_s) / max(b.total_s - a.total_s, 1e-9),
                 {k: v - a.nats.get(k, 0) for k, v in b.nats.items()})
