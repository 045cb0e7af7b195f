"""Redis keys (prefix `pd:`) and typed accessors.

    pd:worker:<id>   WorkerInfo JSON, expires with the heartbeat lease (a dead worker vanishes)
    pd:req:<id>      hash: the request's phase, workers, timestamps (expires after a day)
    pd:session:<id>  the decode worker of a conversation's last turn (expires when idle)
    pd:route:<id>    hash: a request's placement as it is decided — its decode worker, then the
                     router's reply (router replicas answer a repeated request from it)
    pd:route:<id>:claim  the router placing the request now (expires: a dead router's lapses)
    pd:prefix:<id>   a worker's cached block hashes (shared/prefix_index.py)
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from shared.messages import WorkerInfo

REQUEST_TTL_S = 24 * 3600
MAX_CONNECTIONS = 64  # per process
OVER = ("prefill_local",)  # phases after which a request's prefill job has nothing left to do


def worker_key(worker_id: str) -> str:
    return f"pd:worker:{worker_id}"


def request_key(request_id: str) -> str:
    return f"pd:req:{request_id}"


def session_key(session_id: str) -> str:
    return f"pd:session:{session_id}"


def route_key(request_id: str) -> str:
    return f"pd:route:{request_id}"


class State:
    def __init__(self, r: aioredis.Redis):
        self.r = r

    @classmethod
    def connect(cls, url: str) -> "State":
        # a blocking pool: a burst of concurrent calls waits for a connection instead of failing
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=MAX_CONNECTIONS, timeout=5,
                                                        socket_timeout=5, socket_connect_timeout=5)
        return cls(aioredis.Redis(connection_pool=pool))

    async def close(self) -> None:
        await self.r.aclose()

    # -- worker registry -------------------------------------------------------------------
    async def heartbeat(self, info: WorkerInfo, lease_s: float) -> None:
        await self.r.set(worker_key(info.worker_id), info.encode(), px=int(lease_s * 1000))

    async def deregister(self, worker_id: str) -> None:
        await self.r.delete(worker_key(worker_id))

    async def alive(self, worker_id: str) -> bool:
        """Its lease holds (it heartbeats, draining or not)."""
        return bool(await self.r.exists(worker_key(worker_id)))

    async def workers(self, role: str | None = None) -> list[WorkerInfo]:
        keys = [k async for k in self.r.scan_iter(match=worker_key("*"), count=100)]
        if not keys:
            return []
        infos = [WorkerInfo.decode(v) for v in await self.r.mget(keys) if v is not None]
        return sorted((w for w in infos if role is None or w.role == role), key=lambda w: w.worker_id)

    # -- request state ---------------------------------------------------------------------
    async def record(self, request_id: str, phase: str, **fields: str | int) -> None:
        """Move a request to `phase`, stamping the time it entered it."""
        key = request_key(request_id)
        mapping = {"phase": phase, f"t_{phase}": f"{time.time():.6f}", **{k: str(v) for k, v in fields.items()}}
        async with self.r.pipeline(transaction=False) as p:
            p.hset(key, mapping=mapping)
            p.expire(key, REQUEST_TTL_S)
            await p.execute()

    async def request(self, request_id: str) -> dict[str, str]:
        raw = await self.r.hgetall(request_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    # -- sessions --------------------------------------------------------------------------
    async def session_worker(self, session_id: str | None) -> str | None:
        if not session_id:
            return None
        v = await self.r.get(session_key(session_id))
        return v.decode() if v is not None else None

    async def set_session_worker(self, session_id: str, worker_id: str, ttl_s: float) -> None:
        await self.r.set(session_key(session_id), worker_id, px=int(ttl_s * 1000))

    # -- placements (idempotent routing) -----------------------------------------------------
    async def claim_route(self, request_id: str, router_id: str, lease_s: float) -> bool:
        """Take the placing of a request, or renew this router's hold on it; False when
        another router holds it."""
        key = route_key(request_id) + ":claim"
        if await self.r.set(key, router_id, nx=True, px=int(lease_s * 1000)):
            return True
        held = await self.r.get(key)
        if held is not None and held.decode() == router_id:
            await self.r.pexpire(key, int(lease_s * 1000))
            return True
        return False

    async def release_route(self, request_id: str) -> None:
        """Give up the placing (a refusal): the next attempt decides afresh."""
        await self.r.delete(route_key(request_id) + ":claim", route_key(request_id))

    async def note_route(self, request_id: str, ttl_s: float, **fields: str) -> None:
        key = route_key(request_id)
        async with self.r.pipeline(transaction=False) as p:
            p.hset(key, mapping=fields)
            p.pexpire(key, int(ttl_s * 1000))
            await p.execute()

    async def route(self, request_id: str) -> dict[str, str]:
        """What is known of a request's placement: {"decode": worker, "reply": RouteReply JSON}."""
        raw = await self.r.hgetall(route_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}
