"""OpenAI's Responses API (`client.responses`) through the real stack: text, a conversation of
items, streaming events, tools (a call, then its output sent back), structured output (`parse`)
and the stateful fields refused by name."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import MODEL
from pydantic import BaseModel

pytestmark = pytest.mark.slow
PARIS = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class City(BaseModel):
    name: str
    country: str


def test_text_answer_as_a_response_object(client):
    resp = client.responses.create(model=MODEL, input=PARIS, temperature=0, max_output_tokens=32)
    assert resp.object == "response" and resp.status == "completed" and resp.id.startswith("resp_")
    assert "Paris" in resp.output_text
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.usage.input_tokens > 10 and 0 < resp.usage.output_tokens <= 32
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_instructions_and_input_items_are_the_conversation(client):
    resp = client.responses.create(model=MODEL, instructions="Answer in one word.", temperature=0,
                                   max_output_tokens=16, input=[
                                       {"role": "user", "content": "Name a primary colour."},
                                       {"type": "message", "role": "assistant",
                                        "content": [{"type": "output_text", "text": "Red."}]},
                                       {"role": "user", "content": [{"type": "input_text", "text": PARIS}]}])
    assert resp.status == "completed" and resp.output_text


def test_streamed_events_make_the_same_answer(client):
    whole = client.responses.create(model=MODEL, input=PARIS, temperature=0, max_output_tokens=24)
    events = list(client.responses.create(model=MODEL, input=PARIS, temperature=0, max_output_tokens=24,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_call_then_its_output(client):
    resp = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                   tool_choice="required", temperature=0, max_output_tokens=64)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    call = calls[0]
    follow = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=24, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}])
    assert follow.status == "completed" and follow.output


def test_a_streamed_tool_call_has_its_argument_events(client):
    events = list(client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                          max_output_tokens=64, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and "city" in json.loads(done[0].arguments)
    final = events[-1].response
    assert [o.type for o in final.output if o.type == "function_call"] == ["function_call"] * len(done)


def test_parse_gives_the_structured_output(client):
    resp = client.responses.parse(model=MODEL, input="Paris is a city in France. Give its name and country.",
                                  text_format=City, temperature=0, max_output_tokens=48)
    assert isinstance(resp.output_parsed, City)


def test_max_output_tokens_reached_is_incomplete(client):
    resp = client.responses.create(model=MODEL, input="Write a long story about rivers.", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3


@pytest.mark.parametrize("field,value", [("previous_response_id", "resp_123"), ("store", True),
                                         ("background", True), ("reasoning", {"effort": "high"})])
def test_stateful_and_reasoning_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=PARIS, **{field: value})
    assert e.value.body["param"] == field and "not supported" in e.value.body["message"]


@pytest.mark.parametrize("extra,param", [
    ({"input": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "input.0"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format.schema"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "bogus"}}]}, "tools"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools.0.name"),
])
def test_a_bad_field_is_named_as_this_api_names_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": PARIS, **extra})
    assert e.value.body["param"] == param, e.value.body
    assert "messages" not in e.value.body["message"] and "response_format" not in e.value.body["message"]
