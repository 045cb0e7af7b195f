"""Routes: OpenAI-compatible generation and the model list (API key and rate limit checked
first), liveness, readiness and Prometheus metrics (open)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder

from services.gateway.deps import GatewayDep, authorize
from services.gateway.generate import generate
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, gw: GatewayDep):
    return await generate(gw, request, body, "chat")


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request, gw: GatewayDep):
    return await generate(gw, request, body, "text")


@v1.get("/models")
async def models(gw: GatewayDep):
    return {"object": "list", "data": [{"id": gw.settings.model_name, "object": "model", "created": 0,
                                         "owned_by": "pdserve", "max_model_len": gw.model_config.max_position}]}


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request):
    """Prometheus text, or OpenMetrics (with trace-id exemplars) when the scraper asks for it."""
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(REGISTRY), media_type=content_type)


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready")
async def ready(gw: GatewayDep):
    """Ready when NATS is connected and a router and the worker pools are registered."""
    try:
        workers = await gw.state.workers()
    except Exception as e:  # noqa: BLE001 - Redis unreachable
        return JSONResponse({"ready": False, "reason": f"state store: {e}"}, status_code=503)
    count = {role: sum(w.role == role for w in workers) for role in ("router", "prefill", "decode")}
    missing = [role for role, n in count.items()
               if n == 0 and (role != "prefill" or gw.settings.require_prefill)]
    if not gw.bus.nc.is_connected:
        missing.append("nats")
    body = {"ready": not missing, "workers": count, "missing": missing}
    return JSONResponse(body, status_code=503 if missing else 200)
