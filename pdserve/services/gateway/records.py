"""What the relay (relay.py) reads and writes in the state store: workers' leases, each request's
events, the routers' placements, the crashes charged to a request. None by default (a relay
without a store: every worker counts as alive, nothing is noted, no crash is charged)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.shared.state import State


def _not_noted(*args: object, **kwargs: object) -> None:
    pass


@dataclass(frozen=True)
class Records:
    alive: Callable[[str], Awaitable[bool]] | None = None        # state.registry.alive: a worker's lease
    note: Callable[..., None] = _not_noted                       # state.requests.note: the request's events
    placed: Callable[[str], Awaitable[dict[str, str]]] | None = None  # state.placements.read: what routers noted
    owner: str = ""                                              # this gateway's registry id
    crashes: Callable[[str, str], Awaitable[list[str]]] | None = None  # state.crashes.charge

    @classmethod
    def of(cls, state: State, owner: str) -> Records:
        return cls(alive=state.registry.alive, note=state.requests.note, placed=state.placements.read, owner=owner,
                   crashes=state.crashes.charge)

    async def charge(self, request_id: str, lost_worker: str) -> list[str]:
        """The crashes charged to the request, `lost_worker`'s included when its last pass held
        it (pdserve/shared/quarantine.py; "": none lost, those charged so far); none without a store."""
        if self.crashes is None:
            return []
        return await self.crashes(request_id, lost_worker)
