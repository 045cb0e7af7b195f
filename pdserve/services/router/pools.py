"""The registry as a placement needs it: per model, its live prefill and decode workers
(placement.live) and each by id — made once per registry read, not once per placement (a
placement's own work then follows the prompt and the workers holding it, not the fleet).
`Pools` keeps them: re-read in the background every REGISTRY_READ_S while the router serves,
read on the spot when older."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from pdserve.services.router.placement import live
from pdserve.services.router.recent import REGISTRY_READ_S
from pdserve.services.router.registry import Bounds, RegistryCopy
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state import State
from pdserve.shared.tasks import every

log = logging.getLogger("router")
# a lease (3 heartbeats): a registry copy older than this (the background read not done yet, or
# failing) is read on the route
WORKERS_MAX_AGE_S = 3.0


@dataclass(frozen=True)
class Pool:
    workers: list[WorkerInfo] = field(default_factory=list)
    prefills: list[WorkerInfo] = field(default_factory=list)
    decodes: list[WorkerInfo] = field(default_factory=list)
    ids: dict[str, WorkerInfo] = field(default_factory=dict)     # worker id -> its entry

    @property
    def block_size(self) -> int:
        return self.workers[0].block_size if self.workers else 16


EMPTY = Pool()


def pools(workers: list[WorkerInfo]) -> dict[str, Pool]:
    """The workers of each model served."""
    by_model: dict[str, list[WorkerInfo]] = {}
    for w in workers:
        by_model.setdefault(w.model, []).append(w)
    return {model: Pool(ws, [w for w in ws if w.role == "prefill"], [w for w in ws if w.role == "decode"],
                        {w.worker_id: w for w in ws}) for model, ws in by_model.items()}


class Pools:
    """The live workers of each model as last read from the registry."""

    def __init__(self, state: State, stall_s: float, bounds: Bounds | None = None):
        self.state, self.stall_s = state, stall_s
        self.registry = RegistryCopy(bounds=bounds or Bounds())
        self.read_at = -math.inf  # never read
        self.by_model: dict[str, Pool] = {}
        self.refreshing = False  # `keep` runs

    async def pool(self, model: str) -> Pool:
        """The model's workers as last read: kept fresh by `keep` while the router serves (a
        placement never waits for it); read here when older than REGISTRY_READ_S otherwise.
        Heartbeats are 1 s apart: a stale entry costs one refused admit, which moves on."""
        age = time.monotonic() - self.read_at
        by_model = self.by_model
        if age > REGISTRY_READ_S and (not self.refreshing or age > WORKERS_MAX_AGE_S):
            by_model = await self.read()
        return by_model.get(model, EMPTY)

    async def read(self) -> dict[str, Pool]:
        now = time.monotonic()
        await self.registry.read(self.state)
        self.read_at, self.by_model = now, pools(live(self.registry.workers(), self.stall_s))
        return self.by_model

    async def registered(self) -> list[WorkerInfo]:
        """Every registered worker, gateway and router, as last read (read now if that is older
        than a lease: the background read is not running or failing)."""
        if time.monotonic() - self.read_at > WORKERS_MAX_AGE_S:
            await self.read()
        return self.registry.workers()

    def entry(self, worker_id: str) -> WorkerInfo | None:
        """A registered worker's entry as last read (live or not)."""
        return next((w for w in self.registry.workers() if w.worker_id == worker_id), None)

    async def keep(self, stop: asyncio.Event) -> None:
        self.refreshing = True
        try:
            await every(REGISTRY_READ_S, self.read, stop, log, "registry read")
        finally:
            self.refreshing = False
