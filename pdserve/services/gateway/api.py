"""Routes: OpenAI-compatible generation (chat, completions, responses), the model list, and
vLLM's /tokenize and /detokenize (API key and rate limit checked first); the version (open). The
probes and the metrics are on the metrics port, not here (pdserve/shared/probes.py)."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pdserve.services.gateway.checks import check_model
from pdserve.services.gateway.deps import GatewayDep, authorize
from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.generate import chat_ids, generate
from pdserve.services.gateway.responses import respond
from pdserve.services.gateway.responses_request import ResponsesRequest
from pdserve.services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

ops = APIRouter()  # version: no key
v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
tokens = APIRouter(dependencies=[Depends(authorize)])  # vLLM's, beside /v1
# response_model=None: a route's `-> dict` is for mypy, not a response schema of its OpenAPI document


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, gw: GatewayDep) -> Response:
    return await generate(gw, request, body, "chat")


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request, gw: GatewayDep) -> Response:
    return await generate(gw, request, body, "text")


@v1.post("/responses")
async def responses(body: ResponsesRequest, request: Request, gw: GatewayDep) -> Response:
    return await respond(gw, request, body)


def _model(gw: GatewayDep) -> dict:
    return {"id": gw.settings.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": gw.model_config.max_position}


@v1.get("/models", response_model=None)
async def models(gw: GatewayDep) -> dict:
    return {"object": "list", "data": [_model(gw)]}


@v1.get("/models/{model_id:path}", response_model=None)
async def model(model_id: str, gw: GatewayDep) -> dict:
    check_model(gw, model_id)
    return _model(gw)


@tokens.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeRequest, gw: GatewayDep) -> dict:
    """A text's tokens, or a conversation's through the chat template (as a chat request's)."""
    check_model(gw, body.model)
    if body.messages is not None:
        ids = chat_ids(gw, ChatCompletionRequest(model=gw.settings.model_name, messages=body.messages))
    elif body.add_special_tokens:
        ids = gw.tokenizer.encode(body.prompt or "")
    else:
        ids = gw.tokenizer.tok.encode(body.prompt or "", add_special_tokens=False).ids
    return {"count": len(ids), "max_model_len": gw.model_config.max_position, "tokens": ids, "token_strs": None}


@tokens.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, gw: GatewayDep) -> dict:
    check_model(gw, body.model)
    if any(not 0 <= t < gw.model_config.vocab_size for t in body.tokens):
        raise APIError(400, "tokens has ids outside the vocabulary.", param="tokens")
    return {"prompt": gw.tokenizer.decode(body.tokens)}


@ops.get("/version", response_model=None)
async def version() -> dict:
    return {"version": importlib.metadata.version("pdserve")}
