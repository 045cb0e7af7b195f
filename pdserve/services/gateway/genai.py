"""The request span's attributes in OpenTelemetry's GenAI semantic conventions
(`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...), beside the project's own, so a
tracing backend's GenAI views read pdserve's traces as they read a provider's."""

from __future__ import annotations

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as g

from pdserve.services.gateway.answer import Answer, Kind, usage
from pdserve.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.shared.messages import TokenChunk

PROVIDER = "pdserve"


def request_attributes(body: ChatCompletionRequest | CompletionRequest, kind: Kind, max_tokens: int) -> dict:
    """What the client asked for."""
    operation = g.GenAiOperationNameValues.CHAT if kind == "chat" else g.GenAiOperationNameValues.TEXT_COMPLETION
    out: dict[str, str | int | float | bool | list[str]] = {
        g.GEN_AI_OPERATION_NAME: operation.value, g.GEN_AI_PROVIDER_NAME: PROVIDER,
        g.GEN_AI_REQUEST_MODEL: body.model, g.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
        g.GEN_AI_REQUEST_TEMPERATURE: body.temperature, g.GEN_AI_REQUEST_TOP_P: body.top_p,
        g.GEN_AI_REQUEST_CHOICE_COUNT: body.n, g.GEN_AI_REQUEST_STREAM: body.stream}
    if body.seed is not None:
        out[g.GEN_AI_REQUEST_SEED] = body.seed
    if body.stop:
        out[g.GEN_AI_REQUEST_STOP_SEQUENCES] = list(body.stop)
    return out


def response_attributes(meta: dict, answers: list[Answer], lasts: list[TokenChunk]) -> dict:
    used = usage(answers, lasts)
    return {g.GEN_AI_RESPONSE_ID: meta["id"], g.GEN_AI_RESPONSE_MODEL: meta["model"],
            g.GEN_AI_RESPONSE_FINISH_REASONS: [a.finish_reason(last) or "" for a, last in zip(answers, lasts)],
            g.GEN_AI_USAGE_INPUT_TOKENS: used["prompt_tokens"], g.GEN_AI_USAGE_OUTPUT_TOKENS: used["completion_tokens"],
            g.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: used["prompt_tokens_details"]["cached_tokens"]}
