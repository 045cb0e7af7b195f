"""LangChain's ChatOpenAI against the stack, from its own venv (or the project's once `make setup`
has installed it): invoke, stream, tools, structured output."""

from __future__ import annotations

import pytest
from steps import MODEL, case, run_step

pytestmark = [pytest.mark.slow, pytest.mark.clients]


@pytest.mark.parametrize("step", [
    case("langchain", "invoke", "ChatOpenAI.invoke"),
    case("langchain", "stream", "ChatOpenAI.stream (stream_usage)"),
    case("langchain", "tools", "bind_tools with a named tool_choice"),
    case("langchain", "structured", "with_structured_output: json_schema, function_calling, json_mode"),
])
def test_chat_openai(stack, record, step):
    out = run_step("langchain", "langchain_steps.py", stack.url + "/v1", MODEL, step)
    record(out.pop("version"), **out)
