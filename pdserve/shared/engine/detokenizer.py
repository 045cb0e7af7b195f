"""Incremental detokenization with stop strings.

`TextStream.push(token_ids)` returns the new text since the last call. It never emits half a
UTF-8 character (a token that ends mid-character waits for the next one), and it holds back
a tail that could still grow into a stop string, so a stop string never reaches the client
even in part (`keep_stop`: the one that matched ends the text). `skip_special`: special tokens
add no text. Deterministic in the token ids alone: two processes that push the same ids
emit the same text (the decode side replays the prefill side's first token this way).
"""

from __future__ import annotations

from pdserve.shared.engine.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, start: int, stop: tuple[str, ...] = (), keep_stop: bool = False,
                 skip_special: bool = True):
        self.tok, self.keep_stop, self.skip_special = tokenizer, keep_stop, skip_special
        self.prefix_offset = self.read_offset = start  # token offsets into the id list
        self.stop = tuple(s for s in stop if s)
        self.text = ""        # all text decoded so far (cut at a stop string once matched)
        self.emitted = 0      # characters of `text` already returned
        self.stopped = False  # a stop string matched

    def push(self, ids: list[int]) -> str:
        """Take the full id list (prompt + generated so far); return text ready to emit."""
        if not self.stopped:
            self.text += self._new_text(ids)
            self._match_stop()
        ready = len(self.text) if self.stopped else len(self.text) - self._held_back()
        return self._emit(ready)

    def flush(self) -> str:
        """At the end of the sequence: whatever was held back for a stop string that never came."""
        return self._emit(len(self.text))

    def _new_text(self, ids: list[int]) -> str:
        before = self.tok.decode(ids[self.prefix_offset:self.read_offset], self.skip_special)
        after = self.tok.decode(ids[self.prefix_offset:], self.skip_special)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return after[len(before):]
        return ""

    def _match_stop(self) -> None:
        longest = max((len(s) for s in self.stop), default=0)
        window_start = max(0, self.emitted - longest)
        hits = [(i, -len(s)) for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        if hits:
            at, minus_length = min(hits)  # the first to match (the longest of those that start there)
            self.text = self.text[:at - minus_length if self.keep_stop else at]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out, self.emitted = self.text[self.emitted:upto], upto
        return out
