"""uvicorn's HTTP/1.1 protocol with a deadline on each request's head.

uvicorn closes a connection idle between requests after `timeout_keep_alive`, but a client
that opens a connection and sends nothing, or trickles a request's headers a byte at a time
(slowloris), holds it open for ever. Here a connection whose request head has not fully
arrived `head_timeout_s` after the connection opened, or after the head's first byte, is
closed. The keep-alive idle timeout is longer than clients' own (httpx keeps an idle
connection 5 s, cloud load balancers 60 s), so the server never closes a connection at the
moment a client reuses it.

A client that stops taking what it is sent (a stream it does not read) fills the connection's
buffers until uvicorn stops writing to it (the transport's high-water mark): the answer's
producer waits there, its chunks merged meanwhile (pending.py). A connection whose client takes
no byte of it for `send_deadline_s` is cut (`pd_send_deadline_closes`): its request ends as a
client that disconnects does, cancelled on its workers, its KV freed."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.shared import metrics

log = logging.getLogger("gateway.connections")


def protocol(head_timeout_s: float, send_deadline_s: float = 30.0) -> type[H11Protocol]:
    """The protocol class for `uvicorn.run(http=...)`."""
    return type("Deadlines", (Deadlines,), {"head_timeout_s": head_timeout_s, "send_deadline_s": send_deadline_s})


class Deadlines(H11Protocol):
    head_timeout_s = 10.0
    send_deadline_s = 30.0
    head_deadline: asyncio.TimerHandle | None = None
    send_deadline: asyncio.TimerHandle | None = None
    taken: tuple[int, float] = (0, 0.0)   # bytes left in the write buffer, when its client last took some

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
        self._stop_send_clock()
        super().connection_lost(exc)

    def pause_writing(self) -> None:  # the client takes less than it is sent: its clock runs
        super().pause_writing()
        if self.send_deadline is None:
            self.taken = (self._untaken(), self.loop.time())
            self.send_deadline = self.loop.call_later(self.send_deadline_s / 4, self._send_check)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_clock()

    def _stop_send_clock(self) -> None:
        if self.send_deadline is not None:
            self.send_deadline.cancel()
            self.send_deadline = None

    def _arm(self) -> None:
        self._disarm()
        self.head_deadline = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_late(self) -> None:
        self.head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def _send_check(self) -> None:
        """While writes wait: a buffer that shrank is a client taking data; none taken for
        `send_deadline_s` cuts the connection."""
        left, since = self.taken
        now = self.loop.time()
        if (size := self._untaken()) < left:
            self.taken = size, now
        elif now - since >= self.send_deadline_s:
            self.send_deadline = None
            return self._send_late()
        self.send_deadline = self.loop.call_later(self.send_deadline_s / 4, self._send_check)

    def _untaken(self) -> int:
        """Bytes sent that the client has not taken: the transport's buffer and, on Linux, the
        socket's queue (SIOCOUTQ: not yet acknowledged; it shrinks as the client reads)."""
        size = self.transport.get_write_buffer_size()
        try:
            queued = fcntl.ioctl(self.transport.get_extra_info("socket").fileno(), termios.TIOCOUTQ, bytes(4))
            size += struct.unpack("i", queued)[0]
        except (OSError, AttributeError):   # (no such query here: the transport's buffer alone)
            pass
        return size

    def _send_late(self) -> None:
        metrics.SEND_DEADLINE_CLOSES.inc()
        log.warning("client %s took nothing for %.0f s: connection closed, its request cancelled", self.client,
                    self.send_deadline_s)
        self.transport.abort()  # (close() would wait for the buffer it does not take)
