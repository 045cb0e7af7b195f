"""LiteLLM's client against the stack (provider `openai/`, and `text-completion-openai/` for
completions), from its own venv: its pins clash with the project's (python-dateutil, via boto3)."""

from __future__ import annotations

import pytest
from steps import MODEL, case, run_step

pytestmark = [pytest.mark.slow, pytest.mark.clients]


@pytest.mark.parametrize("step", [
    case("litellm", "completion", "completion"),
    case("litellm", "stream", "completion, streamed (include_usage)"),
    case("litellm", "acompletion", "acompletion, two at once"),
    case("litellm", "tools", "completion with a named tool_choice"),
    case("litellm", "text_completion", "text_completion"),
])
def test_litellm(stack, record, step):
    out = run_step("litellm", "litellm_steps.py", stack.url + "/v1", MODEL, step)
    record(out.pop("version"), **out)
