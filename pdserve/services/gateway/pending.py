"""One choice's chunks that its reader has not taken yet, held as one (vLLM's
`RequestOutputCollector`): while the client reads, each chunk passes on alone; when the
producer runs ahead (a client that reads slowly, or not at all), the chunks that come meanwhile
are merged — text appended as UTF-8, token ids and log probabilities appended, the rest (finished,
finish reason, counts) the latest chunk's. What a choice waiting on its client holds is its
text and ids, not an object and a frame per token, and the send deadline (connections.py)
bounds how long it waits."""

from __future__ import annotations

from pdserve.shared.engine.logprobs import Logprob
from pdserve.shared.messages import TokenChunk


class Pending:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.first: TokenChunk | None = None   # the oldest chunk not taken (its seq, its prompt logprobs)
        self.latest: TokenChunk | None = None  # the newest, once more than one came
        self.text = bytearray()                # (appended in place: N chunks cost their bytes, not N copies)
        self.ids: list[int] = []
        self.logprobs: list[Logprob] | None = None

    def __bool__(self) -> bool:
        return self.first is not None

    @property
    def nbytes(self) -> int:
        """What the merged chunks hold beyond two chunk objects: their text and token ids."""
        return len(self.text) + 8 * len(self.ids)

    def put(self, chunk: TokenChunk) -> None:
        if self.first is None:
            self.first = chunk
            return
        if self.latest is None:  # a second chunk: from here on they are merged
            self._append(self.first)
        self._append(chunk)
        self.latest = chunk

    def take(self) -> TokenChunk | None:
        """Everything not taken, as one chunk (None when nothing came)."""
        first, latest = self.first, self.latest
        if first is None or latest is None:
            self.first = None
            return first
        merged = latest.model_copy(update={
            "seq": first.seq, "token_ids": self.ids, "text": self.text.decode("utf-8", "surrogatepass"),
            "logprobs": self.logprobs, "prompt_logprobs": first.prompt_logprobs})
        self._reset()
        return merged

    def _append(self, chunk: TokenChunk) -> None:
        self.text += chunk.text.encode("utf-8", "surrogatepass")
        self.ids += chunk.token_ids
        if chunk.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs += chunk.logprobs
