"""`POST /v1/responses`: OpenAI's Responses API over the chat path. The request becomes a chat
request (responses_request.py), placed and generated as any (generate.start); the answer is a
`response` object whose output is an assistant `message` (its `output_text`) and a
`function_call` item per tool call, or, streamed, the Responses API's typed events:

    response.created, response.in_progress
    per message:  output_item.added, content_part.added, output_text.delta..., output_text.done,
                  content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta, .done, output_item.done
    response.completed (response.incomplete: max_output_tokens reached; error: a failure)

Ids: the response `resp_<request id>`, its message `msg_<request id>`, a call's item `fc_<call id>`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.services.gateway import genai, generate
from pdserve.services.gateway.answer import Answer, usage
from pdserve.services.gateway.deps import Gateway
from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.responses_request import ResponsesRequest, param_of, renamed
from pdserve.shared.messages import TokenChunk


async def respond(gw: Gateway, request: Request, body: ResponsesRequest) -> JSONResponse | StreamingResponse:
    try:
        started = await generate.start(gw, request, body.as_chat(), "chat")
    except APIError as e:  # (a chat request's check: the field named as this request has it)
        e.param, e.message = param_of(e.param), renamed(e.message)
        raise
    reply = Reply(body, started.rid)
    if body.stream:
        return StreamingResponse(events(reply, started), media_type="text/event-stream")
    (last,) = await generate.gather(request, started.chunks, started.answers)
    (answer,) = started.answers
    started.span.set_attributes(genai.response_attributes({**started.meta, "id": reply.id}, [answer], [last]))
    text = "".join(answer.texts)
    output = ([reply.message(text, "completed")] if text.strip() or not answer.tool_calls else []) + \
        [reply.call(c) for c in answer.tool_calls]
    return JSONResponse(reply.whole(answer, last, output))


class Reply:
    """The response object of one request, and its items."""

    def __init__(self, body: ResponsesRequest, rid: str):
        self.body, self.id, self.message_id, self.created = body, f"resp_{rid}", f"msg_{rid}", int(time.time())

    def whole(self, answer: Answer | None, last: TokenChunk | None, output: list[dict]) -> dict:
        """The response: in progress (no answer yet), or done with its output and usage."""
        b = self.body
        fmt = b.text.format if b.text and b.text.format else None
        status, incomplete, used = "in_progress", None, None
        if answer is not None and last is not None:
            status = "incomplete" if last.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
            u = usage([answer], [last])
            used = {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
                    "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": u["total_tokens"]}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "model": b.model, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": None, "reasoning": None,
                "store": False, "temperature": b.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": (b.tool_choice if isinstance(b.tool_choice, str) else
                                b.tool_choice.model_dump() if b.tool_choice else "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()], "top_p": b.top_p,
                "truncation": "disabled", "usage": used, "user": b.user, "metadata": b.metadata or {}}

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self.text_part(text)] if status != "in_progress" else []}

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def call(c: dict, status: str = "completed") -> dict:
        """A tool call (as a chat answer has it) as a function_call item."""
        return {"type": "function_call", "id": f"fc_{c['id']}", "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"] if status == "completed" else "", "status": status}


class Events:
    """The stream's events, numbered."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: object) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def events(reply: Reply, started: generate.Started) -> AsyncIterator[bytes]:
    """The answer as the Responses API streams it (the module's docstring)."""
    ev, (answer,) = Events(), started.answers
    yield ev("response.created", response=reply.whole(None, None, []))
    yield ev("response.in_progress", response=reply.whole(None, None, []))
    output: list[dict] = []
    text, at = "", -1  # the message's text and place in the output (-1: not open)
    last: TokenChunk | None = None
    try:
        async for _, last in started.chunks:
            part = answer.part(last)
            if part.text and (part.text.strip() or at >= 0 or answer.calls is None):
                if at < 0:
                    at = len(output)
                    output.append(reply.message("", "in_progress"))
                    yield ev("response.output_item.added", output_index=at, item=output[at])
                    yield ev("response.content_part.added", item_id=reply.message_id, output_index=at,
                             content_index=0, part=reply.text_part(""))
                text += part.text
                yield ev("response.output_text.delta", item_id=reply.message_id, output_index=at, content_index=0,
                         delta=part.text, logprobs=[])
            for call in part.tool_calls:
                for frame in _call(ev, reply, call, len(output)):
                    yield frame
                output.append(reply.call(call))
    except APIError as e:  # the status line is gone already: reported in the stream
        yield ev("error", code=e.code, message=e.message, param=e.param)
        return
    finally:
        await started.chunks.aclose()
    if at >= 0:
        output[at] = reply.message(text, "completed")
        where = {"item_id": reply.message_id, "output_index": at, "content_index": 0}
        yield ev("response.output_text.done", **where, text=text, logprobs=[])
        yield ev("response.content_part.done", **where, part=reply.text_part(text))
        yield ev("response.output_item.done", output_index=at, item=output[at])
    if last is not None:
        final = reply.whole(answer, last, output)
        started.span.set_attributes(genai.response_attributes({**started.meta, "id": reply.id}, [answer], [last]))
        yield ev(f"response.{final['status'] if final['status'] == 'incomplete' else 'completed'}", response=final)


def _call(ev: Events, reply: Reply, call: dict, index: int) -> list[bytes]:
    """A whole tool call's events (the tool call parser gives each call complete)."""
    item_id, arguments = f"fc_{call['id']}", call["function"]["arguments"]
    return [ev("response.output_item.added", output_index=index, item=reply.call(call, "in_progress")),
            ev("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=arguments),
            ev("response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=arguments),
            ev("response.output_item.done", output_index=index, item=reply.call(call))]
