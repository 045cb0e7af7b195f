"""Every parameter of OpenAI's chat/completions and completions references is either honoured,
advisory (accepted, documented as doing nothing), or refused with a 400 naming it: none is
silently ignored."""


import pytest
from pydantic import ValidationError

from pdserve.services.gateway.errors import describe, plain
from pdserve.services.gateway.parts import MAX_DEPTH
from pdserve.services.gateway.responses_request import ResponsesRequest
from pdserve.services.gateway.schemas import (
    NOT_SUPPORTED,
    SEED_RANGE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

MSGS = [{"role": "user", "content": "hi"}]
# OpenAI's chat/completions request body, each with a value a client would send
CHAT = {
    "audio": {"voice": "alloy", "format": "mp3"}, "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f"}], "logit_bias": {"42": 5}, "logprobs": True, "max_completion_tokens": 8,
    "max_tokens": 8, "metadata": {"k": "v"}, "modalities": ["text"], "n": 2, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5, "prompt_cache_key": "k",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "u1", "seed": 1,
    "service_tier": "auto", "stop": ["\n"], "store": True, "stream": True, "stream_options": {"include_usage": True},
    "temperature": 0.5, "tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}],
    "top_logprobs": 3, "top_p": 0.9, "user": "u1", "verbosity": "low", "web_search_options": {},
}
COMPLETIONS = {
    "best_of": 2, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"42": 5}, "logprobs": 2, "max_tokens": 8,
    "n": 2, "presence_penalty": 0.5, "seed": 1, "stop": "\n", "stream": True, "stream_options": {"include_usage": True},
    "suffix": "end", "temperature": 0.5, "top_p": 0.9, "user": "u1",
}
HONOURED = {"frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "presence_penalty",
            "seed", "stop", "stream", "stream_options", "temperature", "top_logprobs", "top_p", "echo",
            "response_format", "tools", "tool_choice", "parallel_tool_calls", "n"}
ADVISORY = {"metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "modalities"}
REFUSED = {"best_of": "best_of", "store": "store"} | {k: k for k in NOT_SUPPORTED}


def refusal(model, body) -> tuple[str, str | None, str | None] | None:
    try:
        model.model_validate(body)
    except ValidationError as e:
        return describe(plain(e.errors()))
    return None


@pytest.mark.parametrize("model, base, params", [
    (ChatCompletionRequest, {"model": "m", "messages": MSGS}, CHAT),
    (CompletionRequest, {"model": "m", "prompt": "hi"}, COMPLETIONS)], ids=["chat", "completions"])
def test_each_openai_parameter_is_honoured_advisory_or_refused_by_name(model, base, params):
    for name, value in params.items():
        extra = {"top_logprobs": {"logprobs": True}, "tool_choice": {"tools": CHAT["tools"]}}.get(name, {})
        got = refusal(model, {**base, **extra, name: value})
        if name in HONOURED | ADVISORY:
            assert got is None, (name, got)
        else:
            assert name in REFUSED, f"{name}: neither honoured, advisory nor refused"
            assert got is not None and got[1] == name and name in got[0], (name, got)
    assert refusal(model, {**base, "no_such_field": 1}) == (
        "Unrecognized request argument supplied: no_such_field", "no_such_field", "unknown_parameter")


def test_explicit_defaults_of_refused_fields_are_accepted_and_values_are_checked():
    base = {"model": "m", "messages": MSGS}
    for name, value in [("response_format", {"type": "text"}), ("tool_choice", "none"), ("tools", []),
                        ("store", False), ("parallel_tool_calls", True)]:
        assert refusal(ChatCompletionRequest, {**base, name: value}) is None, name
    returned = {"role": "assistant", "content": "Paris.", "refusal": None, "tool_calls": None, "function_call": None,
                "audio": None, "annotations": []}  # an SDK response's message, passed back as the next turn's
    assert refusal(ChatCompletionRequest, {**base, "messages": [*MSGS, returned, *MSGS]}) is None
    called = {**returned, "function_call": {"name": "f", "arguments": "{}"}}
    assert "function_call" in refusal(ChatCompletionRequest, {**base, "messages": [*MSGS, called]})[0]
    assert refusal(ChatCompletionRequest, {**base, "messages": [{**MSGS[0], "x": 1}]})[2] == "unknown_parameter"
    assert refusal(ChatCompletionRequest, {**base, "top_logprobs": 2})[1] == "top_logprobs"  # without logprobs
    assert refusal(ChatCompletionRequest, {**base, "logprobs": True, "top_logprobs": 21})[1] == "top_logprobs"
    assert refusal(ChatCompletionRequest, {**base, "logit_bias": {"x": 1}})[1] == "logit_bias"
    assert refusal(ChatCompletionRequest, {**base, "logit_bias": {"3": 101}})[1] == "logit_bias"
    assert refusal(CompletionRequest, {"model": "m", "prompt": "hi", "max_tokens": 0})[1] == "max_tokens"
    assert refusal(CompletionRequest, {"model": "m", "prompt": ["a", ""]})[1] == "prompt"  # an empty one in a batch
    assert refusal(CompletionRequest, {"model": "m", "prompt": ["a"] * 9, "n": 8})[1] == "prompt"  # 72 choices
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    ok = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 1})
    s = ok.sampling(1)
    assert (s.logprobs, s.prompt_logprobs) == (1, 1)
    chat = ChatCompletionRequest.model_validate({**base, "logprobs": True, "logit_bias": {"7": -100},
                                                 "repetition_penalty": 1.1, "min_p": 0.1, "stop_token_ids": [5]})
    s = chat.sampling(4)
    assert (s.logprobs, s.prompt_logprobs, s.logit_bias, s.stop_token_ids) == (0, None, ((7, -100.0),), (5,))
    assert s.to_engine().repetition_penalty == 1.1 and s.to_engine().min_p == 0.1


def nested(depth: int) -> list:
    """`depth` lists, each in the next (a body's field holding them: nested `depth` levels below the body)."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


BODIES = {"chat": (ChatCompletionRequest, {"model": "m", "messages": MSGS}),
          "completions": (CompletionRequest, {"model": "m", "prompt": ["a", "b"]}),
          "responses": (ResponsesRequest, {"model": "m", "input": "hi"}),
          "tokenize": (TokenizeRequest, {"messages": MSGS}), "detokenize": (DetokenizeRequest, {"tokens": [1]})}


@pytest.mark.parametrize("model, base", BODIES.values(), ids=BODIES.keys())
def test_every_body_names_text_utf8_cannot_encode_and_nesting_past_the_cap(model, base):
    """Checked before any field, without recursion: a body nested as deep as the JSON parser
    takes (or deeper) is a 400 naming its field, not a RecursionError."""
    assert refusal(model, {**base, "model": "a\ud800b"})[:2] == (
        "'model' is not valid unicode (it holds a lone surrogate, half of a UTF-16 pair).", "model")
    assert refusal(model, {**base, "x": {"y": ["ok", "\udfff"]}})[1] == "x.y.1"
    assert refusal(model, {**base, "\udfff": 1})[1] == "body"  # (a key)
    too_deep = (f"'x' is nested deeper than {MAX_DEPTH} levels.", "x")
    for depth in (MAX_DEPTH + 1, 990, 100_000):
        assert refusal(model, {**base, "x": nested(depth)})[:2] == too_deep, depth
    assert refusal(model, {**base, "x": nested(MAX_DEPTH)})[1:] == ("x", "unknown_parameter")  # read, then refused


@pytest.mark.parametrize("model, base", [(ChatCompletionRequest, {"model": "m", "messages": MSGS}),
                                         (CompletionRequest, {"model": "m", "prompt": "hi"})],
                         ids=["chat", "completions"])
def test_a_seed_is_an_int64(model, base):
    """As vLLM's: a seed beyond it would reach the span's attributes, which OTLP cannot carry."""
    low, high = SEED_RANGE
    assert refusal(model, {**base, "seed": low}) is None and refusal(model, {**base, "seed": high}) is None
    for seed in (low - 1, high + 1, 10 ** 40):
        assert refusal(model, {**base, "seed": seed})[1] == "seed", seed
