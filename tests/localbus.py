"""An in-process stand-in for pdserve.shared.bus.Bus (publish / subscribe, `*` as the last token),
delivering asynchronously like NATS, for protocol tests without a server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import nats.errors

from pdserve.shared import macs


@dataclass
class LocalMsg:
    subject: str
    data: bytes
    headers: dict = field(default_factory=dict)


class LocalBus:
    def __init__(self) -> None:
        self.subs: list[tuple[str, object]] = []
        self.sent: list[tuple[str, object]] = []   # (subject, message) in publish order
        self.tasks: set[asyncio.Task] = set()
        self.lose = lambda subject: False          # the bus away for these subjects: recorded, not delivered
        self.refuse = lambda subject: False        # away with its buffer full: publish raises, as nats-py's
        self.refused: list[str] = []               # (the subjects whose publish raised)

    async def subscribe(self, subject: str, handler, queue: str = ""):
        self.subs.append((subject, handler))

    async def publish(self, subject: str, msg, ctx=None, secret: str = "") -> None:
        if self.refuse(subject):
            self.refused.append(subject)
            raise nats.errors.OutboundBufferLimitError
        self.sent.append((subject, msg))
        if self.lose(subject):
            return
        data = msg.encode()
        headers = {macs.HEADER: macs.mac(secret, data)} if secret else {}
        for pattern, handler in self.subs:
            if _match(pattern, subject):
                task = asyncio.create_task(handler(LocalMsg(subject, data, headers)))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def tried(self, what: str, publishing) -> bool:
        """As Bus.tried: a bus error is returned as False."""
        try:
            await publishing
        except nats.errors.Error:
            return False
        return True

    def of_type(self, cls) -> list:
        return [m for _, m in self.sent if isinstance(m, cls)]


def _match(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))
