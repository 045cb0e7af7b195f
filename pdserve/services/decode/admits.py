"""A decode worker's answers to admits, by (request, attempt): a repeated admit (a router that
took over a placement asks again) gets the first one's reply, never a second reservation.

Kept apart from the requests' records (pdserve/services/decode/requests.py): an admit is answered
before the engine takes its request, and its reply outlives the request here (the last
`kept` ok replies), for a repeat that comes after its end.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from pdserve.shared.messages import AdmitReply

Key = tuple[str, int]  # (request, attempt)


class AdmitReplies:
    def __init__(self, kept: int = 10_000):
        self.kept = kept
        self.replied: OrderedDict[Key, AdmitReply] = OrderedDict()  # recent ok replies
        self.answering: dict[Key, asyncio.Future] = {}              # admits being reserved

    def seen(self, key: Key) -> bool:
        """An admit of `key` answered already, or under way."""
        return key in self.replied or key in self.answering

    async def answer(self, key: Key, reserve: Callable[[], Awaitable[AdmitReply]]) -> AdmitReply:
        """The reply to the admit of `key`: the first one's, else `reserve()`'s."""
        if key in self.replied:
            return self.replied[key]
        if key in self.answering:  # the same admit in flight (asked again meanwhile): its answer
            return await asyncio.shield(self.answering[key])
        answer = self.answering[key] = asyncio.get_running_loop().create_future()
        try:
            reply = await reserve()
        except asyncio.CancelledError:
            answer.cancel()
            raise
        except Exception as e:
            answer.set_exception(e)
            answer.exception()  # retrieved here: nobody else may be waiting
            raise
        finally:
            del self.answering[key]
        if reply.ok:
            self.replied[key] = reply
            while len(self.replied) > self.kept:
                self.replied.popitem(last=False)
        answer.set_result(reply)
        return reply
