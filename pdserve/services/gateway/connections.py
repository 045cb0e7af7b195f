"""uvicorn's HTTP/1.1 protocol with a deadline on each request's head.

uvicorn closes a connection idle between requests after `timeout_keep_alive`, but a client
that opens a connection and sends nothing, or trickles a request's headers a byte at a time
(slowloris), holds it open for ever. Here a connection whose request head has not fully
arrived `head_timeout_s` after the connection opened, or after the head's first byte, is
closed. The keep-alive idle timeout is longer than clients' own (httpx keeps an idle
connection 5 s, cloud load balancers 60 s), so the server never closes a connection at the
moment a client reuses it."""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def protocol(head_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for `uvicorn.run(http=...)`."""

    class HeadDeadline(H11Protocol):
        head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # noqa: ANN401 - uvicorn's own signature
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:   # a head begun, or nothing yet: its clock runs
                if self.head_deadline is None and data:
                    self._arm()
            else:                                   # the head is in: the request's own time now
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.head_deadline = self.loop.call_later(head_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self.head_deadline is not None:
                self.head_deadline.cancel()
                self.head_deadline = None

        def _head_late(self) -> None:
            self.head_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline
