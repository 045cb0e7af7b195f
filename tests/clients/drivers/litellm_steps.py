"""LiteLLM's client against the gateway, run in LiteLLM's venv: `python litellm_steps.py BASE_URL
MODEL STEP` prints one JSON line of numbers, or fails with the client's traceback."""

from __future__ import annotations

import asyncio
import json
import sys
from importlib.metadata import version

import litellm

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def completion(kw: dict) -> dict:
    resp = litellm.completion(messages=ASK, **kw)
    assert isinstance(resp.choices[0].message.content, str) and resp.usage.completion_tokens > 0
    return {"completion_tokens": resp.usage.completion_tokens}


def stream(kw: dict) -> dict:
    chunks = list(litellm.completion(messages=ASK, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    return {"chunks": len(chunks)}


def acompletion(kw: dict) -> dict:
    async def both():
        return await asyncio.gather(*(litellm.acompletion(messages=ASK, **kw) for _ in range(2)))
    answers = asyncio.run(both())
    assert all(isinstance(a.choices[0].message.content, str) for a in answers)
    return {"requests": len(answers)}


def tools(kw: dict) -> dict:
    resp = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
                              tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    return {"tool_calls": len(resp.choices[0].message.tool_calls)}


def text_completion(kw: dict) -> dict:
    kw = kw | {"model": "text-completion-openai/" + kw["model"].removeprefix("openai/")}
    resp = litellm.text_completion(prompt="The capital of France is", **kw)
    assert isinstance(resp.choices[0].text, str) and resp.choices[0].text
    return {"completion_tokens": resp.usage.completion_tokens}


STEPS = {"completion": completion, "stream": stream, "acompletion": acompletion, "tools": tools,
         "text_completion": text_completion}

if __name__ == "__main__":
    base_url, model, step = sys.argv[1:4]
    litellm.telemetry = False
    kw = {"model": "openai/" + model, "api_base": base_url, "api_key": "unused", "temperature": 0, "max_tokens": 64,
          "timeout": 120, "num_retries": 0}
    print(json.dumps({"version": version("litellm"), **STEPS[step](kw)}))
