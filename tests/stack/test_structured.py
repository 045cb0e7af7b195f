"""Structured output through the stack with the official client: response_format
(json_schema through the SDK's pydantic helper, json_object), vLLM's guided_* extensions,
streamed too, and grammars that do not compile refused by name. On the session's fake-model stack
(tests/stack/conftest.py): the grammar constrains the fake's tokens as it does a model's; what is
tested is that the constrained answers parse and the API carries them, not what a model writes."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import openai
import pytest
from conftest import MODEL
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Sydney", "Toronto", "Berlin", "Mumbai", "Nairobi", "Rome",
          "Madrid", "Seoul", "Bangkok", "Mexico City", "Buenos Aires", "Moscow", "Lagos", "Oslo", "Dublin", "Chicago"]


class City(BaseModel):
    """Every string and number bounded: the answer always ends within max_tokens."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)
    famous_for: list[Annotated[str, Field(max_length=40)]] = Field(max_length=3)
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]


@pytest.fixture(scope="module")
def client(fake_client):
    return fake_client


def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe the city of {city} as JSON."}]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_json_schema_answers_parse_into_the_pydantic_model_on_20_prompts(client, temperature):
    def one(i_city):
        i, city = i_city
        return client.beta.chat.completions.parse(model=MODEL, messages=ask(city), response_format=City,
                                                  temperature=temperature, seed=i, max_tokens=300)

    with ThreadPoolExecutor(len(CITIES)) as pool:  # one batch: the 20 decode together
        answers = list(pool.map(one, enumerate(CITIES)))
    for a in answers:
        choice = a.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)  # the SDK validated it against the model
        assert choice.message.content == choice.message.content.strip()


def test_json_object_streamed_equals_non_streamed_and_parses(client):
    kw = dict(model=MODEL, messages=ask("Vienna"), temperature=0, max_tokens=120,
              response_format={"type": "json_object"}, extra_body={"repetition_penalty": 1.3})
    full = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == full.message.content
    if full.finish_reason == "stop":
        assert isinstance(json.loads(full.message.content), dict)
    else:  # cut by max_tokens: still a prefix of one object
        assert full.message.content.startswith("{")


def test_guided_choice_regex_and_grammar(client):
    choices = ["positive", "negative", "neutral"]
    for review in ("I loved every minute of it!", "Terrible food, rude staff.", "It was a restaurant."):
        msgs = [{"role": "user", "content": f"Sentiment of this review: {review}"}]
        got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                             extra_body={"guided_choice": choices})
        assert got.choices[0].message.content in choices
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    got = client.completions.create(model=MODEL, prompt="Call us at", max_tokens=20, temperature=0.9, seed=3,
                                    extra_body={"guided_regex": phone})
    assert re.fullmatch(phone, got.choices[0].text) and got.choices[0].finish_reason == "stop"
    yes_no = 'root ::= ("yes" | "no") "."'
    got = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=8, temperature=0,
                                    extra_body={"guided_grammar": yes_no})
    assert got.choices[0].text in ("yes.", "no.")


def test_grammars_that_do_not_compile_are_refused_by_name(client):
    for extra, param in [({"guided_regex": "[a-"}, "guided_regex"),
                         ({"guided_json": {"type": "strin"}}, "guided_json"),
                         ({"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": {"type": 3}}}},
                          "response_format.json_schema.schema"),
                         ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ask("Paris"), max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a timezone.",
                                         "parameters": {"type": "object", "properties": {
                                             "timezone": {"type": "string", "maxLength": 40}},
                                             "required": ["timezone"]}}}


def test_a_tool_call_round_trip(client):
    """required: the answer is a call with arguments that follow the schema; the result goes
    back as a tool message and the model answers in text."""
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                           temperature=0, max_tokens=120)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    required = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]["required"]
    assert set(required) <= set(args)
    alone = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="none",
                                           max_tokens=1)
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    answer = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result were in the prompt


def test_a_named_tool_streamed_equals_non_streamed(client):
    """(max_tokens for the fake, whose 40-character argument ends in one-character tokens: ~90 in all)"""
    msgs = [{"role": "user", "content": "What time is it in Tokyo?"}]
    kw = dict(model=MODEL, messages=msgs, tools=[WEATHER, TIME], temperature=0, max_tokens=300,
              tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    full = client.chat.completions.create(**kw).choices[0]
    assert [c.function.name for c in full.message.tool_calls] == ["get_time"]
    assert "timezone" in json.loads(full.message.tool_calls[0].function.arguments)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "get_time", full.message.tool_calls[0].function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_gives_text_or_calls_that_follow_their_schema(client):
    for question in ("What is the weather in Rome in celsius?", "Tell me a joke about cats."):
        got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                             tools=[WEATHER], temperature=0, max_tokens=80).choices[0]
        for call in got.message.tool_calls or ():
            assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "unit"}
        assert got.message.content or got.message.tool_calls
