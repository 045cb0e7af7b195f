"""The token chunks a decode worker published, kept so they can be published again.

NATS core delivers at most once: chunks published while the server restarts, or while a
gateway's connection is away, are gone. The gateway notices (a gap, or silence after its
reconnect) and asks the worker for the chunks from the first one it is missing
(`pd.decode.<id>.replay`); answered from here, the stream goes on without recomputing
anything. What is not here any more (cancelled, finished over `keep_s` ago, or older than
the last `window` chunks of a request) is refused, and the gateway places the request again.
Chunks are kept as they were published, encoded with their MAC (pdserve/shared/macs.py; ~250 bytes
each, where a TokenChunk object takes ~1.4 KB).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

from pdserve.shared.macs import Signed
from pdserve.shared.messages import TokenChunk

Kept = tuple[int, int, Signed]  # seq, tokens it holds (at least 1), the chunk as published


class ChunkLog:
    def __init__(self, window: int = 2048, keep_s: float = 60.0, max_finished: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window, self.keep_s, self.max_finished, self.clock = window, keep_s, max_finished, clock
        self.running: dict[str, deque[Kept]] = {}
        self.finished: OrderedDict[str, tuple[float, deque[Kept]]] = OrderedDict()  # rid: (when, chunks)

    def record(self, chunk: TokenChunk, signed: Signed) -> None:
        """`chunk` was published as `signed`."""
        chunks = self.running.setdefault(chunk.request_id, deque(maxlen=self.window))
        chunks.append((chunk.seq, max(1, len(chunk.token_ids)), signed))
        if chunk.finished:
            self.finished[chunk.request_id] = (self.clock(), self.running.pop(chunk.request_id))
            self._expire()

    def since(self, request_id: str, from_seq: int, placed: bool = False) -> list[Signed] | None:
        """The chunks that hold tokens from `from_seq` on (None: not all of them are here).
        `placed`: the request is on this worker (queued, prefilling, or waiting for its KV);
        if it has published nothing yet, nothing of it is lost: none to send."""
        self._expire()
        chunks = self.running.get(request_id)
        if chunks is None and request_id in self.finished:
            chunks = self.finished[request_id][1]
        if not chunks:
            return [] if placed else None
        if chunks[0][0] > from_seq:
            return None  # older than the window, or made before this placement
        return [signed for seq, n, signed in chunks if seq + n > from_seq]

    def forget(self, request_id: str) -> None:
        self.running.pop(request_id, None)
        self.finished.pop(request_id, None)

    def _expire(self) -> None:
        now = self.clock()
        while self.finished:
            rid, (when, _) = next(iter(self.finished.items()))
            if now - when < self.keep_s and len(self.finished) <= self.max_finished:
                break
            del self.finished[rid]
