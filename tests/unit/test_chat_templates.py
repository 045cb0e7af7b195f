"""Chat templates as transformers' apply_chat_template renders them: its globals, `tools` for
templates that read them (the Hermes listing for those that do not), a template's own refusal,
a model with none, and the operator's template instead of the model's (PD_CHAT_TEMPLATE)."""

from __future__ import annotations

import datetime
import json
from types import SimpleNamespace

import pytest
from jinja2.exceptions import TemplateError

from bench.engine import tiny_archs
from pdserve.services.gateway import tools
from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.generate import chat_ids
from pdserve.services.gateway.responses_request import param_of
from pdserve.services.gateway.schemas import ChatCompletionRequest
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.tokenizer import template_text

# the shape of Qwen2.5's template: tools listed in the system turn, calls written with tojson
WITH_TOOLS = """{%- if messages[0].role == 'assistant' %}{{ raise_exception('the first turn is the user') }}{% endif -%}
<|im_start|>system
Today is {{ strftime_now('%Y') }}.
{%- if tools %} Tools:{% for t in tools %} {{ t.function.name }}{{ t.function.parameters | tojson }}
{%- endfor %}{% endif %}
<|im_end|>
{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}
<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    t = load(str(tiny_archs.save("qwen3", tmp_path_factory.mktemp("m"), tokenizer=True))).tokenizer
    assert t is not None
    return t


def test_a_template_that_reads_tools_gets_them_and_the_calls_as_objects(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", WITH_TOOLS)
    assert tok.template_takes_tools
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "",
                                                                     "tool_calls": [call]}]
    text = tok.apply_chat_template(tools.template_messages(messages), tools=tools.listing([WEATHER]))
    assert f"Today is {datetime.date.today().year}." in text  # strftime_now
    assert "Tools: get_weather" + json.dumps(WEATHER["parameters"]) in text
    assert '<tool_call>{"city": "Paris"}</tool_call>' in text  # an object, not JSON text quoted again
    with pytest.raises(TemplateError, match="the first turn is the user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_a_template_without_tools_gets_the_hermes_listing(tok, monkeypatch):
    assert not tok.template_takes_tools  # the tiny model's ChatML
    text = tok.apply_chat_template(tools.prompt_messages([{"role": "user", "content": "Weather?"}], [WEATHER]))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text


def test_the_operators_template_is_a_text_or_a_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(WITH_TOOLS)
    assert template_text(str(f)) == WITH_TOOLS == template_text(WITH_TOOLS)
    with pytest.raises(ValueError, match="neither a Jinja template nor a file"):
        template_text(str(tmp_path / "missing.jinja"))


def test_a_model_without_a_chat_template_refuses_conversations_with_a_400(tok, monkeypatch):
    """A base model (gemma3-270m's) has no template: a chat, Responses or /tokenize conversation
    is a 400 naming the messages (vLLM's answer too), not a 500."""
    monkeypatch.setattr(tok, "chat_template", None)
    gw = SimpleNamespace(tokenizer=tok, settings=SimpleNamespace(special_tokens_in_messages=False))
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(APIError) as e:
        chat_ids(gw, body)
    assert e.value.status == 400 and e.value.param == "messages" and "no chat template" in e.value.message
    assert param_of(e.value.param) == "input"  # (a Responses request's name for them)
