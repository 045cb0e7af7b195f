"""Conversations: the decode worker of a conversation's last turn, kept while the conversation
is active (its next turn goes there: its prefix is in that worker's cache)."""

from __future__ import annotations

from pdserve.shared.state.keys import session_key
from pdserve.shared.state.store import Store


class Sessions:
    def __init__(self, store: Store):
        self.store = store

    async def worker(self, session_id: str | None) -> str | None:
        if not session_id:
            return None
        v = await self.store.r.get(session_key(session_id))
        return v.decode() if v is not None else None

    async def set_worker(self, session_id: str, worker_id: str, ttl_s: float) -> None:
        await self.store.r.set(session_key(session_id), worker_id, px=int(ttl_s * 1000))
