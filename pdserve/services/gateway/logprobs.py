"""Log probabilities in OpenAI's two shapes, from the engine's Logprobs (token id, log
probability, alternatives): chat's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`
and completions' `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.

A token's `token` is its bytes read as UTF-8 (a byte-level token holding part of a character
shows U+FFFD there; `bytes` has the exact bytes). Completions' `text_offset` is each token's
first character in the choice's text (the echoed prompt, then the completion), counted as
the tokens' bytes decode; `CompletionLogprobs` keeps the count across a stream's chunks.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from pdserve.shared.engine.logprobs import Logprob
from pdserve.shared.engine.tokenizer import Tokenizer


def _entry(tok: Tokenizer, token_id: int, logprob: float) -> dict:
    raw = tok.token_bytes(token_id)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def chat(tok: Tokenizer, lps: Sequence[Logprob]) -> dict:
    """Chat's logprobs object for these tokens."""
    return {"content": [{**_entry(tok, lp.token_id, lp.logprob),
                         "top_logprobs": [_entry(tok, i, v) for i, v in lp.top]} for lp in lps],
            "refusal": None}


class CompletionLogprobs:
    """Completions' logprobs object, chunk by chunk: `text_offset` goes on from the last."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def of(self, lps: Sequence[Logprob | None], token_ids: Sequence[int]) -> dict:
        """For `token_ids`, each scored by `lps` (None: unscored, the prompt's first token)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, lps, strict=True):
            raw = self.tok.token_bytes(token_id)
            out["tokens"].append(raw.decode("utf-8", "replace"))
            out["text_offset"].append(self.chars)
            self.chars += len(self.decoder.decode(raw))
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            if lp is None:
                out["top_logprobs"].append(None)
            else:  # the chosen token is always among them, as OpenAI's
                top = {self.tok.token_bytes(i).decode("utf-8", "replace"): v for i, v in lp.top}
                top.setdefault(out["tokens"][-1], lp.logprob)
                out["top_logprobs"].append(top)
        return out

    @staticmethod
    def join(parts: Sequence[dict]) -> dict:
        return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                    "text_offset")}
