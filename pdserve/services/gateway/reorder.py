"""A request's token chunks in `seq` order, once each (pure: no I/O, no clock).

Chunks carry the index of their first token (`seq`). Duplicates (a retried step, the prefill
worker's and the decode worker's first token, a failover, a replay) and chunks already passed
are dropped; a chunk that arrives early waits until the ones before it came. A chunk waiting
is a gap: the relay asks for the missing ones again, or moves the stream, when it stays open.
"""

from __future__ import annotations

from collections.abc import Iterator

from pdserve.shared.messages import TokenChunk


class Reorder:
    def __init__(self) -> None:
        self.next_seq = 0                          # the first token not passed on yet
        self.waiting: dict[int, TokenChunk] = {}   # by seq: early, until the chunks before them came
        self.generated: list[int] = []             # the tokens passed on, in order
        self.finished = False                      # the finishing chunk was passed on

    @property
    def gap(self) -> bool:
        return bool(self.waiting)

    def add(self, chunk: TokenChunk) -> Iterator[TokenChunk]:
        """Take a chunk; yields the chunks now in order (none after the finishing one)."""
        if chunk.seq >= self.next_seq and not self.finished:
            self.waiting[chunk.seq] = chunk
        while self.next_seq in self.waiting and not self.finished:
            ready = self.waiting.pop(self.next_seq)
            self.next_seq += max(1, len(ready.token_ids))
            self.generated += ready.token_ids
            self.finished = ready.finished
            yield ready

    def forget_waiting(self) -> None:
        """The stream moved (a new placement resends from `next_seq`): early chunks of the old one go."""
        self.waiting.clear()
