"""From a validated request to an OpenAI response: prompt checks, placement, the token
stream relayed as SSE or gathered into one JSON body."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Literal, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace

from services.gateway import tools
from services.gateway.deps import Gateway
from services.gateway.errors import APIError
from services.gateway.logprobs import CompletionLogprobs
from services.gateway.logprobs import chat as chat_logprobs
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.timing import timed
from shared import tracing
from shared.engine.tokenizer import Tokenizer
from shared.messages import RouteRequest, TokenChunk

Kind = Literal["chat", "text"]


def prompt_ids(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
    if body.model != gw.settings.model_name:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                            f"'{gw.settings.model_name}'.", param="model", code="model_not_found")
    if isinstance(body, ChatCompletionRequest):
        messages = tools.prompt_messages([m.for_template() for m in body.messages], body.functions())
        return gw.tokenizer.encode(gw.tokenizer.apply_chat_template(messages))
    if isinstance(body.prompt, str):
        return gw.tokenizer.encode(body.prompt)
    if any(not 0 <= t < gw.model_config.vocab_size for t in body.prompt):
        raise APIError(400, "The prompt has token ids outside the vocabulary.", param="prompt")
    return list(body.prompt)


def max_tokens(gw: Gateway, body, n_prompt: int) -> int:
    limit = gw.model_config.max_position
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if gw.settings.max_prompt_tokens and n_prompt > gw.settings.max_prompt_tokens:
        raise APIError(400, f"The prompt has {n_prompt} tokens; this server accepts at most "
                            f"{gw.settings.max_prompt_tokens} prompt tokens.", param=prompt_param,
                       code="prompt_too_long")
    room = limit - n_prompt
    wanted = body.max_tokens
    cap = gw.settings.max_tokens_limit
    if cap and wanted is not None and wanted > cap:
        raise APIError(400, f"max_tokens is {wanted}; this server allows at most {cap}.", param="max_tokens",
                       code="max_tokens_too_large")
    if room < 1 or (wanted is not None and wanted > room):
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{n_prompt + (wanted or 1)} tokens ({n_prompt} in the prompt, {wanted or 1} in the "
                            "completion). Please reduce the prompt or the completion length.",
                       param=prompt_param, code="context_length_exceeded")
    return wanted if wanted is not None else min(room, gw.settings.default_max_tokens, cap or room)


# prompt log probabilities one request may ask for (tokens x (1 + alternatives)): they travel
# in one bus message, under NATS' default 1 MB payload
MAX_PROMPT_LOGPROBS = 16_384


def check_tokens(gw: Gateway, body: ChatCompletionRequest | CompletionRequest, n_prompt: int) -> None:
    """What the schema cannot know: token ids within this model's vocabulary, and prompt log
    probabilities that fit one message."""
    vocab = gw.model_config.vocab_size
    if any(int(k) >= vocab for k in body.logit_bias or {}):
        raise APIError(400, f"logit_bias has token ids outside the vocabulary (0..{vocab - 1}).", param="logit_bias")
    if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
        raise APIError(400, f"stop_token_ids has ids outside the vocabulary (0..{vocab - 1}).",
                       param="stop_token_ids")
    top = body.prompt_logprobs_wanted()
    if top is not None and n_prompt * (1 + top) > MAX_PROMPT_LOGPROBS:
        raise APIError(400, f"echo with logprobs={top} scores {n_prompt} prompt tokens x {1 + top} entries; this "
                            f"server returns at most {MAX_PROMPT_LOGPROBS} (a shorter prompt or fewer logprobs).",
                       param="logprobs")


async def generate(gw: Gateway, request: Request, body: ChatCompletionRequest | CompletionRequest,
                   kind: Kind) -> JSONResponse | StreamingResponse:
    ids = prompt_ids(gw, body)
    check_tokens(gw, body, len(ids))
    scoring = isinstance(body, CompletionRequest) and body.max_tokens == 0  # echo: the prompt scored alone
    try:
        limit = max_tokens(gw, body, len(ids))  # (the prompt's checks too)
        sampling = body.sampling(1 if scoring else limit)
    except ValueError as e:
        raise APIError(400, str(e), param="min_tokens") from None
    rid = request.state.request_id  # set with the root span by middleware.RequestContext
    span = trace.get_current_span()
    span.set_attributes({"prompt_tokens": len(ids), "stream": body.stream, "max_tokens": sampling.max_tokens})
    try:
        session = body.session_id or request.headers.get("x-session-id") or None
        placement, chunks = await gw.relay.run(RouteRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                                                            model=body.model, session_id=session))
    except APIError as e:
        span.set_attribute("error", e.message)
        raise
    span.set_attributes({"mode": placement.mode or "", "decode_worker": placement.decode_worker or "",
                         "prefill_worker": placement.prefill_worker or ""})
    chunks = timed(chunks, request.state.arrived, placement.mode or "", tracing.trace_id_hex(span))
    meta = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}", "created": int(time.time()),
            "model": body.model}
    answer = Answer(gw.tokenizer, kind, body, ids, scoring)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(chunks, meta, answer, include_usage), media_type="text/event-stream")
    last = await _gather(request, chunks, answer)
    return JSONResponse(answer.body(meta, last))


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
                 prompt: list[int], scoring: bool):
        self.tok, self.kind, self.prompt, self.scoring = tok, kind, prompt, scoring
        self.echo = isinstance(body, CompletionRequest) and body.echo
        self.prompt_text = (body.prompt if isinstance(body.prompt, str) else tok.decode(prompt)) \
            if isinstance(body, CompletionRequest) else ""
        self.logprobs = body.top_logprobs_wanted() is not None
        self.token_ids = body.return_token_ids
        self.offsets = CompletionLogprobs(tok)
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.lps: list[dict] = []      # each chunk's logprobs object
        self.started = False
        functions = body.functions() if isinstance(body, ChatCompletionRequest) else None
        self.calls = tools.CallStream() if functions else None
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

    def body(self, meta: dict, last: TokenChunk) -> dict:
        text = "".join(self.texts)
        if self.logprobs:
            lps = (chat_logprobs(self.tok, []) | {"content": [e for p in self.lps for e in p["content"]]}
                   if self.kind == "chat" else CompletionLogprobs.join(self.lps))
        else:
            lps = None
        usage = self.usage(last)
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": text}
            if self.tool_calls:
                calls = [{k: v for k, v in c.items() if k != "index"} for c in self.tool_calls]  # (a delta's)
                message = {"role": "assistant", "content": text.strip() or None, "tool_calls": calls}
            choice = {"index": 0, "message": message, "logprobs": lps, "finish_reason": self.finish_reason(last)}
            full = {**meta, "object": "chat.completion", "choices": [choice], "usage": usage}
        else:
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": last.finish_reason}
            full = {**meta, "object": "text_completion", "choices": [choice], "usage": usage}
        if self.token_ids:
            choice["token_ids"] = self.ids
        return full

    def usage(self, last: TokenChunk) -> dict:
        completion = 0 if self.scoring else last.completion_tokens
        return {"prompt_tokens": last.prompt_tokens, "completion_tokens": completion,
                "total_tokens": last.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


async def _gather(request: Request, chunks: AsyncIterator[TokenChunk], answer: Answer) -> TokenChunk:
    """Collect the whole answer; a client that hangs up cancels the request."""
    async def collect():
        last = None
        async for last in chunks:
            answer.part(last)
        return last

    async def hung_up():
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)

    work, watch = asyncio.create_task(collect()), asyncio.create_task(hung_up())
    await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise APIError(499, "client closed the request")
    return work.result()


def _event(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _sse(chunks: AsyncIterator[TokenChunk], meta: dict, answer: Answer,
               include_usage: bool) -> AsyncIterator[bytes]:
    kind = answer.kind
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def frame(text: str | None, finish: str | None, ids: list[int] | None = None, lps: dict | None = None,
              first: bool = False, calls: list[dict] | None = None) -> bytes:
        if kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": finish}
        if answer.token_ids and ids is not None:
            choice["token_ids"] = ids
        return _event({**meta, "object": obj, "choices": [choice], **extra})

    if kind == "chat":
        yield frame(None, None, first=True)
    last = None
    try:
        async for last in chunks:
            text, ids, lps, calls = answer.part(last)
            if answer.calls is not None and not text.strip():  # (between calls: the separators)
                text = ""
            if text or calls or last.finished or answer.token_ids or (lps and any(lps.values())):
                yield frame(text, answer.finish_reason(last) if last.finished else None, ids, lps, calls=calls)
    except APIError as e:  # the status line is gone already: report in the stream, as OpenAI does
        yield _event({"error": {"message": e.message, "type": "server_error", "code": e.code}})
        return
    if include_usage and last is not None:
        yield _event({**meta, "object": obj, "choices": [], "usage": answer.usage(last)})
    yield b"data: [DONE]\n\n"
