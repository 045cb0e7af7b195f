"""The chat and completions answer as OpenAI streams it: server-sent events, one chunk per
frame, each choice's chunks as they come; the usage at the end (or in every chunk, vLLM's
`continuous_usage_stats`); an error after the status line went out reported in the stream."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator

from opentelemetry import trace

from pdserve.services.gateway import genai
from pdserve.services.gateway.answer import Answer, Part, usage
from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.schemas import StreamOptions
from pdserve.shared.messages import TokenChunk


def _event(obj: object) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class Frames:
    """The stream's frames for one request's answers: each choice's chunk, the usage at the end."""

    def __init__(self, meta: dict, answers: list[Answer], options: StreamOptions):
        self.meta, self.answers = meta, answers
        self.kind = answers[0].kind
        self.obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        self.extra = {"usage": None} if options.include_usage else {}
        self.every = options.include_usage and options.continuous_usage_stats  # (as vLLM: with include_usage only)

    def choice(self, index: int, part: Part | None, finish: str | None, last: TokenChunk | None = None) -> bytes:
        if self.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if part is None else \
                ({"content": part.text} if part.text else {})
            if part is not None and part.tool_calls:
                delta["tool_calls"] = part.tool_calls
            choice = {"index": index, "delta": delta, "logprobs": part and part.logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": part.text if part else "", "logprobs": part and part.logprobs,
                      "finish_reason": finish}
        if self.answers[index].token_ids and part is not None:
            choice["token_ids"] = part.ids
        so_far = {"usage": {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                            "total_tokens": last.prompt_tokens + last.completion_tokens}} \
            if self.every and last is not None else {}
        return _event({**self.meta, "object": self.obj, "choices": [choice], **self.extra, **so_far})

    def usage_frame(self, ended: list[TokenChunk]) -> bytes:
        return _event({**self.meta, "object": self.obj, "choices": [], "usage": usage(self.answers, ended)})


def _shown(answer: Answer, last: TokenChunk) -> Part | None:
    """What of a choice's latest chunk goes to the client; None when nothing does."""
    part = answer.part(last)
    if answer.calls is not None and not part.text.strip():  # (between calls: the separators)
        part = part._replace(text="")
    if part.text or part.tool_calls or last.finished or answer.token_ids or \
            (part.logprobs and any(part.logprobs.values())):
        return part
    return None


async def events(chunks: AsyncGenerator[tuple[int, TokenChunk]], meta: dict, answers: list[Answer],
                 options: StreamOptions, span: trace.Span) -> AsyncIterator[bytes]:
    frames = Frames(meta, answers, options)
    if frames.kind == "chat":
        for index in range(len(answers)):
            yield frames.choice(index, None, None)
    lasts: list[TokenChunk | None] = [None] * len(answers)
    try:
        async for index, last in chunks:
            answer, lasts[index] = answers[index], last
            if (part := _shown(answer, last)) is not None:
                yield frames.choice(index, part, answer.finish_reason(last) if last.finished else None, last)
    except APIError as e:  # the status line is gone already: report in the stream, as OpenAI does
        yield _event({"error": {"message": e.message, "type": "server_error", "code": e.code}})
        return
    finally:
        await chunks.aclose()  # (a client gone: every choice's work stops)
    ended = [last for last in lasts if last is not None]
    if len(ended) == len(answers):
        span.set_attributes(genai.response_attributes(meta, answers, ended))
    if options.include_usage and len(ended) == len(answers):
        yield frames.usage_frame(ended)
    yield b"data: [DONE]\n\n"
