"""The supervisor, in every router replica: requests that stopped advancing, and requests
whose gateway is gone. One round every `supervise_s`:

1. Lost gateways: a gateway with requests filed under it (`pd:{flight}:owned:<gw>`) whose lease has
   been gone for `confirm_s`. Nobody reads those requests' tokens: each is cancelled on
   every worker its events name (its blocks return on both) and recorded `failed`.
2. Overdue requests (`pd:{flight}:deadlines`): the request's events give its summary and the registry
   its workers' leases; lifecycle.verdict decides. Stalled (workers alive, no progress: a
   hung step, a job that never ran) → a `Stalled` word on `pd.stalled.<rid>` to the gateway
   holding the stream, which moves the request as from a lost worker. The deadline moves on
   by `stall_s`, so each period says it once; a second period with no move (nobody acted on
   the word) → cancelled on its workers and recorded failed.

Replicas share the work: a request is judged under a short claim in Redis, so one replica
acts on it per period. Redis or NATS away: the round is skipped and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pdserve.shared import lifecycle, metrics, subjects
from pdserve.shared.absence import Absence
from pdserve.shared.bus import Bus
from pdserve.shared.holders import Holders
from pdserve.shared.messages import Cancel, Stalled, WorkerInfo
from pdserve.shared.state import State
from pdserve.shared.tasks import every

log = logging.getLogger("router.supervisor")


class Supervisor:
    def __init__(self, bus: Bus, state: State, router_id: str, stall_s: float, confirm_s: float,
                 registered: Callable[[], Awaitable[list[WorkerInfo]]] | None = None):
        self.bus, self.state, self.id = bus, state, router_id
        self.registered = registered or state.registry.workers   # the router's copy of the registry, kept fresh
        self.stall_s = stall_s
        self.absence = Absence(confirm_s)   # gateways seen without a lease

    async def run(self, stop: asyncio.Event, period_s: float) -> None:
        await every(period_s, self.round, stop, log, "supervisor round")  # Redis or NATS away: the next round

    async def round(self) -> None:
        alive = {w.worker_id for w in await self.registered()}
        await self.lost_gateways(alive)
        for rid in await self.state.requests.overdue():
            if await self.state.requests.claim_supervision(rid, self.id, self.stall_s):
                await self.judge(rid, alive)

    def gone(self, worker: str, alive: set[str]) -> bool:
        return self.absence.gone(worker, worker in alive, time.monotonic())

    async def lost_gateways(self, alive: set[str]) -> None:
        for gateway in await self.state.requests.owners():
            if not self.gone(gateway, alive):
                continue
            rids = await self.state.requests.take_owned(gateway)   # replicas split them (SPOP)
            if not rids:
                self.absence.forget(gateway)
            metrics.SUPERVISOR_ACTIONS.labels("abandoned").inc(len(rids))
            for rid in rids:
                await Holders.of(await self.state.requests.events(rid)).cancel_as_supervisor(
                    self.bus, Cancel(request_id=rid, reason="gateway lost"))
                self.state.requests.note(rid, "failed", by=self.id, owner=gateway, reason=f"gateway {gateway} lost")
            if rids:
                log.warning("gateway %s lost: %d of its requests cancelled", gateway, len(rids))

    async def judge(self, rid: str, alive: set[str]) -> None:
        events = await self.state.requests.events(rid)
        s = lifecycle.summarize(events)
        owner_alive = not s.owner or not self.gone(s.owner, alive)
        verdict = lifecycle.verdict(s, owner_alive, decode_alive=s.decode in alive)
        if verdict == "forget":
            await self.state.requests.forget(rid)
            return
        await self.state.requests.postpone(rid, self.stall_s)
        if verdict in ("abandoned", "stalled", "unheeded"):
            metrics.SUPERVISOR_ACTIONS.labels(verdict).inc()
        if verdict in ("abandoned", "unheeded"):
            why = f"gateway {s.owner} lost" if verdict == "abandoned" else f"stalled in {s.phase}, not moved"
            await Holders.of(events).cancel_as_supervisor(self.bus, Cancel(request_id=rid, reason=why))
            self.state.requests.note(rid, "failed", by=self.id, owner=s.owner, reason=why)
        elif verdict == "stalled":
            log.warning("%s: no progress in %s on %s (attempt %d); asking its gateway to move it",
                        rid, s.phase, s.decode, s.attempt)
            await self.bus.publish(subjects.stalled(rid), Stalled(request_id=rid, attempt=s.attempt,
                                                                 phase=s.phase, worker=s.decode))
            self.state.requests.note(rid, "stalled", by=self.id, attempt=s.attempt, in_phase=s.phase, worker=s.decode)
