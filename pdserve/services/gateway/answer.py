"""One choice of a response as its chunks come: text, token ids, log probabilities and tool
calls, each chunk's part (a stream's frame) and the whole; and a response of several choices."""

from __future__ import annotations

from typing import Literal, NamedTuple

from pdserve.services.gateway import tools
from pdserve.services.gateway.logprobs import CompletionLogprobs
from pdserve.services.gateway.logprobs import chat as chat_logprobs
from pdserve.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.shared.engine.tokenizer import Tokenizer
from pdserve.shared.messages import TokenChunk

Kind = Literal["chat", "text"]


class Part(NamedTuple):
    """What one chunk adds to a choice (a stream's frame)."""

    text: str
    ids: list[int]
    logprobs: dict | None  # None when not asked for
    tool_calls: list[dict]


class Answer:
    """One choice as its chunks come: text, token ids, log probabilities and tool calls, each
    chunk's part (a stream's frame) and the whole (one JSON body). With `echo` the prompt comes
    first, in the first chunk; `scoring` (completions' max_tokens 0) drops the one generated
    token; with tools, calls are taken out of the text as each completes."""

    def __init__(self, tok: Tokenizer, kind: Kind, body: ChatCompletionRequest | CompletionRequest,
                 prompt: list[int], scoring: bool, calls: tools.CallFormat, text: str | list[int] = "",
                 first: bool = True):
        """`prompt`: its tokens; `text`: the prompt as the client sent it (ids: decoded for
        `echo`); `first`: its prompt's first choice (the one whose usage counts the prompt)."""
        self.tok, self.kind, self.prompt, self.scoring, self.first = tok, kind, prompt, scoring, first
        self.echo = isinstance(body, CompletionRequest) and body.echo
        self.prompt_text = text if isinstance(text, str) else tok.decode(prompt)
        self.logprobs = body.top_logprobs_wanted() is not None
        self.token_ids = body.return_token_ids
        self.offsets = CompletionLogprobs(tok)
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.lps: list[dict] = []      # each chunk's logprobs object
        self.started = False
        functions = body.functions() if isinstance(body, ChatCompletionRequest) else None
        self.calls = tools.CallStream(calls) if functions else None
        self.tool_calls: list[dict] = []

    def part(self, chunk: TokenChunk) -> Part:
        text, ids, lps, prompt_lps = chunk.text, chunk.token_ids, chunk.logprobs or [], None
        if self.scoring:
            text, ids, lps = "", [], []
        if self.echo and not self.started:
            text = self.prompt_text + text
            prompt_lps = chunk.prompt_logprobs or [None] * len(self.prompt)
        self.started = True
        obj = None
        if self.logprobs and self.kind == "chat":
            obj = chat_logprobs(self.tok, lps)
        elif self.logprobs:
            pre = self.offsets.of(prompt_lps, self.prompt) if prompt_lps is not None else None
            gen = self.offsets.of(lps, ids)
            obj = CompletionLogprobs.join([pre, gen]) if pre is not None else gen
        calls: list[dict] = []
        if self.calls is not None:
            text, calls = self.calls.feed(text)
            text += self.calls.flush() if chunk.finished else ""
            self.tool_calls += calls
        self.texts.append(text)
        self.ids += ids
        if obj is not None:
            self.lps.append(obj)
        return Part(text, ids, obj, calls)

    def finish_reason(self, last: TokenChunk) -> str | None:
        return "tool_calls" if self.tool_calls and last.finish_reason == "stop" else last.finish_reason

    def choice(self, index: int, last: TokenChunk) -> dict:
        """This choice as the whole answer shows it."""
        text = "".join(self.texts)
        if self.logprobs:
            lps = (chat_logprobs(self.tok, []) | {"content": [e for p in self.lps for e in p["content"]]}
                   if self.kind == "chat" else CompletionLogprobs.join(self.lps))
        else:
            lps = None
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": text}
            if self.tool_calls:
                calls = [{k: v for k, v in c.items() if k != "index"} for c in self.tool_calls]  # (a delta's)
                message = {"role": "assistant", "content": text.strip() or None, "tool_calls": calls}
            choice = {"index": index, "message": message, "logprobs": lps, "finish_reason": self.finish_reason(last)}
        else:
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": last.finish_reason}
        if self.token_ids:
            choice["token_ids"] = self.ids
        return choice


def usage(answers: list[Answer], lasts: list[TokenChunk]) -> dict:
    """Each prompt once (as its choice 0 computed it), the completions of every choice."""
    firsts = [last for a, last in zip(answers, lasts) if a.first]
    prompt = sum(last.prompt_tokens for last in firsts)
    completion = sum(0 if a.scoring else last.completion_tokens for a, last in zip(answers, lasts))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(last.cached_tokens for last in firsts)}}


def body(meta: dict, answers: list[Answer], lasts: list[TokenChunk]) -> dict:
    """The whole response: every choice, and the usage."""
    obj = "chat.completion" if answers[0].kind == "chat" else "text_completion"
    return {**meta, "object": obj, "choices": [a.choice(i, last) for i, (a, last) in enumerate(zip(answers, lasts))],
            "usage": usage(answers, lasts)}
