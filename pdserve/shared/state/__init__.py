"""The shared state in Redis, by subject, behind one connection (`State`):

    store.py       the core: the connection, its scripts, a round trip (`script`, `pipelined`, `call`)
    keys.py        the keys' names (the layout)
    registry.py    `state.registry`: workers' entries under heartbeat leases, and their change log
    requests.py    `state.requests`: request events, deadlines, supervision, gateway ownership
    placements.py  `state.placements`: each request's placement, claimed and noted by the routers
    sessions.py    `state.sessions`: the decode worker of a conversation's last turn
    crashes.py     `state.crashes`: each worker's latest engine pass, the crashes charged to each request
"""

from __future__ import annotations

import redis.asyncio as aioredis

from pdserve.shared.config import Common
from pdserve.shared.state.crashes import Crashes
from pdserve.shared.state.keys import (
    DEADLINES,
    GATEWAYS,
    REQUEST_TTL_S,
    WORKERS,
    claim_key,
    log_key,
    owned_key,
    placement_key,
    request_key,
    route_key,
    session_key,
    worker_key,
)
from pdserve.shared.state.placements import Placements
from pdserve.shared.state.registry import Registry
from pdserve.shared.state.requests import PREFILLED_ELSEWHERE, Requests
from pdserve.shared.state.sessions import Sessions
from pdserve.shared.state.store import Store
from pdserve.shared.urls import async_redis

__all__ = ["DEADLINES", "GATEWAYS", "PREFILLED_ELSEWHERE", "REQUEST_TTL_S", "WORKERS", "State", "Store", "claim_key",
           "log_key", "owned_key", "placement_key", "request_key", "route_key", "session_key", "worker_key"]
MAX_CONNECTIONS = 64  # per process


class State(Store):
    """One connection (the core, `Store`) and the subjects that share it."""

    def __init__(self, r: aioredis.Redis, stall_s: float = 30.0, min_prefill_tokens_per_s: float = 50.0,
                 history_s: float = 600.0):
        super().__init__(r)
        self.registry = Registry(self)
        self.requests = Requests(self, stall_s, min_prefill_tokens_per_s, history_s)
        self.placements = Placements(self)
        self.sessions = Sessions(self)
        self.crashes = Crashes(self)

    @classmethod
    def connect(cls, url: str, stall_s: float = 30.0, min_prefill_tokens_per_s: float = 50.0,
                history_s: float = 600.0) -> State:
        """One Redis or a Sentinel-watched primary (pdserve/shared/urls.py); a blocking pool: a burst of
        concurrent calls waits for a connection instead of failing."""
        return cls(async_redis(url, MAX_CONNECTIONS), stall_s, min_prefill_tokens_per_s, history_s)

    @classmethod
    def for_service(cls, settings: Common, url: str = "") -> State:
        """The store for a service: its URL (`url`, its own user's; default PD_REDIS_URL) and its
        phase-deadline and history settings (pdserve/shared/config.Common)."""
        return cls.connect(url or settings.redis_url, settings.stall_s, settings.stall_min_prefill_tokens_per_s,
                           settings.history_s)

    async def close(self) -> None:
        """The events noted still on their way written (for up to 2 s), then the connection closed."""
        await self.requests.notes.flush(2)
        await super().close()
