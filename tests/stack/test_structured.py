"""Structured output through the real stack with the official client: response_format
(json_schema through the SDK's pydantic helper, json_object), vLLM's guided_* extensions,
streamed too, and grammars that do not compile refused by name."""

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


def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe the city of {city} as JSON."}]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_json_schema_answers_parse_into_the_pydantic_model_on_20_prompts(client, temperature):
    def one(i_city):
        i, city = i_city
        return client.beta.chat.completions.parse(model=MODEL, messages=ask(city), response_format=City,
                                                  temperature=temperature, seed=i, max_tokens=300)

    with ThreadPoolExecutor(8) as pool:
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
