"""From a validated request to an OpenAI response: prompt checks, placement, and the answer
streamed (stream.py) or gathered into one JSON body."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2.exceptions import TemplateError
from opentelemetry import trace

from pdserve.services.gateway import answer, checks, choices, genai, ids, stream, tools
from pdserve.services.gateway.answer import Answer, Kind
from pdserve.services.gateway.deps import Gateway
from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from pdserve.services.gateway.timing import timed
from pdserve.shared import tracing
from pdserve.shared.messages import RouteReply, RouteRequest, Sampling, TokenChunk


def prompt_ids(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> list[list[int]]:
    """Each prompt's tokens (a chat's conversation, or a completions request's prompts)."""
    checks.check_model(gw, body.model)
    if isinstance(body, ChatCompletionRequest):
        return [chat_ids(gw, body)]
    out = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            out.append(gw.tokenizer.encode(prompt))
        elif any(not 0 <= t < gw.model_config.vocab_size for t in prompt):
            raise APIError(400, "The prompt has token ids outside the vocabulary.", param="prompt")
        else:
            out.append(list(prompt))
    return out


def chat_ids(gw: Gateway, body: ChatCompletionRequest) -> list[int]:
    """The conversation through the chat template: the tools given to a template that reads
    them, else listed in the Hermes format (tools.py); a template's refusal, or a model with
    none (a base model's), is a 400. A special token spelled in the client's text (its messages,
    its chat_template_kwargs) stays text (PD_SPECIAL_TOKENS_IN_MESSAGES: read as one)."""
    functions, tok = body.functions(), gw.tokenizer
    if not tok.chat_template:
        raise APIError(400, "This model has no chat template, so it takes no conversation; send a prompt to "
                            "/v1/completions.", param="messages", code="no_chat_template")
    listing = tools.listing(functions) if functions else None

    def render(parts: dict) -> str:  # (the tools are the application's, not marked as text)
        messages, extra = parts["messages"], parts["kwargs"]
        if tok.template_takes_tools:
            return tok.apply_chat_template(tools.template_messages(messages), tools=listing, **extra)
        return tok.apply_chat_template(tools.prompt_messages(messages, functions), **extra)

    try:
        return tok.encode_chat({"messages": [m.for_template() for m in body.messages],
                                "kwargs": body.chat_template_kwargs or {}}, render,
                               specials_as_text=not gw.settings.special_tokens_in_messages)
    except TemplateError as e:
        raise APIError(400, f"The model's chat template refused the messages: {e}", param="messages") from e
    except (TypeError, ValueError) as e:  # (a template given variables of a type it does not expect)
        if not body.chat_template_kwargs:
            raise
        raise APIError(400, f"The model's chat template failed with these variables: {e}",
                       param="chat_template_kwargs") from e


def max_tokens(gw: Gateway, body: ChatCompletionRequest | CompletionRequest, n_prompt: int) -> int:
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


class Started(NamedTuple):
    """A request placed: its answers (one per choice) and the chunks that fill them, as
    (answer index, chunk)."""

    rid: str
    meta: dict  # the response's id, created and model
    answers: list[Answer]
    chunks: AsyncGenerator[tuple[int, TokenChunk]]
    span: trace.Span  # the request's (gateway.request)


async def generate(gw: Gateway, request: Request, body: ChatCompletionRequest | CompletionRequest,
                   kind: Kind) -> JSONResponse | StreamingResponse:
    """The request's answer, streamed (stream.py) or whole."""
    s = await start(gw, request, body, kind)
    if body.stream:
        return StreamingResponse(stream.events(s.chunks, s.meta, s.answers, body.stream_options or StreamOptions(),
                                               s.span), media_type="text/event-stream")
    lasts = await gather(request, s.chunks, s.answers)
    s.span.set_attributes(genai.response_attributes(s.meta, s.answers, lasts))
    return JSONResponse(answer.body(s.meta, s.answers, lasts))


async def start(gw: Gateway, request: Request, body: ChatCompletionRequest | CompletionRequest,
                kind: Kind) -> Started:
    """The request checked and placed: each prompt (several in a completions batch) a request
    of its own, with its `n` choices (choices.py); choice i of prompt j is index j x n + i."""
    checks.check_caps(gw, body, request)
    await checks.check_grammars(body, gw.calls)
    prompts = prompt_ids(gw, body)
    for prompt in prompts:
        checks.check_tokens(gw, body, len(prompt))
    scoring = isinstance(body, CompletionRequest) and body.max_tokens == 0  # echo: the prompt scored alone
    samplings = _samplings(gw, request, body, prompts, scoring)
    span = trace.get_current_span()
    rid = request.state.request_id
    span.set_attributes({"prompt_tokens": sum(map(len, prompts)), "stream": body.stream,
                         "max_tokens": samplings[0].max_tokens,
                         **genai.request_attributes(body, kind, samplings[0].max_tokens)})
    n = body.n
    # (refused: nothing taken from the rate limits)
    await gw.in_flight.join(checks.caller(request), rid, n * len(prompts))
    placements, streams = await _place(gw, request, body, rid, prompts, samplings)
    first = placements[0]
    span.set_attributes({"mode": first.mode or "", "decode_worker": first.decode_worker or "",
                         "prefill_worker": first.prefill_worker or "", "n": n, "prompts": len(prompts)})
    merged = _leaving(choices.merge([timed(s, request.state.arrived, placements[k // n].mode or "",
                                           tracing.trace_id_hex(span)) for k, s in enumerate(streams)]),
                      lambda: gw.in_flight.leave(rid))
    meta = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}", "created": int(time.time()),
            "model": body.model}
    texts = body.prompts() if isinstance(body, CompletionRequest) else [""]
    answers = [Answer(gw.tokenizer, kind, body, tokens, scoring, gw.calls, text, first=i == 0)
               for tokens, text in zip(prompts, texts) for i in range(n)]
    return Started(rid, meta, answers, merged, span)


def _samplings(gw: Gateway, request: Request, body: ChatCompletionRequest | CompletionRequest,
               prompts: list[list[int]], scoring: bool) -> list[Sampling]:
    """Each prompt's sampling parameters; its max_tokens checked against the prompt."""
    salt, caller = checks.cache_salt(gw, body, request), checks.caller(request)
    try:  # (max_tokens: the prompt's checks too)
        return [body.sampling(1 if scoring else max_tokens(gw, body, len(p)), salt, gw.calls, caller)
                for p in prompts]
    except ValueError as e:
        raise APIError(400, str(e), param="min_tokens") from None


async def _place(gw: Gateway, request: Request, body: ChatCompletionRequest | CompletionRequest, rid: str,
                 prompts: list[list[int]],
                 samplings: list[Sampling]) -> tuple[list[RouteReply], list[AsyncIterator[TokenChunk]]]:
    """Each prompt placed, its `n` choices with it: the placements, and every choice's stream.
    Any refusal leaves the in-flight count and cancels what was placed before it."""
    n = body.n
    streams: list[AsyncIterator[TokenChunk]] = []
    try:
        await checks.fair_share(gw, body, request, n * len(prompts), sum(map(len, prompts)),
                                sum(s.max_tokens for s in samplings))
        placements = []
        for j, (tokens, sampling) in enumerate(zip(prompts, samplings)):
            # n > 1: the later choices follow choice 0 to its decode worker (choices.py), under one session
            prid = ids.prompt_id(rid, len(prompts), j)
            session = checks.session(body, request) or (f"n-{prid}" if n > 1 else None)
            req = RouteRequest(request_id=prid, prompt_token_ids=tokens, sampling=sampling, model=body.model,
                               session_id=session)
            checks.check_size(gw, body, req)
            placement, placed = await choices.run(gw.relay.run, req, n)
            placements.append(placement)
            streams += placed
    except BaseException as e:
        gw.in_flight.leave(rid)
        await _cancel(streams)  # (a batch's prompts placed before the one that failed)
        if isinstance(e, APIError):
            trace.get_current_span().set_attribute("error", e.message)
        raise
    return placements, streams


async def _cancel(streams: list[AsyncIterator[TokenChunk]]) -> None:
    """Streams given up before anyone read them: each started, then cancelled and closed, so
    its placement is cancelled and its subscriptions end."""
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in streams:
        if isinstance(s, AsyncGenerator):
            await s.aclose()


async def _leaving(chunks: AsyncGenerator[tuple[int, TokenChunk]],
                   leave: Callable[[], None]) -> AsyncGenerator[tuple[int, TokenChunk]]:
    """The chunks, then `leave()` however the answer ends (its end, an error, the client gone)."""
    try:
        async for item in chunks:
            yield item
    finally:
        leave()
        await chunks.aclose()


async def gather(request: Request, chunks: AsyncIterator[tuple[int, TokenChunk]],
                  answers: list[Answer]) -> list[TokenChunk]:
    """Collect every choice whole (each one's last chunk); a client that hangs up cancels the request."""
    async def collect() -> list[TokenChunk]:
        lasts: list[TokenChunk | None] = [None] * len(answers)
        async for index, chunk in chunks:
            answers[index].part(chunk)
            lasts[index] = chunk
        whole = [last for last in lasts if last is not None]
        assert len(whole) == len(lasts)
        return whole

    async def hung_up() -> None:
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
