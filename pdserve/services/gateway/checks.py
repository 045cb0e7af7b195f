"""What a request must pass before it reaches the bus, beyond its schema: this server's caps,
grammars that compile, token ids in the vocabulary, a bus message that fits; and, per caller,
its prefix-cache partition and its fair share (priority, requests and tokens per second)."""

from __future__ import annotations

import asyncio
import functools
import json

from fastapi import Request

from pdserve.services.gateway.deps import Gateway
from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.services.gateway.tools import CallFormat
from pdserve.shared.engine.grammar import Grammar, GrammarError, library, library_loaded
from pdserve.shared.engine.grammar import check as grammar_check
from pdserve.shared.messages import RouteRequest

Body = ChatCompletionRequest | CompletionRequest


# prompt log probabilities one request may ask for (tokens x (1 + alternatives)): they travel
# in one bus message, under NATS' default 1 MB payload
MAX_PROMPT_LOGPROBS = 16_384


GRAMMAR_CHECK_S = 10.0  # longest a structured-output grammar may take to compile for its check


@functools.lru_cache(maxsize=512)
def _grammar_error(grammar: Grammar) -> str | None:
    try:
        grammar_check(grammar)
    except GrammarError as e:
        return str(e)
    return None


async def check_grammars(body: Body, calls: CallFormat) -> None:
    """Each structured-output grammar compiles: off the event loop (a large schema takes
    seconds), within GRAMMAR_CHECK_S once the library is loaded (PD_GRAMMAR_PRELOAD off: on the
    first such request), each distinct grammar checked once (a cache keyed by it)."""
    grammars = body._grammars(calls)
    if grammars and not library_loaded():
        await asyncio.to_thread(library)
    for param, grammar in grammars:
        try:
            error = await asyncio.wait_for(asyncio.to_thread(_grammar_error, grammar), GRAMMAR_CHECK_S)
        except TimeoutError:
            raise APIError(400, f"'{param}' takes over {GRAMMAR_CHECK_S:.0f} s to compile.", param=param) from None
        if error is not None:
            raise APIError(400, f"'{param}' does not compile: {error}.", param=param)


def cache_salt(gw: Gateway, body: Body, request: Request) -> str:
    """The request's prefix-cache partition: its API key's name (PD_PREFIX_CACHE_PER_KEY, with
    keys set) and its own `cache_salt`, either or both; "" shares the cache with every request."""
    key = getattr(request.state, "api_key", None) if gw.settings.prefix_cache_per_key else None
    return "\x1f".join(part for part in (f"key:{key}" if key else "", body.cache_salt or "") if part)


MAX_SESSION_CHARS = 200  # x-session-id, as the session_id field


def session(body: Body, request: Request) -> str | None:
    """The conversation the request continues (`session_id`, or the x-session-id header), as its
    API key's own: with keys set, one key's session never names another's (nor steers it to
    a decode worker)."""
    sid = body.session_id or request.headers.get("x-session-id")
    key = getattr(request.state, "api_key", None)
    return f"key:{key}/{sid}" if sid and key else sid


def check_model(gw: Gateway, model: str | None) -> None:
    """The model a request names is the one served (None: not named) — a 404 otherwise."""
    if model is not None and model != gw.settings.model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{gw.settings.model_name}'.",
                       param="model", code="model_not_found")


def check_caps(gw: Gateway, body: Body, request: Request) -> None:
    """This server's limits on what costs it per token or per message (GatewaySettings)."""
    if len(body.logit_bias or {}) > gw.settings.max_logit_bias:
        raise APIError(400, f"logit_bias has {len(body.logit_bias or {})} entries; this server accepts at most "
                            f"{gw.settings.max_logit_bias}.", param="logit_bias")
    if any(len(s) > gw.settings.max_stop_chars for s in body.stop or ()):
        raise APIError(400, f"A stop string is longer than {gw.settings.max_stop_chars} characters.", param="stop")
    if len(request.headers.get("x-session-id", "")) > MAX_SESSION_CHARS:
        raise APIError(400, f"The x-session-id header is longer than {MAX_SESSION_CHARS} characters.",
                       param="x-session-id")


# what the router adds to a request's message on its way to the workers (a prefill job carries
# the same prompt and sampling): a request's message leaves this much of the bus's payload limit
BUS_HEADROOM = 16 << 10


def check_size(gw: Gateway, body: Body, req: RouteRequest) -> None:
    """A request whose bus message would be over the server's payload limit is a 400 naming its
    largest part (the prompt, stop strings, logit_bias or the structured-output field)."""
    limit = gw.bus.nc.max_payload - BUS_HEADROOM
    if (size := len(req.encode())) <= limit:
        return
    s = req.sampling
    parts = {"messages" if isinstance(body, ChatCompletionRequest) else "prompt": req.prompt_token_ids,
             "stop": list(s.stop), "logit_bias": list(s.logit_bias), "stop_token_ids": list(s.stop_token_ids),
             **{field: grammar.spec for field, grammar in body._grammars(gw.calls)}}
    param = max(parts, key=lambda k: len(json.dumps(parts[k])))
    raise APIError(400, f"The request takes {size} bytes on the message bus, over the {limit} one message may "
                        f"carry here; its largest part is '{param}'.", param=param, code="request_too_large")


def check_tokens(gw: Gateway, body: Body, n_prompt: int) -> None:
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


def caller(request: Request) -> str:
    """Who the request is for fairness: its API key's name, or its address when the API is open."""
    return request.state.caller


async def fair_share(gw: Gateway, body: Body, request: Request, choices: int, n_prompt: int,
                     max_tokens: int) -> None:
    """A priority ahead of the default only for the keys allowed it (PD_PRIORITY_KEYS; anyone's
    while the API is open); the request's other choices (of every prompt) from the request
    bucket, and its tokens (prompts + n x each prompt's max_tokens) from the token bucket."""
    key = getattr(request.state, "api_key", None)
    allowed = {k.strip() for k in gw.settings.priority_keys.split(",") if k.strip()}
    if body.priority < 0 and key is not None and key not in allowed:
        raise APIError(400, "priority below 0 (ahead of the default) is not allowed for this API key.",
                       param="priority", code="priority_not_allowed")
    if choices > 1:
        await gw.rate_limit.take(caller(request), choices - 1)
    await gw.token_limit.take(caller(request), n_prompt + body.n * max_tokens)
