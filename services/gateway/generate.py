"""From a validated request to an OpenAI response: prompt checks, placement, the token
stream relayed as SSE or gathered into one JSON body."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace

from services.gateway.deps import Gateway
from services.gateway.errors import APIError
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.timing import timed
from shared import tracing
from shared.messages import RouteRequest, TokenChunk

Kind = Literal["chat", "text"]


def prompt_ids(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
    if body.model != gw.settings.model_name:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                            f"'{gw.settings.model_name}'.", param="model", code="model_not_found")
    if isinstance(body, ChatCompletionRequest):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
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


async def generate(gw: Gateway, request: Request, body: ChatCompletionRequest | CompletionRequest,
                   kind: Kind) -> JSONResponse | StreamingResponse:
    ids = prompt_ids(gw, body)
    try:
        sampling = body.sampling(max_tokens(gw, body, len(ids)))
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
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(chunks, meta, kind, include_usage, body.return_token_ids),
                                 media_type="text/event-stream")
    text, ids, last = await _gather(request, chunks)
    full = _full_body(meta, kind, text, last)
    if body.return_token_ids:
        full["choices"][0]["token_ids"] = ids
    return JSONResponse(full)


def _usage(last: TokenChunk) -> dict:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


def _full_body(meta: dict, kind: Kind, text: str, last: TokenChunk) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": last.finish_reason}
        return {**meta, "object": "chat.completion", "choices": [choice], "usage": _usage(last)}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    return {**meta, "object": "text_completion", "choices": [choice], "usage": _usage(last)}


async def _gather(request: Request, chunks: AsyncIterator[TokenChunk]) -> tuple[str, list[int], TokenChunk]:
    """Collect the whole answer; a client that hangs up cancels the request."""
    async def collect():
        parts, ids, last = [], [], None
        async for last in chunks:
            parts.append(last.text)
            ids += last.token_ids
        return "".join(parts), ids, last

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


async def _sse(chunks: AsyncIterator[TokenChunk], meta: dict, kind: Kind, include_usage: bool,
               token_ids: bool) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def frame(text: str | None, finish: str | None, ids: list[int] | None = None, first: bool = False) -> bytes:
        if kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if token_ids and ids is not None:
            choice["token_ids"] = ids
        return _event({**meta, "object": obj, "choices": [choice], **extra})

    if kind == "chat":
        yield frame(None, None, first=True)
    last = None
    try:
        async for last in chunks:
            if last.text or last.finished or token_ids:
                yield frame(last.text, last.finish_reason if last.finished else None, last.token_ids)
    except APIError as e:  # the status line is gone already: report in the stream, as OpenAI does
        yield _event({"error": {"message": e.message, "type": "server_error", "code": e.code}})
        return
    if include_usage and last is not None:
        yield _event({**meta, "object": obj, "choices": [], "usage": _usage(last)})
    yield b"data: [DONE]\n\n"
