"""Crashes (pdserve/shared/quarantine.py): each worker's latest engine pass, recorded before it runs,
and the crashes charged to each request, read by whoever moves a request off a lost worker."""

from __future__ import annotations

import logging

from redis.asyncio.client import Pipeline

from pdserve.shared import quarantine
from pdserve.shared.messages import WorkerBatch
from pdserve.shared.state.keys import BATCH_TTL_S, REQUEST_TTL_S, batch_key, crashes_key
from pdserve.shared.state.store import Store

log = logging.getLogger(__name__)


class Crashes:
    def __init__(self, store: Store):
        self.store = store

    async def record_batch(self, batch: WorkerBatch) -> None:
        await self.store.call(lambda p: p.set(batch_key(batch.worker), batch.encode(), px=BATCH_TTL_S * 1000))

    async def forget_batch(self, worker: str) -> None:
        """A worker that leaves in order: its last pass ended, no crash to charge."""
        await self.store.call(lambda p: p.delete(batch_key(worker)))

    async def batch(self, worker: str) -> WorkerBatch | None:
        raw = await self.store.call(lambda p: p.get(batch_key(worker)))
        return WorkerBatch.decode(raw) if raw is not None else None

    async def charge(self, request_id: str, lost_worker: str) -> list[str]:
        """The crashes charged to the request, its lost worker's charged first when that
        worker's last recorded pass holds it as a suspect (idempotent: once per worker life; "":
        none lost, only read); none known with Redis away (no verdict: the request is moved as
        before, logged)."""
        try:
            return await self._charge(request_id, lost_worker)
        except Exception as e:  # noqa: BLE001 - Redis away
            log.warning("%s: crashes not read (%s); placing it again", request_id, e)
            return []

    async def _charge(self, request_id: str, lost_worker: str) -> list[str]:
        batch = await self.batch(lost_worker) if lost_worker else None
        key = crashes_key(request_id)
        if batch is None or request_id not in quarantine.suspects(batch):
            return sorted(m.decode() for m in await self.store.call(lambda p: p.smembers(key)))

        def build(p: Pipeline) -> None:
            p.sadd(key, quarantine.crash_of(batch))
            p.pexpire(key, REQUEST_TTL_S * 1000)
            p.smembers(key)
        *_, members = await self.store.pipelined(build, transaction=True)
        return sorted(m.decode() for m in members)
