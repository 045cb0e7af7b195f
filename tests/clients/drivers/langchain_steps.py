"""LangChain's ChatOpenAI against the gateway, run in LangChain's venv: `python langchain_steps.py
BASE_URL MODEL STEP` prints one JSON line of numbers, or fails with the client's traceback."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

ASK = "What is the capital of France?"


class City(BaseModel):
    """A city and its country."""
    name: str
    country: str


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def invoke(llm: ChatOpenAI) -> dict:
    msg = llm.invoke(ASK)
    assert isinstance(msg.content, str) and msg.content and msg.usage_metadata["output_tokens"] > 0
    return {"output_tokens": msg.usage_metadata["output_tokens"]}


def stream(llm: ChatOpenAI) -> dict:
    chunks = list(llm.stream(ASK, stream_usage=True))
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert isinstance(total.content, str) and total.content and total.usage_metadata["output_tokens"] > 0
    return {"chunks": len(chunks), "output_tokens": total.usage_metadata["output_tokens"]}


def tools(llm: ChatOpenAI) -> dict:
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather" and "city" in msg.tool_calls[0]["args"]
    return {"tool_calls": len(msg.tool_calls)}


def structured(llm: ChatOpenAI) -> dict:
    kinds = {}
    for method in ("json_schema", "function_calling", "json_mode"):
        out = llm.with_structured_output(City, method=method).invoke(
            "Name a city in Japan as JSON with keys name and country.")
        assert isinstance(out, City), (method, out)
        kinds[method] = 1
    return {"methods": len(kinds)}


STEPS = {"invoke": invoke, "stream": stream, "tools": tools, "structured": structured}

if __name__ == "__main__":
    base_url, model, step = sys.argv[1:4]
    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=64, max_retries=0,
                     timeout=120)
    print(json.dumps({"version": version("langchain-openai"), **STEPS[step](llm)}))
