"""The openai SDK (the project's venv) against the stack, unchanged: each of its surfaces once."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel
from steps import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.clients]
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class City(BaseModel):
    name: str
    country: str


class GetWeather(BaseModel):
    city: str


@pytest.fixture(scope="module")
def sdk(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.works_with("openai", "models.list, models.retrieve")
def test_models(sdk, record):
    listed = [m.id for m in sdk.models.list()]
    assert MODEL in listed and sdk.models.retrieve(MODEL).id == MODEL
    record(openai.__version__, models=len(listed))


@pytest.mark.works_with("openai", "chat.completions.create")
def test_chat(sdk, record):
    resp = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=16)
    assert isinstance(resp.choices[0].message.content, str) and resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens > 0
    record(openai.__version__, completion_tokens=resp.usage.completion_tokens)


@pytest.mark.works_with("openai", "completions.create: text, token ids (from /tokenize), a batch of prompts")
def test_completions(sdk, stack, record):
    prompt = "The capital of France is"
    text = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    tokens = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    ids = sdk.completions.create(model=MODEL, prompt=tokens, max_tokens=8, temperature=0)
    batch = sdk.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0)
    assert text.choices[0].text == ids.choices[0].text and [c.index for c in batch.choices] == [0, 1]
    record(openai.__version__, choices=len(text.choices) + len(ids.choices) + len(batch.choices))


@pytest.mark.works_with("openai", "streaming: chat and completions, include_usage")
def test_streaming(sdk, record):
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=16, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    plain = list(sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in plain)
    record(openai.__version__, chat_chunks=len(chunks), completion_chunks=len(plain))


@pytest.mark.works_with("openai", "chat.completions.parse (pydantic), chat.completions.stream")
def test_parse(sdk, record):
    ask = [{"role": "user", "content": "Name a city in Japan as JSON."}]
    parsed = sdk.chat.completions.parse(model=MODEL, messages=ask, response_format=City, temperature=0,
                                        max_tokens=64).choices[0].message.parsed
    assert isinstance(parsed, City)
    with sdk.chat.completions.stream(model=MODEL, messages=ask, response_format=City, temperature=0,
                                     max_tokens=64) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion().choices[0].message.parsed
    assert isinstance(final, City) and "content.done" in events
    record(openai.__version__, stream_events=len(events))


@pytest.mark.works_with("openai", "tools: tool_choice forced, required, and parse with pydantic_function_tool")
def test_tools(sdk, record):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = sdk.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], temperature=0, max_tokens=64,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    required = sdk.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=128)
    assert len(required.choices[0].message.tool_calls) == 1 and required.choices[0].finish_reason == "tool_calls"
    parsed = sdk.chat.completions.parse(model=MODEL, messages=ask, tools=[openai.pydantic_function_tool(GetWeather)],
                                        tool_choice="required", parallel_tool_calls=False, temperature=0,
                                        max_tokens=128)
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)
    record(openai.__version__, tool_calls=3)


@pytest.mark.works_with("openai", "responses.create (text, streamed, tools), responses.parse")
def test_responses(sdk, record):
    resp = sdk.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                max_output_tokens=32)
    assert resp.status == "completed" and "Paris" in resp.output_text and resp.usage.output_tokens > 0
    events = [e.type for e in sdk.responses.create(model=MODEL, input="Say hi.", temperature=0, max_output_tokens=32,
                                                   stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    tool = {"type": "function", **WEATHER["function"]}
    called = sdk.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                  tool_choice="required", parallel_tool_calls=False, temperature=0,
                                  max_output_tokens=128)
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    parsed = sdk.responses.parse(model=MODEL, input="Paris is a city in France. Give its name and country.",
                                 text_format=City, temperature=0, max_output_tokens=64)
    assert isinstance(parsed.output_parsed, City)
    record(openai.__version__, output_tokens=resp.usage.output_tokens, stream_events=len(events))
