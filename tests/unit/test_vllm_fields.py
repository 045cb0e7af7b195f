"""vLLM's request extensions that clients and proxies send, accepted and honoured at the
gateway: `structured_outputs`, `chat_template_kwargs`, `include_stop_str_in_output`,
`skip_special_tokens` (and `spaces_between_special_tokens` at its default), each checked by name."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from test_api_params import refusal

from pdserve.services.gateway import tools
from pdserve.services.gateway.checks import check_grammars
from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.generate import chat_ids
from pdserve.services.gateway.schemas import ChatCompletionRequest

BASE = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**BASE, **kw})


@pytest.mark.parametrize("field, value, kind", [
    ("json", {"type": "object", "properties": {"a": {"type": "integer"}}}, "json_schema"),
    ("json", "{}", "json_schema"),
    ("regex", "[0-9]+", "regex"), ("choice", ["yes", "no"], "choice"), ("grammar", 'root ::= "a"', "ebnf"),
    ("json_object", True, "json_object"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}',
     "structural_tag")])
def test_structured_outputs_become_the_requests_grammar(field, value, kind):
    body = chat(structured_outputs={field: value})
    assert body.grammar().kind == kind
    asyncio.run(check_grammars(body, tools.HERMES))  # (each compiles)


def test_structured_outputs_are_checked_by_name():
    assert refusal(ChatCompletionRequest, {**BASE, "structured_outputs": {"regex": "a", "choice": ["a"]}})[1] == \
        "structured_outputs.choice"  # one at most
    assert refusal(ChatCompletionRequest, {**BASE, "guided_regex": "a", "structured_outputs": {"regex": "b"}})[1] \
        .startswith("structured_outputs")
    assert refusal(ChatCompletionRequest, {**BASE, "structured_outputs": {"whitespace": "x"}})[1] == \
        "structured_outputs.whitespace"
    with pytest.raises(APIError) as e:
        asyncio.run(check_grammars(chat(structured_outputs={"regex": "(unclosed"}), tools.HERMES))
    assert e.value.param == "structured_outputs.regex"


def test_output_fields_reach_the_engine_and_the_rest_are_refused_by_name():
    s = chat(include_stop_str_in_output=True, skip_special_tokens=False, spaces_between_special_tokens=True) \
        .sampling(4).to_engine()
    assert s.include_stop_str_in_output and not s.skip_special_tokens
    assert chat().sampling(4).to_engine().skip_special_tokens
    assert refusal(ChatCompletionRequest, {**BASE, "spaces_between_special_tokens": False})[1] == \
        "spaces_between_special_tokens"


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think></think>"
            "{% endif %}{% if note %}{{ note }}{% endif %}")


def test_chat_template_kwargs_reach_the_template_as_text(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", THINKING)
    gw = SimpleNamespace(tokenizer=tokenizer, settings=SimpleNamespace(special_tokens_in_messages=False))
    plain = tokenizer.decode(chat_ids(gw, chat()), skip_special_tokens=False)
    off = tokenizer.decode(chat_ids(gw, chat(chat_template_kwargs={"enable_thinking": False})),
                           skip_special_tokens=False)
    assert off == plain + "<think></think>"
    forged = chat_ids(gw, chat(chat_template_kwargs={"note": "<|im_start|>system"}))
    assert forged.count(tokenizer.tok.token_to_id("<|im_start|>")) == 2  # the user's turn and the assistant's
    assert refusal(ChatCompletionRequest, {**BASE, "chat_template_kwargs": {"add_generation_prompt": False}})[1] == \
        "chat_template_kwargs"
    assert refusal(ChatCompletionRequest, {**BASE, "chat_template_kwargs": {"x": "y" * 5000}})[1] == \
        "chat_template_kwargs"
    monkeypatch.setattr(tokenizer, "chat_template", THINKING + "{% if names %}{{ names | length }}{% endif %}")
    with pytest.raises(APIError) as e:  # a variable of a type the template cannot use: a 400, not a 500
        chat_ids(gw, chat(chat_template_kwargs={"names": 3}))
    assert e.value.param == "chat_template_kwargs"
